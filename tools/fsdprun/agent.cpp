#include "agent.h"

#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include <torch/version.h>

#include "flight_dumps.h"
#include "fsdp/debug/cpu_tuning.h"
#include "signals.h"
#include "store_client.h"
#include "worker_group.h"

extern char** environ;

namespace fsdprun {
namespace {

using Clock = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;

const std::string kConfigKey = "/fsdprun/config";
const std::string kAbortKey = "/fsdprun/abort";
const std::string kCurrentAttemptKey = "/fsdprun/current_attempt";

void log(const std::string& msg) {
  const std::string line = "fsdprun: " + msg + "\n";
  size_t done = 0;
  while (done < line.size()) {
    ssize_t n = write(STDERR_FILENO, line.data() + done, line.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

ms to_ms(double seconds) { return ms(static_cast<long long>(seconds * 1000.0)); }

std::string seconds_text(double s) {
  std::string t = std::to_string(s);
  t.erase(t.find_last_not_of('0') + 1);
  if (!t.empty() && t.back() == '.') t.pop_back();
  return t + " s";
}

std::string attempt_key(int attempt, const char* name) {
  return "/fsdprun/attempt_" + std::to_string(attempt) + "/" + name;
}

// True when `host` names this machine: one of its resolved addresses is a loopback address or an
// address of one of its interfaces (torchrun's c10d rendezvous decides who hosts the store so).
bool names_this_machine(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &found) != 0) return false;
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) ifs = nullptr;
  bool mine = false;
  for (addrinfo* a = found; a != nullptr && !mine; a = a->ai_next) {
    if (a->ai_family == AF_INET) {
      const auto& in = reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr;
      if ((ntohl(in.s_addr) >> 24) == 127) mine = true;
      for (ifaddrs* i = ifs; i != nullptr && !mine; i = i->ifa_next) {
        if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET)
          mine = reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == in.s_addr;
      }
    } else if (a->ai_family == AF_INET6) {
      const auto& in6 = reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr;
      if (IN6_IS_ADDR_LOOPBACK(&in6)) mine = true;
      for (ifaddrs* i = ifs; i != nullptr && !mine; i = i->ifa_next) {
        if (i->ifa_addr != nullptr && i->ifa_addr->sa_family == AF_INET6)
          mine = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr, &in6, sizeof(in6)) == 0;
      }
    }
  }
  if (ifs != nullptr) freeifaddrs(ifs);
  freeaddrinfo(found);
  return mine;
}

// Sleeps up to `timeout`, waking early for a termination signal. True when one has arrived.
bool wait_for_signal(Signals& signals, ms timeout) {
  pollfd p{signals.fd(), POLLIN, 0};
  ::poll(&p, 1, static_cast<int>(std::max<long long>(0, timeout.count())));
  signals.drain();
  return signals.termination() != 0;
}

// A port number that is free on this machine now (bind 127.0.0.1:0, read it, close): MASTER_PORT
// for `--store file --master-port 0`, where no TCP store listens but workers still expect the
// variable to name a port.
int free_port_number() {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 29500;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 29500;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

}  // namespace

