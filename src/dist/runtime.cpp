#include "fsdp/dist/runtime.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>

#include "fsdp/comm/backend.h"
#include "fsdp/compat/store.h"
#include "fsdp/debug/cpu_tuning.h"

namespace fsdp::dist {

namespace {

// fsdprun's single-host contract, beside torchrun's variables (LaunchEnv):
//   FSDP_STORE_FILE   the store is the c10d FileStore at this path (under the same
//                     /worker/attempt_<n> prefix with TORCHELASTIC_USE_AGENT_STORE=True) instead of
//                     the TCPStore at MASTER_ADDR:MASTER_PORT: nothing listens on the network.
// A job is single-host when FSDP_STORE_FILE is set or the launcher says every rank is on this
// host (LaunchEnv::all_local: torchrun's LOCAL_WORLD_SIZE, Open MPI's or Slurm's local size equals
// the world's); Gloo then binds the loopback interface (unless GLOO_SOCKET_IFNAME is set).
struct StoreEnv {
  std::string file;
  bool single_host = false;
};

StoreEnv read_store_env(const LaunchEnv& env) {
  StoreEnv s;
  if (const char* f = std::getenv("FSDP_STORE_FILE"); f != nullptr) s.file = f;
  s.single_host = !s.file.empty() || env.all_local;
  return s;
}

struct Runtime {
  LaunchEnv env;
  StoreEnv store_env;
  InitOptions options;
  comm::BackendKind backend = comm::BackendKind::Gloo;
  compat::StorePtr store;
  std::shared_ptr<comm::Comm> world;
};

std::mutex g_mu;
std::unique_ptr<Runtime> g_runtime;

// [Note: NCCL at exit] A static is destroyed after the CUDA runtime has unloaded when it was made
// before CUDA's first use (CUDA registers its exit handler then): g_runtime's NCCL groups, aborted
// by ProcessGroupNCCL's destructor at that point, would call into a runtime that is gone. So a job
// on NCCL that never calls destroy_distributed() gets it from an exit handler registered after the
// world's communicator is made (handlers run in reverse order: ours before CUDA's). Collectives
// still queued then are not waited for (the collective watch has stopped: comm/async_watch.cpp):
// the groups are destroyed unshut, which aborts their communicators while CUDA is still there.
void release_at_exit() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_runtime) return;
  comm::shutdown_nccl_groups(std::chrono::seconds(2));
  g_runtime.reset();
}

void release_at_exit_once() {
  static const bool registered = std::atexit(release_at_exit) == 0;
  (void)registered;
}

Runtime& runtime() {
  if (!g_runtime) {
    throw DistError("fsdp: the distributed runtime is not initialised; call fsdp::dist::init_distributed() first");
  }
  return *g_runtime;
}

std::string seconds(std::chrono::milliseconds ms) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", static_cast<double>(ms.count()) / 1000.0);
  return buf;
}

bool mentions(const std::string& what, std::initializer_list<const char*> needles) {
  return std::any_of(needles.begin(), needles.end(), [&](const char* n) { return what.find(n) != std::string::npos; });
}

bool is_loopback(const std::string& host) { return host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0; }

// The host name that picks Gloo's interface (comm::make_comm): the loopback for a single-host job.
std::string gloo_host(const Runtime& rt) { return rt.store_env.single_host ? "127.0.0.1" : rt.env.master_addr; }

// fsdprun's single-host store (FSDP_STORE_FILE): a FileStore, no network at all.
compat::StorePtr open_file_store(const LaunchEnv& env, const std::string& path, std::chrono::milliseconds timeout) {
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  if (::access(dir.c_str(), R_OK | W_OK | X_OK) != 0) {
    throw DistError("fsdp: rank " + std::to_string(env.rank) + " cannot use the store file FSDP_STORE_FILE=" + path +
                    ": its folder " + dir + " is not usable (" + std::strerror(errno) + "). fsdprun sets it for the " +
                    "job's lifetime; unset it to use the TCP store at MASTER_ADDR:MASTER_PORT instead");
  }
  try {
    return compat::file_store(path, timeout);
  } catch (const std::exception& e) {
    throw DistError("fsdp: rank " + std::to_string(env.rank) + " cannot open the store file FSDP_STORE_FILE=" + path +
                    ": " + e.what());
  }
}

