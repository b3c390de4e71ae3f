// fsdprun end to end: real launcher, real worker processes (launcher_probe), every run bounded by
// a timeout (run_process / Child kill the whole process group when it expires).
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "subprocess.h"
#include "test_helpers.h"

namespace {

using namespace std::chrono_literals;
using fsdp::testing::Child;
using fsdp::testing::pick_free_port;
using fsdp::testing::process_alive;
using fsdp::testing::ProcessResult;
using fsdp::testing::ProcessSpec;
using fsdp::testing::run_process;
using Clock = std::chrono::steady_clock;

const std::string kFsdprun = FSDPRUN_PATH;
const std::string kProbe = PROBE_PATH;

// Variables a surrounding launcher (or CI) could have set; the tests want fsdprun's own.
const std::vector<std::string> kScrub = {"RANK",
                                         "WORLD_SIZE",
                                         "LOCAL_RANK",
                                         "LOCAL_WORLD_SIZE",
                                         "MASTER_ADDR",
                                         "MASTER_PORT",
                                         "OMP_NUM_THREADS",
                                         "TORCHELASTIC_RESTART_COUNT",
                                         "TORCHELASTIC_USE_AGENT_STORE"};

ProcessSpec fsdprun_spec(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 60s) {
  ProcessSpec spec;
  spec.argv = {kFsdprun};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env_unset = kScrub;
  spec.timeout = timeout;
  return spec;
}

ProcessResult fsdprun(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 60s) {
  return run_process(fsdprun_spec(args, timeout));
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// "[rank<R>]: text" lines, grouped by rank.
std::map<int, std::vector<std::string>> by_rank(const std::string& output) {
  std::map<int, std::vector<std::string>> out;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("[rank", 0) != 0) continue;
    auto close = line.find("]: ");
    if (close == std::string::npos) continue;
    out[std::stoi(line.substr(5, close - 5))].push_back(line.substr(close + 3));
  }
  return out;
}

// Every integer printed as "<key><int>" by a worker (e.g. "pid=").
std::vector<int> values_of(const std::string& output, const std::string& key) {
  std::vector<int> values;
  for (const auto& [rank, lines] : by_rank(output)) {
    for (const auto& l : lines) {
      if (l.rfind(key, 0) == 0) values.push_back(std::stoi(l.substr(key.size())));
    }
  }
  return values;
}

std::map<std::string, std::string> env_of(const std::vector<std::string>& lines) {
  std::map<std::string, std::string> env;
  for (const auto& l : lines) {
    auto eq = l.find('=');
    if (eq != std::string::npos) env[l.substr(0, eq)] = l.substr(eq + 1);
  }
  return env;
}

// Processes reaped by fsdprun disappear at once; a grandchild killed by the group SIGKILL is gone
// (or a zombie, which process_alive() counts as dead) shortly after.
void expect_all_gone(const std::vector<int>& pids) {
  const auto deadline = Clock::now() + 5s;
  for (int pid : pids) {
    while (process_alive(pid) && Clock::now() < deadline) std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(process_alive(pid)) << "orphan process " << pid << " is still running";
  }
}

size_t count_lines(const std::string& s) { return static_cast<size_t>(std::count(s.begin(), s.end(), '\n')); }

// A fresh directory removed at scope exit (tests/support/test_helpers.h).
struct TempDir : fsdp::testing::TempDir {
  TempDir() : fsdp::testing::TempDir("fsdprun_test") {}
};