Agent::Agent(Options opts, std::string exe)
    : opts_(std::move(opts)),
      exe_(std::move(exe)),
      signals_(Signals::get()),
      peers_(opts_.nnodes, to_ms(opts_.heartbeat_timeout_s)) {
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) base_env_[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  // Defaults that only apply when the user has not chosen: threads split among the local workers,
  // OpenBLAS kernels that fit the CPU (read only when the worker loads OpenBLAS), and torchrun's
  // NCCL error handling default.
  auto unset = [this](const std::string& name) {
    auto it = base_env_.find(name);
    return it == base_env_.end() || it->second.empty();
  };
  if (unset("OMP_NUM_THREADS")) {
    base_env_["OMP_NUM_THREADS"] = std::to_string(fsdp::dist::default_omp_threads(opts_.nproc_per_node));
  }
  if (unset("OPENBLAS_CORETYPE")) {
    if (auto core = fsdp::dist::recommended_openblas_coretype(); !core.empty()) base_env_["OPENBLAS_CORETYPE"] = core;
  }
  if (unset("TORCH_NCCL_ASYNC_ERROR_HANDLING")) base_env_["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1";
  if (!opts_.flight_recorder_dir.empty()) {
    base_env_["FSDP_FLIGHT_RECORDER_DIR"] = flight_recorder_dir_for_workers(opts_.flight_recorder_dir);
  }
}

Agent::~Agent() {
  heartbeat_.reset();
  store_.reset();
  if (!store_dir_.empty()) {
    std::error_code ec;  // best effort: the folder holds only the store's file
    std::filesystem::remove_all(store_dir_, ec);
  }
}

bool Agent::store_hung() const { return (store_ && store_->hung()) || (heartbeat_ && heartbeat_->hung()); }

std::string Agent::endpoint() const {
  return opts_.master_addr + ":" + std::to_string(port_ != 0 ? port_ : opts_.master_port);
}

std::string Agent::failure_text(const WorkerExit& e) const {
  std::string who = "worker rank " + std::to_string(e.global_rank) + " (pid " + std::to_string(e.pid);
  if (opts_.nnodes > 1) who += " on node " + std::to_string(opts_.node_rank);
  return who + ") failed first: " + e.describe();
}

std::vector<WorkerSpec> Agent::worker_specs(int attempt) const {
  // Over the nodes of this attempt (all of them unless elastic): torchrun renumbers them too.
  const int group_size = static_cast<int>(members_.size());
  const int world = group_size * opts_.nproc_per_node;
  std::vector<WorkerSpec> specs;
  for (int local = 0; local < opts_.nproc_per_node; ++local) {
    const int rank = group_rank_ * opts_.nproc_per_node + local;
    std::map<std::string, std::string> env = base_env_;
    // torchrun's names and meanings (torch/distributed/elastic/agent/server/local_elastic_agent.py).
    env["RANK"] = std::to_string(rank);
    env["LOCAL_RANK"] = std::to_string(local);
    env["GROUP_RANK"] = std::to_string(group_rank_);
    env["ROLE_RANK"] = std::to_string(rank);
    env["ROLE_NAME"] = opts_.role;
    env["LOCAL_WORLD_SIZE"] = std::to_string(opts_.nproc_per_node);
    env["WORLD_SIZE"] = std::to_string(world);
    env["GROUP_WORLD_SIZE"] = std::to_string(group_size);
    env["ROLE_WORLD_SIZE"] = std::to_string(world);
    env["MASTER_ADDR"] = opts_.master_addr;
    env["MASTER_PORT"] = std::to_string(port_);
    env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(attempt);
    env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(opts_.max_restarts);
    env["TORCHELASTIC_RUN_ID"] = opts_.run_id;
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True";  // the agent hosts the store: workers only connect
    if (store_file_.empty()) {
      env.erase("FSDP_STORE_FILE");  // not one inherited from an outer job
    } else {
      env["FSDP_STORE_FILE"] = store_file_;
    }
    WorkerSpec spec;
    spec.global_rank = rank;
    spec.local_rank = local;
    // Output routing: torchrun's --redirects/--tee/--local-ranks-filter semantics.
    const int redirected = std_streams_for(opts_.redirects, local);
    const bool shown = opts_.local_ranks_filter.empty() ||
                       std::find(opts_.local_ranks_filter.begin(), opts_.local_ranks_filter.end(), local) !=
                           opts_.local_ranks_filter.end();
    spec.console_out = shown && !(redirected & 1);
    spec.console_err = shown && !(redirected & 2);
    if (!log_base_.empty()) {
      const int to_files =
          opts_.redirects.empty() && opts_.tee.empty() ? 3 : (redirected | std_streams_for(opts_.tee, local));
      const std::string dir = log_base_ + "/attempt_" + std::to_string(attempt) + "/" + std::to_string(local);
      if (to_files != 0) std::filesystem::create_directories(dir);  // throws: the attempt cannot start
      if (to_files & 1) spec.stdout_log = dir + "/stdout.log";
      if (to_files & 2) spec.stderr_log = dir + "/stderr.log";
    }
    spec.exe = exe_;
    spec.argv = opts_.program;
    for (const auto& [k, v] : env) spec.env.push_back(k + "=" + v);
    specs.push_back(std::move(spec));
  }
  return specs;
}

int Agent::setup_logs() {
  if (opts_.log_dir.empty() && opts_.redirects.empty() && opts_.tee.empty()) return 0;
  std::string base = opts_.log_dir;
  if (base.empty()) {  // torchrun: --redirects/--tee without --log-dir write to a new temporary folder
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/fsdprun_logs_XXXXXX";
    if (mkdtemp(templ.data()) == nullptr) {
      log("cannot make a folder for the worker logs (" + templ + "): " + std::strerror(errno) + "; give --log-dir DIR");
      return 1;
    }
    base = templ;
  }
  log_base_ = base + "/" + opts_.run_id + "_node" + std::to_string(opts_.node_rank);
  std::error_code ec;
  std::filesystem::create_directories(log_base_, ec);
  if (ec) {
    log("cannot create the log folder " + log_base_ + ": " + ec.message() + "; give a writable --log-dir");
    return 1;
  }
  log("worker logs in " + log_base_ + "/attempt_<n>/<local rank>/{stdout,stderr}.log");
  return 0;
}

void Agent::print_last_lines(const WorkerGroup& group, int global_rank) const {
  // Only for a worker whose output did not all reach the console (--redirects, --local-ranks-filter):
  // otherwise its lines are already there, with its rank.
  const int local = global_rank % opts_.nproc_per_node;
  const bool shown = opts_.local_ranks_filter.empty() ||
                     std::find(opts_.local_ranks_filter.begin(), opts_.local_ranks_filter.end(), local) !=
                         opts_.local_ranks_filter.end();
  if (shown && std_streams_for(opts_.redirects, local) == 0) return;
  const auto lines = group.last_lines(global_rank);
  if (lines.empty()) {
    log("rank " + std::to_string(global_rank) + " wrote no output");
    return;
  }
  std::string text = "fsdprun: last " + std::to_string(lines.size()) + " output line" + (lines.size() == 1 ? "" : "s") +
                     " of rank " + std::to_string(global_rank) + ":\n";
  for (const auto& l : lines) text += "  " + l + "\n";
  ssize_t ignored = write(STDERR_FILENO, text.data(), text.size());  // one write: not interleaved
  (void)ignored;
}

std::string Agent::store_config() const {
  const std::string nodes_text = opts_.min_nodes == opts_.nnodes
                                     ? std::to_string(opts_.nnodes)
                                     : std::to_string(opts_.min_nodes) + ":" + std::to_string(opts_.nnodes);
  return "nnodes=" + nodes_text + " nproc_per_node=" + std::to_string(opts_.nproc_per_node) +
         " max_restarts=" + std::to_string(opts_.max_restarts) + " rdzv_id=" + opts_.run_id;
}

int Agent::setup_file_store(std::chrono::milliseconds op_timeout, const std::string& config) {
  // A single node: a FileStore in a folder only this user can enter, removed at exit (~Agent).
  // Nothing listens on the network; workers find the file through FSDP_STORE_FILE.
  const char* tmp = std::getenv("TMPDIR");
  std::string base = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  std::string templ = base + "/fsdprun-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) {  // mode 0700
    log("cannot make a private folder for the store in " + base + ": " + std::strerror(errno) +
        "; set TMPDIR to a writable folder, or use --store tcp");
    return 1;
  }
  store_dir_ = templ;
  store_file_ = store_dir_ + "/store";
  try {
    store_ = StoreClient::file(store_file_, op_timeout);
    port_ = opts_.master_port != 0 ? opts_.master_port : free_port_number();
    store_->set(kConfigKey, config);
    store_->add("/fsdprun/node_0/claimed", 1);
  } catch (const std::exception& e) {
    log("cannot create the store file " + store_file_ + ": " + e.what() +
        "; set TMPDIR to a writable folder, or use --store tcp");
    return 1;
  }
  return 0;
}