compat::StorePtr connect_store(const LaunchEnv& env, const StoreEnv& store_env, std::chrono::milliseconds timeout) {
  compat::StorePtr store;
  if (!store_env.file.empty()) {
    store = open_file_store(env, store_env.file, timeout);
  } else {
    const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
    const bool host = !env.use_agent_store && env.rank == 0;
    c10d::TCPStoreOptions opts = compat::tcp_store_options();
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = host;
    opts.numWorkers = static_cast<size_t>(env.world_size);
    opts.waitWorkers = false;  // the process-group rendezvous below waits for everybody, with a timeout
    opts.timeout = timeout;
    opts.multiTenant = host;
    try {
      // A single-host job's store listens on MASTER_ADDR only, where c10d lets us choose (2.x).
      // Not for other jobs: a host name can resolve to a loopback address on rank 0's machine
      // (Debian's 127.0.1.1), and the other machines could then not reach the store.
      if (host && (store_env.single_host || is_loopback(env.master_addr)))
        compat::listen_only_on(opts, env.master_addr);
      store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      if (host && mentions(what, {"Address already in use", "errno: 98", "EADDRINUSE"})) {
        throw DistError("fsdp: rank 0 cannot host the store: port " + std::to_string(env.master_port) + " is in use (" +
                        where +
                        "). Pick a free MASTER_PORT, or start with `fsdprun --master-port 0` "
                        "to get one.\n  cause: " +
                        what);
      }
      if (host) throw DistError("fsdp: rank 0 cannot host the store at " + where + ": " + what);
      throw DistError("fsdp: rank " + std::to_string(env.rank) + " could not reach the store at " + where + " within " +
                      seconds(timeout) + ". Is rank 0 (or the launcher) running, and do MASTER_ADDR/MASTER_PORT " +
                      "match on every rank?\n  cause: " + what);
    }
  }
  if (env.use_agent_store) {
    return c10::make_intrusive<c10d::PrefixStore>(env.store_prefix(), store);
  }
  return store;
}

// Drops what a failed start had made (the store: a TCPStore server's thread and connections)
// without letting a c10d destructor that blocks hold the error back: the teardown runs on a helper
// thread, waited for at most `limit`; past that it is left to finish on its own, or to end with
// the process. (On a loaded machine a failed start once did not end its process.)
void release_bounded(std::unique_ptr<Runtime> rt, std::chrono::milliseconds limit) {
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  std::thread([rt = std::move(rt), done]() mutable {
    rt.reset();
    done->set_value();
  }).detach();
  finished.wait_for(limit);
}

// [Note: waiting for peers] A rank that waits for the others (at the store, then in the world
// group's rendezvous) says so every FSDP_WAIT_REPORT_S seconds (default 30, as torchrun's agent
// does; 0: silent) on stderr: "fsdp: rank 0 waiting for 1 of 2 ranks at 127.0.0.1:29500 (30.0 s
// so far, timeout 300.0 s)". Each rank adds 1 to kArrivedKey once it reaches the store; the
// reporter reads the count on a connection of its own, opened only once it has something to say,
// since a c10d store holds its lock through a blocking wait (the rendezvous's) and a read on the
// same connection would wait behind it. The rendezvous itself runs as it did without the reporter.
constexpr const char* kArrivedKey = "fsdp/arrived/world";

std::chrono::milliseconds wait_report_interval() {
  const char* v = std::getenv("FSDP_WAIT_REPORT_S");
  if (v == nullptr || *v == '\0') return std::chrono::seconds(30);
  char* end = nullptr;
  const double s = std::strtod(v, &end);
  if (end == v || *end != '\0' || !(s >= 0) || s > 86400) {
    throw DistError(std::string("fsdp: FSDP_WAIT_REPORT_S='") + v +
                    "' is not a number of seconds (0 to 86400; 0: no lines while waiting for the other ranks)");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0 + 0.5));
}

// A second connection to the job's store, as a client, for the reporter's reads (short timeout).
compat::StorePtr open_reader(const LaunchEnv& env, const StoreEnv& store_env, std::chrono::milliseconds timeout) {
  compat::StorePtr store;
  if (!store_env.file.empty()) {
    store = compat::file_store(store_env.file, timeout);
  } else {
    c10d::TCPStoreOptions opts = compat::tcp_store_options();
    opts.port = static_cast<std::uint16_t>(env.master_port);
    opts.isServer = false;
    opts.waitWorkers = false;
    opts.timeout = timeout;
    store = c10::make_intrusive<c10d::TCPStore>(env.master_addr, opts);
  }
  if (env.use_agent_store) return c10::make_intrusive<c10d::PrefixStore>(env.store_prefix(), store);
  return store;
}