TEST(Launcher, WorkersGetTorchrunEnvironmentAndPrefixedOutput) {
  const int port = pick_free_port();
  auto r = fsdprun({"--nproc-per-node", "2", "--master-port", std::to_string(port), "--", kProbe, "env"});
  ASSERT_TRUE(r.ok()) << r.output;
  auto ranks = by_rank(r.output);
  ASSERT_EQ(ranks.size(), 2u) << r.output;
  for (int rank : {0, 1}) {
    auto env = env_of(ranks[rank]);
    EXPECT_EQ(env["RANK"], std::to_string(rank));
    EXPECT_EQ(env["LOCAL_RANK"], std::to_string(rank));
    EXPECT_EQ(env["ROLE_RANK"], std::to_string(rank));
    EXPECT_EQ(env["GROUP_RANK"], "0");
    EXPECT_EQ(env["ROLE_NAME"], "default");
    EXPECT_EQ(env["WORLD_SIZE"], "2");
    EXPECT_EQ(env["LOCAL_WORLD_SIZE"], "2");
    EXPECT_EQ(env["GROUP_WORLD_SIZE"], "1");
    EXPECT_EQ(env["ROLE_WORLD_SIZE"], "2");
    EXPECT_EQ(env["MASTER_ADDR"], "127.0.0.1");
    EXPECT_EQ(env["MASTER_PORT"], std::to_string(port));
    EXPECT_EQ(env["TORCHELASTIC_RESTART_COUNT"], "0");
    EXPECT_EQ(env["TORCHELASTIC_MAX_RESTARTS"], "0");
    EXPECT_EQ(env["TORCHELASTIC_RUN_ID"], "none");
    EXPECT_EQ(env["TORCHELASTIC_USE_AGENT_STORE"], "True");
    EXPECT_NE(env["OMP_NUM_THREADS"], "<unset>");
    EXPECT_GE(std::atoi(env["OMP_NUM_THREADS"].c_str()), 1);
  }
  EXPECT_NE(r.output.find("[rank0]: RANK=0\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank1]: RANK=1\n"), std::string::npos) << r.output;
}

TEST(Launcher, UserThreadAndBlasSettingsAreKept) {
  ProcessSpec spec = fsdprun_spec({"--master-port", "0", kProbe, "env"});
  spec.env_set["OMP_NUM_THREADS"] = "7";
  spec.env_set["OPENBLAS_CORETYPE"] = "Haswell";
  auto r = run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("[rank0]: OMP_NUM_THREADS=7\n"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank0]: OPENBLAS_CORETYPE=Haswell\n"), std::string::npos) << r.output;
}

TEST(Launcher, TorchrunSpellingsAndProgramArgumentsPassThrough) {
  // Underscores, --flag=value, and a program given without `--`: its own flags stay its own.
  auto r = fsdprun({"--nproc_per_node=2", "--max_restarts=0", "--no_python", "--master_addr=127.0.0.1",
                    "--master_port=0", "--rdzv_id=job7", kProbe, "echo", "--nproc-per-node", "5"});
  ASSERT_TRUE(r.ok()) << r.output;
  auto ranks = by_rank(r.output);
  ASSERT_EQ(ranks.size(), 2u) << r.output;
  for (int rank : {0, 1}) {
    EXPECT_EQ(ranks[rank], (std::vector<std::string>{"arg=--nproc-per-node", "arg=5"})) << r.output;
  }
}

TEST(Launcher, StdoutAndStderrStaySeparateAndPartialLinesAreFlushed) {
  // fsdprun's stderr goes to /dev/null: only stdout's lines may remain.
  auto out_only = run_process(ProcessSpec{
      {"/bin/sh", "-c", "exec \"$0\" --master-port 0 \"$1\" output 2>/dev/null", kFsdprun, kProbe}, {}, kScrub, 60s});
  ASSERT_TRUE(out_only.ok()) << out_only.output;
  EXPECT_EQ(out_only.output, "[rank0]: out-line\n[rank0]: partial-no-newline\n");
  auto err_only = run_process(ProcessSpec{
      {"/bin/sh", "-c", "exec \"$0\" --master-port 0 \"$1\" output >/dev/null", kFsdprun, kProbe}, {}, kScrub, 60s});
  ASSERT_TRUE(err_only.ok()) << err_only.output;
  EXPECT_NE(err_only.output.find("[rank0]: err-line\n"), std::string::npos) << err_only.output;
  EXPECT_EQ(err_only.output.find("out-line"), std::string::npos) << err_only.output;
}