int Agent::host_store(std::chrono::milliseconds op_timeout, const std::string& config, bool auto_rank) {
  // The agent hosts the store before any worker starts, as torchrun does: workers only connect.
  // It listens on --master-addr only where c10d allows choosing (see StoreClient::host).
  try {
    store_ = StoreClient::host(opts_.master_addr, opts_.master_port, op_timeout);
    port_ = store_->port();
    if (store_->listens_everywhere()) {
      log("note: LibTorch " TORCH_VERSION "'s TCP store listens on every interface (port " + std::to_string(port_) +
          "), not only on " + opts_.master_addr +
          ", and is unauthenticated: keep the port behind a firewall or on a "
          "trusted network" +
          (opts_.nnodes == 1 ? std::string(" (a single node needs no TCP store: drop --store tcp)") : ""));
    }
    store_->set(kConfigKey, config);
    store_->add("/fsdprun/node_0/claimed", 1);
    if (auto_rank) {
      opts_.node_rank = 0;
      log("hosting the c10d rendezvous store at " + endpoint() + " as node 0");
    }
    return 0;
  } catch (const std::exception& e) {
    if (!auto_rank || opts_.is_host == 1) {
      log("cannot host the store at " + endpoint() + ": " + e.what() +
          "; pick a free --master-port (or --master-port 0 / --standalone on a single node), and a --master-addr "
          "that reaches this machine");
      return 1;
    }
    store_.reset();  // the port is taken, most likely by another node's agent on this machine: join it
    return -1;
  }
}

