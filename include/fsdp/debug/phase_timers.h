// layer: sharding
#pragma once
// Where FSDP's own time goes on a rank's main thread, by phase: wall-clock nanoseconds, the
// thread's CPU nanoseconds (CLOCK_THREAD_CPUTIME_ID) and calls, summed over all units since the
// last reset. Off by default (then each phase costs one relaxed atomic load); on with
// FSDP_PHASE_TIMERS=1 in the environment or set_phase_timers(true).
//
// Wall and CPU differ by the time the thread was not running: blocked in a wait for a collective
// (Gloo's threads receive and sum meanwhile), or preempted. The CPU time is what FSDP itself costs
// the process on that thread; bench splits each step's CPU into compute, transport and this.
//
// Example:
//   fsdp::set_phase_timers(true);
//   fsdp::reset_phase_timers();
//   const int steps = 10;
//   for (int i = 0; i < steps; ++i) {
//     optimizer.zero_grad();
//     fsdp::models::gpt_loss(fsdp::call(model, tokens), targets).backward();
//     optimizer.step();
//   }
//   fsdp::PhaseTimes t = fsdp::phase_times();
//   std::cout << t.table(steps);   // calls, wall ms and CPU ms per step for each phase
//
// The phases are the leaves of FSDP's work (they do not nest): copy-in, issuing the all-gather,
// waiting for it, copy-out, freeing, the reduce-scatter input, issuing the reduce-scatter, waiting
// for it (and for HSDP's all-reduce), writing the sharded gradients, trimming the buffer pool.
// `hooks` is inclusive: all time inside FSDP's forward/backward hooks (the leaves above that run
// there, plus bookkeeping). On a GPU the times are host times (issuing, not the kernels).
#include <array>
#include <cstdint>
#include <string>

namespace fsdp {

enum class Phase : int {
  CopyIn = 0,          // shards -> all-gather input (copy_in_all_gather_input)
  AllGatherIssue,      // the all-gather call (Gloo p2p: the sends are written from this thread)
  AllGatherWait,       // blocked until the gathered rows are here
  CopyOut,             // all-gather output -> unsharded parameters
  Reshard,             // freeing the unsharded parameters (and post-forward shards)
  ReduceScatterInput,  // unsharded gradients -> reduce-scatter input
  ReduceScatterIssue,  // the reduce-scatter call
  ReduceScatterWait,   // blocked until this rank's reduced shard is here (and HSDP's all-reduce)
  GradAccumulate,  // reduced shard -> .grad of the sharded parameters (a custom divide factor's division is not in it)
  PoolTrim,        // trim_cached_buffers after forward
  Hooks,           // inclusive: every FSDP hook (pre/post forward, pre/post backward, final callback)
  Count
};
const char* phase_name(Phase p);

struct PhaseTimes {
  std::array<uint64_t, static_cast<size_t>(Phase::Count)> ns{};      // wall
  std::array<uint64_t, static_cast<size_t>(Phase::Count)> cpu_ns{};  // the timing thread's CPU
  std::array<uint64_t, static_cast<size_t>(Phase::Count)> calls{};
  // The phases that ran outside every hook (FSDPModule::unshard called directly, say): with
  // Hooks, they make all of FSDP's timed time (own_cpu_ms).
  uint64_t unhooked_ns = 0, unhooked_cpu_ns = 0;
  double ms(Phase p) const { return static_cast<double>(ns[static_cast<size_t>(p)]) / 1e6; }
  double cpu_ms(Phase p) const { return static_cast<double>(cpu_ns[static_cast<size_t>(p)]) / 1e6; }
  // All CPU time FSDP's timed code took on the threads that ran it: the hooks (inclusive) and
  // the phases run outside them.
  double own_cpu_ms() const { return cpu_ms(Phase::Hooks) + static_cast<double>(unhooked_cpu_ns) / 1e6; }
  // What was added between `before` and this (both from phase_times(), no reset between).
  PhaseTimes operator-(const PhaseTimes& before) const;
  // Markdown table: phase, calls per step, wall ms per step, CPU ms per step (steps >= 1).
  std::string table(int steps) const;
};

void set_phase_timers(bool on);
bool phase_timers_enabled();
void reset_phase_timers();
PhaseTimes phase_times();

}  // namespace fsdp
