// Nothing open to the network: the listening sockets of a running fsdprun job. The test binary is
// its own worker (rank worker `pause_in_rendezvous`: init_distributed, one all-reduce, then a
// second group whose Gloo rendezvous rank 0 waits in), and the test reads /proc/net/tcp{,6} for
// LISTEN sockets whose inodes belong to fsdprun or its workers (/proc/<pid>/fd: "socket:[inode]").
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/compat/store.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "subprocess.h"
#include "test_helpers.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using fsdp::testing::Child;
using fsdp::testing::ProcessResult;
using fsdp::testing::ProcessSpec;

const std::string kFsdprun = FSDPRUN_PATH;

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

}  // namespace

// Forms the world group, reports its pid, then forms a second Gloo group that rank 0 enters at
// once and the other ranks only once the test has written "go": meanwhile rank 0 waits in Gloo's
// rendezvous with its listening sockets open (LibTorch 1.13's Gloo closes them once connected).
FSDP_RANK_WORKER(pause_in_rendezvous) {
  auto world = fsdp::dist::world_comm();
  auto t = at::ones({4});
  world->all_reduce(t);
  TORCH_CHECK(t.eq(world->size()).all().item<bool>(), t);
  const std::string dir = std::getenv("FSDP_TEST_DIR");
  const std::string mine = dir + "/ready_" + std::to_string(fsdp::dist::rank());
  const char* store_file = std::getenv("FSDP_STORE_FILE");
  { std::ofstream(mine + ".tmp") << getpid() << "\n" << (store_file ? store_file : "-") << "\n"; }
  std::filesystem::rename(mine + ".tmp", mine);
  if (fsdp::dist::rank() != 0) {
    const auto deadline = Clock::now() + 60s;
    while (!exists(dir + "/go") && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
  }
  std::vector<int> all(static_cast<size_t>(world->size()));
  for (int r = 0; r < world->size(); ++r) all[static_cast<size_t>(r)] = r;
  fsdp::dist::new_cpu_group(all, "late")->barrier();
}

namespace {

struct Listener {
  std::string address;  // as inet_ntop writes it
  int port = 0;
  bool loopback = false;
};

// The socket inodes open in process `pid` ("socket:[123]" links under /proc/<pid>/fd).
std::set<unsigned long> socket_inodes(int pid) {
  std::set<unsigned long> inodes;
  const std::string fd_dir = "/proc/" + std::to_string(pid) + "/fd";
  DIR* d = opendir(fd_dir.c_str());
  if (d == nullptr) return inodes;
  while (dirent* e = readdir(d)) {
    char target[256];
    ssize_t n = readlink((fd_dir + "/" + e->d_name).c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    target[n] = '\0';
    unsigned long inode = 0;
    if (std::sscanf(target, "socket:[%lu]", &inode) == 1) inodes.insert(inode);
  }
  closedir(d);
  return inodes;
}

// LISTEN sockets (state 0A) of /proc/net/tcp or tcp6 whose inode is in `inodes`.
std::vector<Listener> listeners(const std::string& table, bool v6, const std::set<unsigned long>& inodes) {
  std::vector<Listener> out;
  std::ifstream in(table);
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::istringstream f(line);
    std::string slot, local, remote, state, queues, timer, retr, uid, timeout;
    unsigned long inode = 0;
    if (!(f >> slot >> local >> remote >> state >> queues >> timer >> retr >> uid >> timeout >> inode)) continue;
    if (state != "0A" || inodes.count(inode) == 0) continue;
    const auto colon = local.find(':');
    Listener l;
    l.port = static_cast<int>(std::stoul(local.substr(colon + 1), nullptr, 16));
    char text[INET6_ADDRSTRLEN] = {};
    // The kernel prints each 32-bit word of the address as a host-order number.
    if (!v6) {
      uint32_t a = static_cast<uint32_t>(std::stoul(local.substr(0, 8), nullptr, 16));
      inet_ntop(AF_INET, &a, text, sizeof(text));
      l.loopback = (reinterpret_cast<unsigned char*>(&a)[0]) == 127;
    } else {
      in6_addr a{};
      for (int w = 0; w < 4; ++w) {
        uint32_t word = static_cast<uint32_t>(std::stoul(local.substr(static_cast<size_t>(w) * 8, 8), nullptr, 16));
        std::memcpy(reinterpret_cast<unsigned char*>(&a) + w * 4, &word, 4);
      }
      inet_ntop(AF_INET6, &a, text, sizeof(text));
      l.loopback = IN6_IS_ADDR_LOOPBACK(&a) || (IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127);
    }
    l.address = text;
    out.push_back(l);
  }
  return out;
}

struct JobSockets {
  std::vector<Listener> listening;  // of fsdprun and both workers
  std::string store_file;           // FSDP_STORE_FILE as rank 0 saw it ("-": unset)
  int store_dir_mode = -1;          // its folder's permission bits while the job ran
  ProcessResult result;             // fsdprun's, after the workers were told to stop
};

// Runs `fsdprun <flags> --nproc-per-node 2 -- <this binary>` with workers that pause once the
// world group is formed, and collects the listening sockets of the whole job meanwhile.
JobSockets listening_sockets_of_job(const std::vector<std::string>& flags) {
  fsdp::testing::TempDir dir("fsdprun_net");
  ProcessSpec spec;
  spec.argv = {kFsdprun};
  spec.argv.insert(spec.argv.end(), flags.begin(), flags.end());
  spec.argv.insert(spec.argv.end(),
                   {"--nproc-per-node", "2", "--grace-period-s", "5", "--", fsdp::testing::self_exe()});
  spec.env_set = {
      {"FSDP_TEST_WORKER", "pause_in_rendezvous"}, {"FSDP_TEST_DIR", dir.path}, {"FSDP_COLLECTIVE_TIMEOUT_S", "60"}};
  spec.env_unset = {"RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                    "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_USE_AGENT_STORE",
                    "FSDP_STORE_FILE",
                    "GLOO_SOCKET_IFNAME"};
  spec.timeout = 120s;
  JobSockets job;
  Child child(spec);
  std::vector<int> pids = {child.pid()};
  const auto deadline = Clock::now() + 90s;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string ready = dir / ("ready_" + std::to_string(rank));
    while (!exists(ready) && Clock::now() < deadline && !child.try_wait()) std::this_thread::sleep_for(20ms);
    int pid = 0;
    std::string store_file;
    std::ifstream(ready) >> pid >> store_file;
    if (pid > 0) pids.push_back(pid);
    if (rank == 0) job.store_file = store_file;
  }
  if (!job.store_file.empty() && job.store_file != "-") {
    struct stat st {};
    if (stat(std::filesystem::path(job.store_file).parent_path().c_str(), &st) == 0)
      job.store_dir_mode = st.st_mode & 07777;
  }
  if (pids.size() == 3) {
    // Rank 0 is now entering (or inside) the second group's rendezvous: collect the job's
    // listening sockets until one of a worker's shows up (at most 10 s), then let the others join.
    std::set<std::string> seen;
    const auto scan_end = Clock::now() + 10s;
    bool worker_listens = false;
    while (!worker_listens && Clock::now() < scan_end) {
      for (size_t i = 0; i < pids.size(); ++i) {
        auto inodes = socket_inodes(pids[i]);
        auto found = listeners("/proc/net/tcp", false, inodes);
        auto found6 = listeners("/proc/net/tcp6", true, inodes);
        found.insert(found.end(), found6.begin(), found6.end());
        for (const auto& l : found) {
          if (seen.insert(l.address + ":" + std::to_string(l.port)).second) job.listening.push_back(l);
          if (i > 0) worker_listens = true;
        }
      }
      std::this_thread::sleep_for(20ms);
    }
  }
  { std::ofstream(dir / "go") << "1\n"; }
  job.result = child.wait();
  EXPECT_EQ(pids.size(), 3u) << "the workers did not get as far as forming the group\n" << job.result.output;
  return job;
}

std::string describe(const std::vector<Listener>& ls) {
  std::string s;
  for (const auto& l : ls)
    s += "  " + l.address + ":" + std::to_string(l.port) + (l.loopback ? "" : "  <- not loopback") + "\n";
  return s.empty() ? "  (none)\n" : s;
}

}  // namespace