int Agent::connect_store(TimePoint deadline, std::chrono::milliseconds op_timeout) {
  port_ = opts_.master_port;
  // Wait for node 0's port with short probes, so that a signal is noticed meanwhile; then connect.
  while (!StoreClient::reachable(opts_.master_addr, opts_.master_port, ms(1000))) {
    if (Clock::now() >= deadline) {
      log("cannot reach node 0's store at " + endpoint() + " within " + seconds_text(opts_.rdzv_timeout_s) +
          "; start node 0 (--node-rank 0) with the same --master-addr/--master-port, or raise --rdzv-timeout-s");
      return 1;
    }
    if (wait_for_signal(signals_, ms(250))) return 128 + signals_.termination();
  }
  try {
    auto left = std::chrono::duration_cast<ms>(deadline - Clock::now());
    store_ = StoreClient::connect(opts_.master_addr, opts_.master_port, std::max(left, ms(5000)), op_timeout);
  } catch (const std::exception& e) {
    log("cannot connect to node 0's store at " + endpoint() + ": " + e.what());
    return 1;
  }
  return 0;
}

int Agent::check_node0_config(TimePoint deadline, const std::string& config) {
  while (!store_->check(kConfigKey)) {  // node 0 writes it right after starting the store
    if (Clock::now() >= deadline) {
      log("node 0's store at " + endpoint() +
          " never published its configuration; is another program using that port?");
      return 1;
    }
    if (wait_for_signal(signals_, ms(50))) return 128 + signals_.termination();
  }
  const std::string node0 = store_->get(kConfigKey);
  if (node0 != config) {
    const std::string msg = "node " + std::to_string(opts_.node_rank) + " was started with " + config +
                            " but node 0 with " + node0 +
                            "; start every node with the same --nnodes, --nproc-per-node, --max-restarts and --rdzv-id";
    store_->set(kAbortKey, msg);  // node 0 must not wait for this node until it times out
    log(msg);
    return 2;
  }
  return 0;
}

int Agent::take_auto_node_rank() {
  // Numbers in the order the nodes join; node 0 is the store's host.
  const int64_t n = store_->add("/fsdprun/next_auto_node_rank", 1);
  if (n >= opts_.nnodes) {
    log("node rank " + std::to_string(n) + " would exceed --nnodes " + std::to_string(opts_.nnodes) +
        ": more nodes joined " + endpoint() +
        " than --nnodes (a node started twice, or one that came back: restart every node, or give each "
        "its own --node-rank)");
    return 2;
  }
  opts_.node_rank = static_cast<int>(n);
  log("joined the c10d rendezvous at " + endpoint() + " as node " + std::to_string(n));
  return 0;
}

int Agent::join_store(std::chrono::milliseconds op_timeout, const std::string& config, bool auto_rank) {
  const auto deadline = Clock::now() + to_ms(opts_.rdzv_timeout_s);
  if (int rc = connect_store(deadline, op_timeout); rc != 0) return rc;
  try {
    if (int rc = check_node0_config(deadline, config); rc != 0) return rc;
    if (auto_rank) {
      if (int rc = take_auto_node_rank(); rc != 0) return rc;
    }
    if (int rc = claim_node_rank(); rc != 0) return rc;
    // The heartbeat has a connection of its own: it goes on while this loop waits on something.
    auto left = std::chrono::duration_cast<ms>(deadline - Clock::now());
    heartbeat_ = std::make_unique<Heartbeat>(
        StoreClient::connect(opts_.master_addr, opts_.master_port, std::max(left, ms(5000)), op_timeout),
        opts_.node_rank, std::max(to_ms(opts_.heartbeat_timeout_s) / 5, ms(50)));
    if (int rc = find_first_attempt(); rc != 0) return rc;
  } catch (const std::runtime_error& e) {  // StoreLost, or the heartbeat's connection failing
    log("lost node 0's store at " + endpoint() + ": " + e.what());
    return 1;
  }
  return 0;
}

int Agent::setup_store() {
  // Store calls answer in microseconds; the bound only matters when node 0 goes silent.
  // Node 0 silent for the heartbeat timeout is lost to the other nodes.
  const ms op_timeout = std::min({to_ms(opts_.rdzv_timeout_s), ms(60000), to_ms(opts_.heartbeat_timeout_s)});
  const std::string config = store_config();
  if (opts_.store == "file") return setup_file_store(op_timeout, config);
  // torchrun's c10d form without --node-rank: the node the endpoint names hosts the store and is
  // node 0 (--rdzv-conf is_host decides instead when given). Two agents on one machine both
  // qualify: the one that gets the port first hosts, the other joins it as a client.
  const bool auto_rank = opts_.node_rank == kAutoNodeRank;
  bool host = opts_.node_rank == 0;
  if (auto_rank) host = opts_.is_host != -1 ? opts_.is_host == 1 : names_this_machine(opts_.master_addr);
  if (host) {
    if (int rc = host_store(op_timeout, config, auto_rank); rc >= 0) return rc;
  }
  return join_store(op_timeout, config, auto_rank);
}