// While alive, prints the waiting line every `interval` from a thread of its own (none for 0).
class WaitReporter {
 public:
  WaitReporter(const LaunchEnv& env, const StoreEnv& store_env, std::chrono::milliseconds interval,
               std::chrono::milliseconds timeout)
      : env_(env), store_env_(store_env), interval_(interval), timeout_(timeout) {
    if (interval_.count() > 0) thread_ = std::thread([this] { run(); });
  }
  ~WaitReporter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  WaitReporter(const WaitReporter&) = delete;
  WaitReporter& operator=(const WaitReporter&) = delete;

 private:
  void run() {
    const auto start = std::chrono::steady_clock::now();
    const std::string where = store_env_.file.empty() ? env_.master_addr + ":" + std::to_string(env_.master_port)
                                                      : "the store file " + store_env_.file;
    compat::StorePtr reader;
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, interval_, [this] { return done_; })) {
      lock.unlock();
      std::string whom = "the store (rank 0 or the launcher hosts it)";
      try {
        // Tried again at the next line while it cannot connect (within a line's interval, at most 5 s).
        if (!reader)
          reader = open_reader(env_, store_env_,
                               std::clamp(interval_, std::chrono::milliseconds(100), std::chrono::milliseconds(5000)));
        const int64_t arrived = reader->add(kArrivedKey, 0);
        whom = arrived >= env_.world_size
                   ? std::string()  // all there: the group is connecting
                   : std::to_string(env_.world_size - arrived) + " of " + std::to_string(env_.world_size) + " ranks";
      } catch (const std::exception&) {
        // Not reachable yet: the line says what this rank waits for.
      }
      const auto waited =
          std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
      lock.lock();
      if (done_) break;
      lock.unlock();
      if (!whom.empty()) {
        std::fprintf(stderr, "fsdp: rank %d waiting for %s at %s (%s so far, timeout %s)\n", env_.rank, whom.c_str(),
                     where.c_str(), seconds(waited).c_str(), seconds(timeout_).c_str());
        std::fflush(stderr);
      }
      lock.lock();
    }
  }

  const LaunchEnv env_;
  const StoreEnv store_env_;
  const std::chrono::milliseconds interval_, timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

}  // namespace

void init_distributed(const InitOptions& options) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_runtime) {
    throw DistError(
        "fsdp: init_distributed() was already called in this process; call it once (or "
        "destroy_distributed() first)");
  }
  auto rt = std::make_unique<Runtime>();
  rt->env = read_launch_env();
  rt->options = options;
  rt->backend = comm::backend_for_device(options.device_type);  // checks the device type either way
  if (options.backend) rt->backend = *options.backend;
  const LaunchEnv& env = rt->env;
  if (rt->backend == comm::BackendKind::Gloo && env.world_size > 1) {
    try {
      // Bad values are named before any rank waits for this one.
      (void)comm::gloo_threads();
      (void)comm::transport_slice_us();
    } catch (const std::invalid_argument& e) {
      throw DistError(std::string("fsdp: ") + e.what());
    }
  }
  if (env.world_size > 1) {
    (void)wait_report_interval();  // a bad value named before any rank waits for this one
    CpuBind bind = CpuBind::None;
    try {
      bind = cpu_bind_from_env();
    } catch (const std::invalid_argument& e) {
      throw DistError(std::string("fsdp: ") + e.what());
    }
    if (bind == CpuBind::Cores) {
      // Before the store and the groups: the threads they start inherit the binding, and Gloo's
      // ask for a short slice ([Note: ranks bound to cores] in src/dist/cpu_binding.cpp).
      if (!bind_to_local_cpus(env.local_rank, env.local_world_size).empty()) comm::set_default_transport_slice_us(100);
    }
  }
  // One line from rank 0: whose variables were read and what was taken from them (with mpirun or
  // srun, the first thing to check when ranks do not meet).
  if (env.from_launcher && env.rank == 0) std::fprintf(stderr, "fsdp: %s\n", describe(env).c_str());
  if (env.world_size == 1) {
    rt->store = c10::make_intrusive<c10d::HashStore>();
    // A world of one on a GPU still runs NCCL (same streams and kernels as a real job); on the
    // CPU it is local copies.
    rt->world = rt->backend == comm::BackendKind::Nccl
                    ? comm::make_comm(rt->backend, c10::make_intrusive<c10d::PrefixStore>("fsdp/world", rt->store), {0},
                                      0, options.timeout, "world", "localhost")
                    : comm::Comm::single_process("world");
    if (rt->backend == comm::BackendKind::Nccl) release_at_exit_once();
    g_runtime = std::move(rt);
    return;
  }
  rt->store_env = read_store_env(env);
  std::optional<WaitReporter> reporter;  // [Note: waiting for peers]
  try {
    reporter.emplace(env, rt->store_env, wait_report_interval(), options.timeout);
  } catch (const std::system_error& e) {  // no thread: the job goes on without the lines
    std::fprintf(stderr, "fsdp: rank %d: no waiting lines (%s)\n", env.rank, e.what());
  }
  rt->store = connect_store(env, rt->store_env, options.timeout);
  std::vector<int> all(static_cast<size_t>(env.world_size));
  for (int r = 0; r < env.world_size; ++r) all[static_cast<size_t>(r)] = r;
  try {
    rt->store->add(kArrivedKey, 1);
    auto group_store = c10::make_intrusive<c10d::PrefixStore>("fsdp/world", rt->store);
    rt->world = comm::make_comm(rt->backend, group_store, all, env.rank, options.timeout, "world", gloo_host(*rt));
    reporter.reset();
    if (rt->backend == comm::BackendKind::Nccl) release_at_exit_once();
  } catch (const std::exception& e) {
    reporter.reset();
    std::string message =
        "fsdp: rank " + std::to_string(env.rank) + " could not form the world group of " +
        std::to_string(env.world_size) + " ranks (timeout " + seconds(options.timeout) +
        "): did every rank start, with the same WORLD_SIZE, and is none of them failing?\n  cause: " + e.what();
    release_bounded(std::move(rt), std::chrono::seconds(10));
    throw DistError(message);
  }
  g_runtime = std::move(rt);
}