TEST(Launcher, FailingWorkerStopsTheGroupWithinTheGracePeriod) {
  TempDir dir;
  const auto t0 = Clock::now();
  auto r = fsdprun(
      {"--nproc-per-node", "2", "--master-port", "0", "--grace-period-s", "2", kProbe, "exit", "1", "3", dir.path});
  const double elapsed = seconds_since(t0);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_FALSE(r.timed_out);
  EXPECT_NE(r.output.find("fsdprun: worker rank 1 (pid "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("failed first: exit code 3"), std::string::npos) << r.output;
  EXPECT_LT(elapsed, 20.0) << "the sleeping worker (60 s) was not stopped";
  auto pids = values_of(r.output, "pid=");
  auto children = values_of(r.output, "child_pid=");
  EXPECT_EQ(pids.size(), 2u) << r.output;
  EXPECT_EQ(children.size(), 2u) << r.output;
  pids.insert(pids.end(), children.begin(), children.end());
  expect_all_gone(pids);
}

TEST(Launcher, WorkerIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir dir;
  const auto t0 = Clock::now();
  auto r = fsdprun({"--nproc-per-node", "2", "--master-port", "0", "--grace-period-s", "1", kProbe, "exit", "1", "4",
                    dir.path, "ignore-term"});
  const double elapsed = seconds_since(t0);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("failed first: exit code 4"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("sending SIGKILL"), std::string::npos) << r.output;
  EXPECT_GE(elapsed, 1.0);
  EXPECT_LT(elapsed, 20.0);
  auto pids = values_of(r.output, "pid=");
  auto children = values_of(r.output, "child_pid=");
  pids.insert(pids.end(), children.begin(), children.end());
  EXPECT_EQ(pids.size(), 4u) << r.output;
  expect_all_gone(pids);
}

TEST(Launcher, RestartsTheWholeGroupOnce) {
  TempDir dir;
  auto r = fsdprun({"--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "1", "--grace-period-s", "2",
                    kProbe, "fail-once", "3", dir.path});
  ASSERT_TRUE(r.ok()) << r.output;
  auto ranks = by_rank(r.output);
  for (int rank : {0, 1}) {
    EXPECT_EQ(ranks[rank], (std::vector<std::string>{"attempt=0", "attempt=1"})) << r.output;
  }
  EXPECT_NE(r.output.find("restarting all workers (restart 1 of 1)"), std::string::npos) << r.output;
}

TEST(Launcher, GivesUpAfterMaxRestarts) {
  TempDir dir;
  auto r = fsdprun({"--nproc-per-node", "2", "--master-port", "0", "--max-restarts", "1", "--grace-period-s", "2",
                    kProbe, "always-fail", "5", dir.path});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  auto ranks = by_rank(r.output);
  for (int rank : {0, 1}) {
    EXPECT_EQ(ranks[rank], (std::vector<std::string>{"attempt=0", "attempt=1"})) << r.output;
  }
  EXPECT_NE(r.output.find("failed first: exit code 5"), std::string::npos) << r.output;
}

TEST(Launcher, TwoNodesOnOneMachineFormOneJob) {
  const std::string port = std::to_string(pick_free_port());
  auto node = [&](int rank) {
    return fsdprun_spec({"--nnodes", "2", "--node-rank", std::to_string(rank), "--nproc-per-node", "2", "--master-port",
                         port, "--rdzv-timeout-s", "60", "--", kProbe, "store"});
  };
  Child n0(node(0));
  Child n1(node(1));
  auto r1 = n1.wait();
  auto r0 = n0.wait();
  ASSERT_TRUE(r0.ok()) << r0.output;
  ASSERT_TRUE(r1.ok()) << r1.output;
  std::set<int> ranks;
  for (const auto* r : {&r0, &r1}) {
    for (const auto& [rank, lines] : by_rank(r->output)) {
      ranks.insert(rank);
      ASSERT_FALSE(lines.empty());
      EXPECT_EQ(lines.back().rfind("OK rank=" + std::to_string(rank) + " world=4 port=" + port, 0), 0u) << r->output;
    }
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
  EXPECT_EQ(by_rank(r0.output).begin()->first, 0);  // node 0 runs ranks 0-1, node 1 ranks 2-3
  EXPECT_EQ(by_rank(r1.output).begin()->first, 2);
}

TEST(Launcher, FailureOnOneNodeStopsTheOtherNode) {
  const std::string port = std::to_string(pick_free_port());
  TempDir dir;
  auto node = [&](int rank) {
    return fsdprun_spec({"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-port", port,
                         "--grace-period-s", "2", "--rdzv-timeout-s", "60", kProbe, "exit", "1", "3", dir.path});
  };
  const auto t0 = Clock::now();
  Child n0(node(0));
  Child n1(node(1));
  auto r1 = n1.wait();
  auto r0 = n0.wait();
  EXPECT_LT(seconds_since(t0), 30.0);
  EXPECT_EQ(r1.exit_code, 1) << r1.output;
  EXPECT_EQ(r0.exit_code, 1) << r0.output;
  // Node 0's worker was fine: its summary names the failure on node 1.
  EXPECT_NE(r0.output.find("worker rank 1 (pid "), std::string::npos) << r0.output;
  EXPECT_NE(r0.output.find("on node 1) failed first: exit code 3"), std::string::npos) << r0.output;
  auto pids = values_of(r0.output + r1.output, "pid=");
  auto children = values_of(r0.output + r1.output, "child_pid=");
  pids.insert(pids.end(), children.begin(), children.end());
  EXPECT_EQ(pids.size(), 4u) << r0.output << r1.output;
  expect_all_gone(pids);
}

TEST(Launcher, TwoNodesRestartTogether) {
  const std::string port = std::to_string(pick_free_port());
  auto node = [&](int rank) {
    return fsdprun_spec({"--nnodes", "2", "--node-rank", std::to_string(rank), "--master-port", port, "--max-restarts",
                         "1", "--grace-period-s", "2", "--rdzv-timeout-s", "60", kProbe, "store-fail-once", "3"});
  };
  Child n0(node(0));
  Child n1(node(1));
  auto r1 = n1.wait();
  auto r0 = n0.wait();
  ASSERT_TRUE(r0.ok()) << r0.output;
  ASSERT_TRUE(r1.ok()) << r1.output;
  for (const auto& [r, rank] : {std::pair{&r0, 0}, std::pair{&r1, 1}}) {
    auto lines = by_rank(r->output)[rank];
    ASSERT_FALSE(lines.empty()) << r->output;
    EXPECT_EQ(lines.back(), "OK rank=" + std::to_string(rank) + " world=2 port=" + port + " attempt=1") << r->output;
  }
}

class LauncherSignal : public ::testing::TestWithParam<int> {};

TEST_P(LauncherSignal, IsForwardedToTheWorkers) {
  const int sig = GetParam();
  TempDir dir;
  Child c(fsdprun_spec(
      {"--nproc-per-node", "2", "--master-port", "0", "--grace-period-s", "5", kProbe, "sleep", dir.path}));
  std::vector<int> pids;
  const auto deadline = Clock::now() + 30s;
  while (pids.size() < 2 && Clock::now() < deadline) {
    pids.clear();
    for (int rank : {0, 1}) {
      std::ifstream f(dir.path + "/pid_" + std::to_string(rank));
      int pid = 0;
      if (f >> pid) pids.push_back(pid);
    }
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_EQ(pids.size(), 2u) << "workers did not start";
  // Only fsdprun's own process group gets the signal: the workers live in groups of their own.
  const auto t0 = Clock::now();
  c.send_signal(sig);
  auto r = c.wait();
  const double elapsed = seconds_since(t0);
  EXPECT_EQ(r.exit_code, 128 + sig) << r.output;
  EXPECT_LT(elapsed, 10.0);
  EXPECT_NE(r.output.find("stopped by " + std::string(sig == SIGTERM ? "SIGTERM" : "SIGINT")), std::string::npos)
      << r.output;
  expect_all_gone(pids);
}

INSTANTIATE_TEST_SUITE_P(TermAndInt, LauncherSignal, ::testing::Values(SIGTERM, SIGINT));

TEST(Launcher, MasterPortZeroPicksAPortWorkersCanUse) {
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--master-port", "0"}, std::vector<std::string>{"--standalone"}}) {
    std::vector<std::string> args = {"--nproc-per-node", "2"};
    args.insert(args.end(), flags.begin(), flags.end());
    args.insert(args.end(), {kProbe, "store"});
    auto r = fsdprun(args);
    ASSERT_TRUE(r.ok()) << flags[0] << "\n" << r.output;
    auto ranks = by_rank(r.output);
    ASSERT_EQ(ranks.size(), 2u) << r.output;
    for (int rank : {0, 1}) {
      ASSERT_FALSE(ranks[rank].empty());
      const std::string& ok = ranks[rank].back();
      EXPECT_EQ(ok.rfind("OK rank=" + std::to_string(rank) + " world=2 port=", 0), 0u) << r.output;
      EXPECT_EQ(ok.find("port=0 "), std::string::npos) << r.output;
    }
  }
}

struct BadInput {
  std::vector<std::string> args;
  std::string expected;
};

class LauncherBadInput : public ::testing::TestWithParam<BadInput> {};

TEST_P(LauncherBadInput, ExitsWithCode2AndOneClearLine) {
  std::vector<std::string> args;
  for (const auto& a : GetParam().args) args.push_back(a == "PROBE" ? kProbe : a);
  auto r = fsdprun(args, 30s);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output.rfind("fsdprun: ", 0), 0u) << r.output;
  EXPECT_EQ(count_lines(r.output), 1u) << r.output;
  EXPECT_NE(r.output.find(GetParam().expected), std::string::npos) << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LauncherBadInput,
    ::testing::Values(
        BadInput{{"--nproc-per-node", "0", "PROBE", "env"}, "--nproc-per-node '0' is not valid; give a positive"},
        BadInput{{"--nnodes", "2", "--node-rank", "2", "PROBE", "env"}, "--node-rank 2 must be below --nnodes 2"},
        BadInput{{"--nproc-per-node", "2"}, "no program given"},
        BadInput{{"--nproc-per-node", "2", "--"}, "no program given"},
        BadInput{{"--nproc-per-node"}, "--nproc-per-node needs a value"},
        BadInput{{"--bogus", "PROBE"}, "unknown option '--bogus'"},
        BadInput{{"--master-port", "70000", "PROBE"}, "--master-port '70000' is not valid"},
        BadInput{{"--max-restarts", "-1", "PROBE"}, "--max-restarts '-1' is not valid"},
        BadInput{{"--nnodes", "3:2", "PROBE"}, "--nnodes 3:2 has MIN above MAX"},
        BadInput{{"--nnodes", "2", "--master-port", "0", "PROBE"}, "only works with one node"},
        BadInput{{"--standalone", "--nnodes", "2", "PROBE"}, "--standalone runs a single node"},
        BadInput{{"-m", "train"}, "drop -m"},
        BadInput{{"--", "/nonexistent/program"}, "cannot run '/nonexistent/program'"}));

TEST(Launcher, HelpDocumentsEveryFlag) {
  auto r = fsdprun({"--help"}, 30s);
  ASSERT_TRUE(r.ok()) << r.output;
  for (const char* flag : {"--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port",
                           "--standalone", "--max-restarts", "--grace-period-s", "--rdzv-timeout-s",
                           "--monitor-interval", "--rdzv-id", "--role", "--no-python", "TORCHELASTIC_USE_AGENT_STORE",
                           "OMP_NUM_THREADS", "--store", "FSDP_STORE_FILE", "unauthenticated", "trusted network"}) {
    EXPECT_NE(r.output.find(flag), std::string::npos) << flag;
  }
}

}  // namespace