int Agent::claim_node_rank() {
  const std::string k = std::to_string(opts_.node_rank);
  const std::string claim = "/fsdprun/node_" + k + "/claimed";
  if (store_->add(claim, 1) == 1) return 0;
  // Another fsdprun took this node rank: a second agent given the same --node-rank, or this node's
  // previous fsdprun that is gone (its host died), whose heartbeat has stopped. Watch it.
  const ms window = to_ms(opts_.heartbeat_timeout_s) + ms(500);
  log("--node-rank " + k + " was taken by another fsdprun; watching its heartbeat for " +
      seconds_text(static_cast<double>(window.count()) / 1000.0) +
      " (a node that comes back replaces one that is gone)");
  const int64_t before = store_->counter(beat_key(opts_.node_rank));
  const auto until = Clock::now() + window;
  while (Clock::now() < until) {
    if (wait_for_signal(signals_, ms(100))) return 128 + signals_.termination();
  }
  if (store_->counter(beat_key(opts_.node_rank)) != before) {
    store_->add(claim, -1);
    log("another fsdprun already joined as --node-rank " + k +
        " and is alive; give every node its own --node-rank 0.." + std::to_string(opts_.nnodes - 1));
    return 2;
  }
  log("node " + k + "'s previous fsdprun sent no heartbeat for " +
      seconds_text(static_cast<double>(window.count()) / 1000.0) + ": this one replaces it");
  return 0;
}

int Agent::find_first_attempt() {
  // A node that comes back into a running job joins the attempt node 0 is in, once the one it
  // left has failed (node 0 then restarts the group, if restarts remain, and waits for it).
  const auto deadline = Clock::now() + to_ms(opts_.rdzv_timeout_s);
  bool said = false;
  while (true) {
    if (store_->check(kAbortKey)) {
      log("not starting workers: " + store_->get(kAbortKey));
      return 1;
    }
    const int current = store_->check(kCurrentAttemptKey) ? std::atoi(store_->get(kCurrentAttemptKey).c_str()) : 0;
    const bool started = store_->check(attempt_key(current, "members"));
    const bool failed = store_->check(attempt_key(current, "failed"));
    if (!started && !failed) {
      first_attempt_ = current;
      if (current > 0) log("joining the running job at attempt " + std::to_string(current));
      return 0;
    }
    if (!said) {
      log("the job is running attempt " + std::to_string(current) +
          " without this node; waiting for node 0 to restart it");
      said = true;
    }
    if (Clock::now() >= deadline) {
      log("node 0 did not restart the job within " + seconds_text(opts_.rdzv_timeout_s) +
          " (no restarts left?); start every node again with the same flags, or raise --max-restarts");
      return 1;
    }
    if (wait_for_signal(signals_, ms(250))) return 128 + signals_.termination();
  }
}

void Agent::watch_peers(const char* when) {
  if (opts_.node_rank != 0 || opts_.nnodes == 1) return;
  for (int n : peers_.poll(*store_)) log(peers_.describe(n) + " " + when);
}

void Agent::publish_failure(int attempt, const std::string& reason, bool abort) {
  // Best effort: when the store is gone there is nobody left to tell.
  try {
    if (abort) store_->set(kAbortKey, reason);  // before .../failed, so whoever sees that can see this
    if (store_->add(attempt_key(attempt, "fail_count"), 1) == 1) store_->set(attempt_key(attempt, "failed"), reason);
  } catch (const StoreLost&) {}
}

void Agent::wait_counter(const std::string& key, int64_t target, ms limit) {
  const auto deadline = Clock::now() + limit;
  try {
    while (store_->counter(key) < target && Clock::now() < deadline) {
      if (wait_for_signal(signals_, ms(50)) && signals_.termination_count() > 1) return;  // asked twice: leave
    }
  } catch (const StoreLost&) {}
}

bool Agent::is_member(int node) const { return std::find(members_.begin(), members_.end(), node) != members_.end(); }

int Agent::lost_members() const {
  int n = 0;
  for (int m : members_) n += m != 0 && peers_.lost(m) ? 1 : 0;
  return n;
}

namespace {

// Node 0's list of an attempt's nodes, "0,1,3".
std::vector<int> parse_members(const std::string& list) {
  std::vector<int> members;
  for (size_t start = 0; start < list.size();) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    members.push_back(std::atoi(list.substr(start, end - start).c_str()));
    start = end + 1;
  }
  return members;
}

}  // namespace

