#include "fsdp/comm/backend.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <c10/core/impl/VirtualGuardImpl.h>

#include <mutex>
#include <thread>

#include "comm/async_watch.h"
#include "comm/process_threads.h"
#include "fsdp/compat/nccl.h"

namespace fsdp::comm {

bool nccl_available() {
#ifdef FSDP_HAS_NCCL
  return true;
#else
  return false;
#endif
}

BackendKind backend_for_device(const std::string& device_type) {
  if (device_type == "cpu") return BackendKind::Gloo;
  if (device_type == "cuda") {
    if (!nccl_available()) {
      throw std::invalid_argument(
          "fsdp: device type 'cuda' needs the NCCL backend, but this build has none (LibTorch " +
          std::string(TORCH_VERSION) +
          " without CUDA/NCCL); rebuild against a CUDA LibTorch "
          "(-DCMAKE_PREFIX_PATH=/path/to/libtorch) or use device type 'cpu'");
    }
    return BackendKind::Nccl;
  }
  throw std::invalid_argument("fsdp: unknown device type '" + device_type + "'; use \"cpu\" (Gloo) or \"cuda\" (NCCL)");
}

int gloo_threads() {
  const char* v = std::getenv("FSDP_GLOO_THREADS");
  if (v == nullptr || *v == '\0') return 2;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 1 || n > 64) {
    throw std::invalid_argument("FSDP_GLOO_THREADS='" + std::string(v) +
                                "' is not a number of Gloo worker threads per process group: use 1 to 64, or unset it "
                                "for 2");
  }
  return static_cast<int>(n);
}

namespace {
std::atomic<int> g_default_slice_us{0};
}  // namespace

void set_default_transport_slice_us(int us) { g_default_slice_us = us; }

int transport_slice_us() {
  const char* v = std::getenv("FSDP_TRANSPORT_SLICE_US");
  if (v == nullptr || *v == '\0') return g_default_slice_us;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || (n != 0 && (n < 100 || n > 100000))) {
    throw std::invalid_argument("FSDP_TRANSPORT_SLICE_US='" + std::string(v) +
                                "' is not a scheduler slice for Gloo's threads: use 100 to 100000 (microseconds, "
                                "the kernel's bounds), 0 for the kernel's default, or unset it");
  }
  return static_cast<int>(n);
}

namespace {

// sched_setattr's argument (linux/sched/types.h; glibc 2.36 has no wrapper).
struct SchedAttr {
  uint32_t size;
  uint32_t sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime, sched_deadline, sched_period;
  uint32_t sched_util_min, sched_util_max;
};

// The threads in `after` and not in `before` (Gloo's, started while a group was made) ask for a
// slice of `us` microseconds; their nice value stays. Best effort: a kernel that refuses leaves
// them as they were.
void set_slice_of_new_threads(const std::vector<long>& before, const std::vector<long>& after, int us) {
  for (long t : after) {
    if (std::binary_search(before.begin(), before.end(), t)) continue;
    SchedAttr a{};
    a.size = sizeof a;
    if (syscall(SYS_sched_getattr, t, &a, sizeof a, 0u) != 0) continue;
    a.size = sizeof a;
    a.sched_flags = 0;
    a.sched_runtime = static_cast<uint64_t>(us) * 1000;
    (void)syscall(SYS_sched_setattr, t, &a, 0u);
  }
}

bool is_loopback(const std::string& host) { return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0; }

// The address this machine uses to reach `host`: the source address of its route there, or "" when
// there is none. No packet is sent: connect() on a UDP socket only picks the route. This is the
// interface the other hosts can reach this rank on, whatever this machine's host name resolves to
// (Debian maps it to 127.0.1.1, on which Gloo would fall back to the loopback).
std::string local_address_towards(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (host.empty() || getaddrinfo(host.c_str(), "9", &hints, &res) != 0) return {};
  std::string out;
  for (addrinfo* ai = res; ai != nullptr && out.empty(); ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    char buf[NI_MAXHOST];
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 && getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0 &&
        getnameinfo(reinterpret_cast<sockaddr*>(&ss), len, buf, sizeof(buf), nullptr, 0, NI_NUMERICHOST) == 0) {
      out = buf;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return out;
}

compat::BackendPtr make_gloo(const compat::StorePtr& store, int rank, int size, std::chrono::milliseconds timeout,
                             const std::string& hostname_hint) {
  // The threads alive before the device (its loop thread) and the group (its workers) exist.
  const int slice_us = transport_slice_us();
  const std::vector<long> before = slice_us > 0 ? detail::process_thread_ids() : std::vector<long>();
  auto opts = c10d::ProcessGroupGloo::Options::create();
  opts->timeout = timeout;
  // GLOO_SOCKET_IFNAME wins, as in PyTorch; a single-host job stays on the loopback interface; a
  // multi-host one binds the address on the route to the master (hint), which the other hosts reach.
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
  } else if (is_loopback(hostname_hint)) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
  } else if (const std::string local = local_address_towards(hostname_hint); !local.empty() && !is_loopback(local)) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(local));
  } else {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  opts->threads = gloo_threads();
  auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
  if (slice_us > 0) set_slice_of_new_threads(before, detail::process_thread_ids(), slice_us);
  // [Note: a Gloo group is formed when every member has formed it]
  // ProcessGroupGloo's constructor returns once this rank's own connections are up, which can be
  // before a peer has finished its side of the handshake. A rank that then has nothing to send
  // (a checkpoint load reads only files) can finish and close its sockets while that peer is
  // still connecting, and the peer fails with Gloo's "Connection closed by peer" (pair.cc) in a
  // job that did nothing wrong. PyTorch met the same in its own Gloo tests (pull request 61396)
  // and fixed it the same way: a barrier on the new group, so no member leaves group formation
  // before every member has its connections. One small message per group made, with the group's
  // timeout.
  c10d::BarrierOptions barrier;
  barrier.timeout = timeout;
  pg->barrier(barrier)->wait();
  return pg;
}