bool is_initialized() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_runtime != nullptr;
}

void destroy_distributed() {
  std::lock_guard<std::mutex> lock(g_mu);
  // NCCL: communicators shut down cleanly (not aborted at exit, with c10d's warning).
  if (g_runtime) comm::shutdown_nccl_groups();
  g_runtime.reset();
}

const LaunchEnv& launch_env() { return runtime().env; }
const InitOptions& init_options() { return runtime().options; }
int rank() { return runtime().env.rank; }
int world_size() { return runtime().env.world_size; }
int local_rank() { return runtime().env.local_rank; }
int local_world_size() { return runtime().env.local_world_size; }
std::shared_ptr<comm::Comm> world_comm() { return runtime().world; }
compat::StorePtr store() { return runtime().store; }

namespace {

// Checks the member list and forms the group over the store under "fsdp/group/<tag>". With
// `share_world`, a group of all ranks is the world group itself (no new connections).
std::shared_ptr<comm::Comm> form_group(comm::BackendKind kind, std::vector<int> global_ranks, const std::string& tag,
                                       bool share_world) {
  Runtime& rt = runtime();
  std::set<int> unique(global_ranks.begin(), global_ranks.end());
  if (global_ranks.empty() || unique.size() != global_ranks.size() ||
      !std::is_sorted(global_ranks.begin(), global_ranks.end()) || global_ranks.front() < 0 ||
      global_ranks.back() >= rt.env.world_size) {
    throw DistError("fsdp: new_group('" + tag + "') needs ascending, unique ranks in 0.." +
                    std::to_string(rt.env.world_size - 1));
  }
  auto me = std::find(global_ranks.begin(), global_ranks.end(), rt.env.rank);
  if (me == global_ranks.end()) {
    throw DistError("fsdp: new_group('" + tag + "') called on rank " + std::to_string(rt.env.rank) +
                    ", which is not a member; only members create a group");
  }
  const int group_rank = static_cast<int>(me - global_ranks.begin());
  if (share_world && kind == rt.backend && global_ranks.size() == static_cast<size_t>(rt.env.world_size))
    return rt.world;
  auto group_store = c10::make_intrusive<c10d::PrefixStore>("fsdp/group/" + tag, rt.store);
  try {
    return comm::make_comm(kind, group_store, std::move(global_ranks), group_rank, rt.options.timeout, tag,
                           gloo_host(rt));
  } catch (const std::exception& e) {
    throw DistError("fsdp: could not form group '" + tag + "' (timeout " + seconds(rt.options.timeout) +
                    "): every member must create it with the same ranks.\n  cause: " + e.what());
  }
}

}  // namespace

std::shared_ptr<comm::Comm> new_group(std::vector<int> global_ranks, const std::string& tag) {
  return form_group(runtime().backend, std::move(global_ranks), tag, /*share_world=*/true);
}

std::shared_ptr<comm::Comm> new_cpu_group(std::vector<int> global_ranks, const std::string& tag) {
  return form_group(comm::BackendKind::Gloo, std::move(global_ranks), tag, /*share_world=*/false);
}

}  // namespace fsdp::dist