bool Agent::rendezvous_closed(int attempt, int64_t joined, std::optional<TimePoint>& min_reached) {
  const std::string members_key = attempt_key(attempt, "members");
  if (opts_.node_rank != 0) return store_->check(members_key);
  // Node 0 closes the rendezvous: every node, or (elastic) MIN and the last call passed.
  if (joined >= opts_.min_nodes && !min_reached) min_reached = Clock::now();
  if (joined >= opts_.nnodes || (min_reached && Clock::now() - *min_reached >= to_ms(opts_.rdzv_last_call_s))) {
    std::string list;
    for (int n = 0; n < opts_.nnodes; ++n) {
      if (store_->check(attempt_key(attempt, ("node_" + std::to_string(n)).c_str())))
        list += (list.empty() ? "" : ",") + std::to_string(n);
    }
    store_->set(members_key, list);
    return true;
  }
  return false;
}

int Agent::rendezvous_interrupted(int attempt, int64_t joined, TimePoint deadline) {
  watch_peers("(waiting for it to come back until the rendezvous timeout)");
  if (store_->check(kAbortKey)) {
    log("not starting workers: " + store_->get(kAbortKey));
    return 1;
  }
  if (Clock::now() >= deadline) {
    const std::string msg = "timed out after " + seconds_text(opts_.rdzv_timeout_s) + " waiting for the other nodes (" +
                            std::to_string(joined) + " of " + std::to_string(opts_.min_nodes) + " joined attempt " +
                            std::to_string(attempt) +
                            "); start every node with the same --nnodes, --master-addr and "
                            "--master-port and its own --node-rank, or raise --rdzv-timeout-s";
    publish_failure(attempt, "node " + std::to_string(opts_.node_rank) + " " + msg, true);
    log(msg);
    return 1;
  }
  if (wait_for_signal(signals_, to_ms(opts_.monitor_interval_s))) {
    const std::string sig = signal_name(signals_.termination());
    publish_failure(attempt, "node " + std::to_string(opts_.node_rank) + "'s fsdprun got " + sig, true);
    log("got " + sig + " while waiting for the other nodes; exiting");
    return 128 + signals_.termination();
  }
  return -1;
}

int Agent::wait_for_members(int attempt) {
  const std::string key = attempt_key(attempt, "joined");
  const auto deadline = Clock::now() + to_ms(opts_.rdzv_timeout_s);
  std::optional<Clock::time_point> min_reached;
  try {
    if (opts_.node_rank == 0) store_->set(kCurrentAttemptKey, std::to_string(attempt));
    // Before the counter: node 0 lists whoever it counted.
    store_->set(attempt_key(attempt, ("node_" + std::to_string(opts_.node_rank)).c_str()), "1");
    int64_t joined = store_->add(key, 1);
    while (!rendezvous_closed(attempt, joined, min_reached)) {
      if (int rc = rendezvous_interrupted(attempt, joined, deadline); rc >= 0) return rc;
      joined = store_->counter(key);
    }
    members_ = parse_members(store_->get(attempt_key(attempt, "members")));
  } catch (const StoreLost& e) {
    log("lost the store at " + endpoint() + " while waiting for the other nodes: " + e.what());
    return 1;
  }
  return -1;
}

int Agent::rendezvous(int attempt) {
  members_ = {opts_.node_rank};
  group_rank_ = 0;
  if (opts_.nnodes == 1) return -1;
  if (int rc = wait_for_members(attempt); rc >= 0) return rc;
  const auto me = std::find(members_.begin(), members_.end(), opts_.node_rank);
  if (me == members_.end()) {
    log("attempt " + std::to_string(attempt) +
        " started without this node (it joined after node 0 closed the rendezvous); "
        "waiting for the next attempt");
    return -2;
  }
  group_rank_ = static_cast<int>(me - members_.begin());
  if (static_cast<int>(members_.size()) != opts_.nnodes) {
    std::string list;
    for (int m : members_) list += (list.empty() ? "" : ", ") + std::to_string(m);
    log("attempt " + std::to_string(attempt) + " runs on " + std::to_string(members_.size()) + " of " +
        std::to_string(opts_.nnodes) + " nodes (" + list + "): WORLD_SIZE " +
        std::to_string(members_.size() * static_cast<size_t>(opts_.nproc_per_node)) + ", this node is group rank " +
        std::to_string(group_rank_));
  }
  return -1;
}