// The default single-node job: a FileStore, Gloo on the loopback. Every listening socket of the
// job (Gloo's, at least one) is on a loopback address.
TEST(LauncherNetwork, SingleNodeJobListensOnLoopbackOnly) {
  auto job = listening_sockets_of_job({"--master-port", "0"});
  ASSERT_TRUE(job.result.ok()) << job.result.output;
  EXPECT_FALSE(job.listening.empty()) << "expected Gloo's listening sockets during the rendezvous; found none\n"
                                      << job.result.output;
  for (const auto& l : job.listening) EXPECT_TRUE(l.loopback) << "listening sockets:\n" << describe(job.listening);
  // The store: a file in a folder only this user can enter, gone once fsdprun has exited.
  ASSERT_NE(job.store_file, "-") << "FSDP_STORE_FILE was not set\n" << job.result.output;
  EXPECT_EQ(job.store_dir_mode, 0700) << job.store_file;
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(job.store_file).parent_path())) << job.store_file;
}

// Restarted workers meet again in the same FileStore (under the next attempt's prefix).
TEST(LauncherNetwork, FileStoreServesRestartedWorkers) {
  ProcessSpec spec;
  spec.argv = {
      kFsdprun,   "--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "1", "--grace-period-s", "2", "--",
      PROBE_PATH, "store-fail-once",  "3"};
  spec.env_unset = {"RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                    "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_USE_AGENT_STORE",
                    "FSDP_STORE_FILE"};
  spec.timeout = 90s;
  auto r = fsdp::testing::run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  for (int rank : {0, 1}) {
    const std::string prefix = "[rank" + std::to_string(rank) + "]: ";
    EXPECT_NE(r.output.find(prefix + "store=file\n"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(prefix + "OK rank=" + std::to_string(rank) + " world=2 port="), std::string::npos)
        << r.output;
  }
  EXPECT_NE(r.output.find(" attempt=1\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restarting all workers (restart 1 of 1)"), std::string::npos) << r.output;
}

// `--store tcp` on one node: the TCP store listens on --master-addr (127.0.0.1) where LibTorch
// lets us choose (2.x). LibTorch 1.13's listens on every interface: then that port is the only
// non-loopback one, and fsdprun says so.
TEST(LauncherNetwork, TcpStoreListensOnTheMasterAddrWhereLibTorchAllows) {
  auto job = listening_sockets_of_job({"--store", "tcp", "--master-port", "0"});
  ASSERT_TRUE(job.result.ok()) << job.result.output;
  ASSERT_FALSE(job.listening.empty()) << job.result.output;
  const bool everywhere = job.result.output.find("listens on every interface") != std::string::npos;
  if (fsdp::compat::tcp_store_can_choose_address<>) {
    EXPECT_FALSE(everywhere) << job.result.output;
    for (const auto& l : job.listening) EXPECT_TRUE(l.loopback) << "listening sockets:\n" << describe(job.listening);
  } else {
    EXPECT_TRUE(everywhere) << "fsdprun should say that 1.13's store listens on every interface\n" << job.result.output;
    std::set<int> open_ports;
    for (const auto& l : job.listening) {
      if (!l.loopback) open_ports.insert(l.port);
    }
    EXPECT_EQ(open_ports.size(), 1u) << "only the store's port may be open beyond loopback:\n"
                                     << describe(job.listening);
  }
}
