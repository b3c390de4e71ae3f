// FSDP_CPU_BIND=cores: each rank of a host on its own CPUs (fsdp/debug/cpu_tuning.h).
//
// [Note: ranks bound to cores]
// On a host whose cores the ranks fill (bench: 2 ranks of one compute thread on 2 cores), a
// rank's transport (Gloo's loop thread reading and writing the sockets, its workers) needs CPU
// while both cores compute. Left to the scheduler, a woken transport thread runs where it was
// woken: on loopback TCP the sender's core, the other rank's. Over a backward that core runs both
// ranks' transport, its rank falls behind by that CPU, and at the last reduce-scatter the other
// rank waits with its core idle for about as long as the other's lag: the same order as the whole
// transport's CPU. Binding each rank, its transport threads with it, to its own core makes every
// rank pay for its own transport only, so the ranks stay level; but a transport thread woken on a
// core whose compute thread is running then waits for that thread's slice (EEVDF's base slice,
// scaled by the core count), once per message, so binding alone makes the collectives slower.
// Gloo's threads therefore ask for the shortest slice (100 us, sched_setattr's sched_runtime, Linux
// 6.12+): a shorter slice is an earlier deadline, so a woken transport thread preempts the
// compute thread at once and gives the core back after its short burst. Both together keep the
// ranks level and cut the idle time (docs/benchmarks.md, "What each CPU setting buys"). Not the
// default: binding is only right when this job owns the host's cores.
#include "fsdp/debug/cpu_tuning.h"

#include <sched.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "comm/process_threads.h"

namespace fsdp::dist {

CpuBind cpu_bind_from_env() {
  const char* v = std::getenv("FSDP_CPU_BIND");
  const std::string s = v ? v : "";
  if (s.empty() || s == "none") return CpuBind::None;
  if (s == "cores") return CpuBind::Cores;
  throw std::invalid_argument("FSDP_CPU_BIND='" + s +
                              "' is not a binding: use cores (each rank of this host on its own CPUs, when the job "
                              "owns the host's cores) or none (the default), or unset it");
}

std::vector<int> cpus_for_local_rank(const std::vector<int>& allowed, int local_rank, int local_world) {
  if (allowed.empty()) return {};
  if (local_world < 1) local_world = 1;
  if (local_rank < 0) local_rank = 0;
  const size_t n = allowed.size(), w = static_cast<size_t>(local_world), r = static_cast<size_t>(local_rank) % w;
  if (n < w) return {allowed[r % n]};
  const size_t k = n / w;
  return std::vector<int>(allowed.begin() + static_cast<std::ptrdiff_t>(r * k),
                          allowed.begin() + static_cast<std::ptrdiff_t>(r * k + k));
}

std::vector<int> bind_to_local_cpus(int local_rank, int local_world) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  if (sched_getaffinity(0, sizeof mine, &mine) != 0) return {};
  std::vector<int> allowed;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &mine)) allowed.push_back(c);
  }
  const std::vector<int> cpus = cpus_for_local_rank(allowed, local_rank, local_world);
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  // Every thread alive now, this one included (sched_setaffinity binds one thread); threads
  // started later inherit it.
  bool any = false;
  for (long t : comm::detail::process_thread_ids()) {
    any = sched_setaffinity(static_cast<pid_t>(t), sizeof set, &set) == 0 || any;
  }
  return any ? cpus : std::vector<int>();
}

}  // namespace fsdp::dist