Agent::Outcome Agent::monitor(WorkerGroup& group, int attempt, std::string& reason) {
  const ms interval = to_ms(opts_.monitor_interval_s);
  const std::string failed_key = attempt_key(attempt, "failed");
  auto next_check = Clock::now() + interval;
  while (true) {
    // Worker exits and signals wake the poll at once; the store (other nodes) is polled.
    ms wait = ms(1000);
    if (opts_.nnodes > 1) wait = std::clamp(std::chrono::duration_cast<ms>(next_check - Clock::now()), ms(0), interval);
    group.poll(wait, signals_);
    if (signals_.termination() != 0) {
      reason = "node " + std::to_string(opts_.node_rank) + "'s fsdprun got " + signal_name(signals_.termination());
      return Outcome::Signaled;
    }
    if (const auto& failure = group.first_failure()) {
      reason = failure_text(*failure);
      return Outcome::LocalFailure;
    }
    if (group.all_exited()) return Outcome::Succeeded;
    if (opts_.nnodes > 1 && Clock::now() >= next_check) {
      try {
        if (store_->check(failed_key)) {
          reason = store_->get(failed_key);
          return Outcome::RemoteFailure;
        }
        if (opts_.node_rank == 0) {
          for (int n : peers_.poll(*store_)) {
            if (!is_member(n)) continue;  // a node waiting for the next attempt
            reason = peers_.describe(n);
            return Outcome::NodeLost;
          }
        }
      } catch (const StoreLost& e) {
        reason = "node 0 lost: lost its store at " + endpoint() + " (" + e.what() +
                 "); node 0's host or link is down, or its fsdprun exited";
        return Outcome::StoreLost;
      }
      next_check = Clock::now() + interval;
    }
  }
}

int Agent::exit_barrier(int attempt, std::string& failure) {
  if (opts_.nnodes == 1) return 0;
  // torchrun's exit barrier: node 0 keeps the store up until every node's workers are done.
  const std::string done_key = attempt_key(attempt, "done");
  const std::string failed_key = attempt_key(attempt, "failed");
  const std::string ack_key = attempt_key(attempt, "exit_ack");
  const auto deadline = Clock::now() + to_ms(opts_.rdzv_timeout_s);
  try {
    int64_t done = store_->add(done_key, 1);
    const int group_size = static_cast<int>(members_.size());
    while (done < group_size) {
      if (store_->check(failed_key)) {
        failure = store_->get(failed_key);
        return -1;
      }
      if (opts_.node_rank == 0) {
        for (int n : peers_.poll(*store_)) {
          if (!is_member(n)) continue;
          failure = peers_.describe(n);
          publish_failure(attempt, failure, false);
          return -1;
        }
      }
      if (Clock::now() >= deadline) {
        log("this node's workers all exited 0, but after " + seconds_text(opts_.rdzv_timeout_s) + " only " +
            std::to_string(done) + " of " + std::to_string(group_size) + " nodes had finished; exiting anyway" +
            (opts_.node_rank == 0 ? " (this takes the store down)" : ""));
        return 0;
      }
      if (wait_for_signal(signals_, to_ms(opts_.monitor_interval_s))) {
        const std::string sig = signal_name(signals_.termination());
        publish_failure(attempt, "node " + std::to_string(opts_.node_rank) + "'s fsdprun got " + sig, true);
        log("got " + sig + " while waiting for the other nodes to finish; exiting");
        return 128 + signals_.termination();
      }
      done = store_->counter(done_key);
    }
    if (opts_.node_rank != 0) {
      store_->add(ack_key, 1);  // this node's last store call: node 0 may now take the store down
    } else {
      wait_counter(ack_key, group_size - 1, ms(30000));
    }
  } catch (const StoreLost& e) {
    log("lost the store at " + endpoint() + " after this node's workers succeeded: " + e.what());
    return 1;
  }
  return 0;
}

int Agent::finish_failed_attempt(int attempt, const std::string& reason, bool& restart) {
  restart = false;
  std::string final_reason = reason;
  bool aborted = signals_.termination() != 0;
  try {
    if (!aborted && opts_.nnodes > 1 && store_->check(kAbortKey)) {
      aborted = true;
      final_reason = store_->get(kAbortKey);
    }
    if (opts_.nnodes > 1 && store_->check(attempt_key(attempt, "failed"))) {
      final_reason = store_->get(attempt_key(attempt, "failed"));  // the first failure of the whole job
    }
    store_->add(attempt_key(attempt, "stopped"), 1);
    if (!aborted && attempt < opts_.max_restarts) {
      log(final_reason + "; restarting all workers (restart " + std::to_string(attempt + 1) + " of " +
          std::to_string(opts_.max_restarts) + ")");
      restart = true;
      return 0;
    }
    // Node 0's exit takes the store down: first let the other nodes see the failure and stop.
    // A lost node never reports: stop waiting for it once the heartbeat says so.
    if (opts_.node_rank == 0 && opts_.nnodes > 1) {
      const auto deadline = Clock::now() + to_ms(opts_.grace_period_s) + ms(30000);
      while (store_->counter(attempt_key(attempt, "stopped")) + lost_members() < static_cast<int>(members_.size()) &&
             Clock::now() < deadline) {
        watch_peers("(after the failure)");
        if (wait_for_signal(signals_, ms(50)) && signals_.termination_count() > 1) break;  // asked twice: leave
      }
      if (const std::string lost = peers_.summary(); !lost.empty() && final_reason.find(lost) == std::string::npos) {
        final_reason += "; " + lost;
      }
    }
  } catch (const StoreLost& e) {
    log("lost the store at " + endpoint() + ": " + e.what());
  }
  if (signals_.termination() != 0) {
    log("stopped by " + signal_name(signals_.termination()));
    return 128 + signals_.termination();
  }
  log(final_reason);
  return 1;
}