#ifdef FSDP_HAS_NCCL
struct NcclGroups {
  std::mutex mu;
  std::vector<c10::weak_intrusive_ptr<c10d::ProcessGroupNCCL>> groups;
};
NcclGroups& nccl_groups() {
  static NcclGroups g;
  return g;
}
void remember_nccl_group(const c10::intrusive_ptr<c10d::ProcessGroupNCCL>& pg) {
  auto& g = nccl_groups();
  std::lock_guard<std::mutex> lock(g.mu);
  g.groups.emplace_back(pg);
}
#endif

}  // namespace

size_t shutdown_nccl_groups(std::chrono::milliseconds wait_limit) {
  size_t n = 0;
#ifdef FSDP_HAS_NCCL
  // Whatever is still queued finishes first (the watch ends the process if it never does).
  const auto start = std::chrono::steady_clock::now();
  while (detail::watched_collectives() > 0) {
    if (detail::watch_stopped() || std::chrono::steady_clock::now() - start >= wait_limit) return 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  auto& g = nccl_groups();
  std::lock_guard<std::mutex> lock(g.mu);
  for (auto& weak : g.groups) {
    if (auto pg = weak.lock()) n += compat::nccl_shutdown(*pg) ? 1 : 0;
  }
  g.groups.clear();
#endif
  return n;
}

std::shared_ptr<Comm> make_comm(BackendKind kind, const compat::StorePtr& store, std::vector<int> global_ranks,
                                int group_rank, std::chrono::milliseconds timeout, const std::string& name,
                                const std::string& hostname_hint) {
  const int size = static_cast<int>(global_ranks.size());
  if (size == 1 && kind != BackendKind::Nccl) {
    return std::make_shared<Comm>(compat::BackendPtr(), BackendKind::Local, std::move(global_ranks), 0, timeout, name);
  }
  compat::BackendPtr backend;
  if (kind == BackendKind::Gloo) {
    backend = make_gloo(store, group_rank, size, timeout, hostname_hint);
  } else if (kind == BackendKind::Nccl) {
#ifdef FSDP_HAS_NCCL
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    // c10d's watchdog fires later than our collective watch (comm/async_watch.h), which ends a
    // hung collective with our message and the flight recorder's dump.
    opts->timeout = detail::backend_watchdog_timeout(timeout);
    // The group's device: the current CUDA device, which the rank sets before it makes its groups
    // (train_gpt: cuda:LOCAL_RANK), as PyTorch's init_process_group(device_id=...). Bound, the
    // communicator is made here, collectively with the other members, instead of inside the
    // first collective (where LibTorch can: compat/nccl.h).
    const c10::Device device = c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
    const bool bound = compat::nccl_bind_options(*opts, device);
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, group_rank, size, opts);
    if (bound || compat::nccl_bind_backend(*pg, device)) compat::nccl_connect_eagerly(*pg, device);
    remember_nccl_group(pg);
    backend = pg;
#else
    backend_for_device("cuda");  // throws the explanation
#endif
  } else {
    throw std::invalid_argument("fsdp: a local backend cannot span " + std::to_string(size) + " ranks");
  }
  return std::make_shared<Comm>(std::move(backend), kind, std::move(global_ranks), group_rank, timeout, name);
}

}  // namespace fsdp::comm