int Agent::stop_after(WorkerGroup& group, Outcome outcome, int attempt, const std::string& reason) {
  const ms grace = to_ms(opts_.grace_period_s);
  switch (outcome) {
    case Outcome::Signaled: {
      const int sig = signals_.termination();
      log("got " + signal_name(sig) + "; forwarding it to the workers (SIGKILL after " +
          seconds_text(opts_.grace_period_s) + ")");
      publish_failure(attempt, reason, /*abort=*/true);
      group.stop(sig, grace, signals_);
      break;
    }
    case Outcome::LocalFailure: {
      const auto& f = *group.first_failure();
      log("worker rank " + std::to_string(f.global_rank) + " (pid " + std::to_string(f.pid) + ") failed: " +
          f.describe() + "; stopping all workers (SIGTERM, SIGKILL after " + seconds_text(opts_.grace_period_s) + ")");
      publish_failure(attempt, reason, false);
      group.stop(SIGTERM, grace, signals_);
      print_last_lines(group, f.global_rank);
      if (auto fr = base_env_.find("FSDP_FLIGHT_RECORDER_DIR"); fr != base_env_.end() && !fr->second.empty()) {
        log(flight_recorder_note(fr->second));
      }
      break;
    }
    case Outcome::RemoteFailure:
      log("another node failed (" + reason + "); stopping this node's workers");
      group.stop(SIGTERM, grace, signals_);
      break;
    case Outcome::NodeLost:
      log(reason + "; stopping this node's workers (SIGTERM, SIGKILL after " + seconds_text(opts_.grace_period_s) +
          ")");
      publish_failure(attempt, reason, false);
      group.stop(SIGTERM, grace, signals_);
      break;
    case Outcome::StoreLost:
      log(reason + "; stopping this node's workers");
      group.stop(SIGTERM, grace, signals_);
      return 1;
    case Outcome::Succeeded:
      group.stop(SIGTERM, ms(0), signals_);  // clears anything the workers left running
      break;
  }
  return -1;
}

int Agent::run_attempt(int attempt, Outcome& outcome, std::string& reason) {
  WorkerGroup group;
  try {
    group.start(worker_specs(attempt));
  } catch (const std::exception& e) {
    reason = "node " + std::to_string(opts_.node_rank) + " could not start its workers: " + e.what();
    publish_failure(attempt, reason, true);
    group.stop(SIGKILL, ms(0), signals_);
    log(reason);
    return 1;
  }
  outcome = monitor(group, attempt, reason);
  return stop_after(group, outcome, attempt, reason);
}

int Agent::run() {
  // The log folder's name holds the node rank, which the c10d form knows only once it has joined.
  const bool rank_known = opts_.node_rank != kAutoNodeRank;
  if (rank_known) {
    if (int rc = setup_logs(); rc != 0) return rc;
  }
  if (int rc = setup_store(); rc != 0) return rc;
  if (!rank_known) {
    if (int rc = setup_logs(); rc != 0) return rc;
  }
  for (int attempt = first_attempt_;; ++attempt) {
    if (int rc = rendezvous(attempt); rc == -2) {  // elastic: the attempt started without this node
      if (int r = find_first_attempt(); r != 0) return r;
      attempt = first_attempt_ - 1;
      continue;
    } else if (rc >= 0) {
      return rc;
    }
    std::string reason;
    Outcome outcome;
    if (int rc = run_attempt(attempt, outcome, reason); rc >= 0) return rc;
    if (outcome == Outcome::Succeeded) {
      std::string failure;
      if (int rc = exit_barrier(attempt, failure); rc >= 0) return rc;
      log("this node's workers succeeded, but another node failed (" + failure + ")");
      reason = failure;
    }
    bool restart = false;
    int rc = finish_failed_attempt(attempt, reason, restart);
    if (!restart) return rc;
  }
}

}  // namespace fsdprun
