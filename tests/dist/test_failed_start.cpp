// A failed start must end the process: init_distributed that cannot form the world group throws,
// and the process then exits within a bounded time, whatever store it used and however far the
// Gloo rendezvous got. Each case runs several times (FSDP_TEST_REPEAT, default 3), because a
// teardown that hangs does so only now and then (1 run in 7 on a loaded machine).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "subprocess.h"
#include "test_helpers.h"

namespace {

using Clock = std::chrono::steady_clock;
using fsdp::testing::Child;
using fsdp::testing::ProcessResult;
using fsdp::testing::ProcessSpec;

// The collective timeout the ranks get, and the bound on the whole process (start, store,
// rendezvous timeout, error, teardown, exit) that the test asserts, far below the hard kill.
constexpr int kTimeoutS = 2;
constexpr double kExitBoundS = 20.0;

int repeats() {
  const char* r = std::getenv("FSDP_TEST_REPEAT");
  return r != nullptr && std::atoi(r) > 0 ? std::atoi(r) : 3;
}

// One rank of `world` running the worker `expect_init_error` (test_runtime.cpp): it calls
// init_distributed itself and passes when that throws an error containing `expect`.
ProcessSpec rank_spec(int rank, int world, int port, const std::string& expect,
                      std::map<std::string, std::string> extra = {}) {
  ProcessSpec spec;
  spec.argv = {fsdp::testing::self_exe()};
  spec.timeout = std::chrono::seconds(60);
  spec.env_set = {{"FSDP_TEST_WORKER", "expect_init_error"},
                  {"FSDP_TEST_INIT", "0"},
                  {"RANK", std::to_string(rank)},
                  {"WORLD_SIZE", std::to_string(world)},
                  {"MASTER_ADDR", "127.0.0.1"},
                  {"MASTER_PORT", std::to_string(port)},
                  {"FSDP_COLLECTIVE_TIMEOUT_S", std::to_string(kTimeoutS)},
                  {"EXPECT_ERROR", expect}};
  for (auto& [k, v] : extra) spec.env_set[k] = v;
  spec.env_unset = {"TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FSDP_STORE_FILE"};
  return spec;
}

// Starts the given ranks together; each must fail init_distributed as expected and exit within
// kExitBoundS of its start.
void expect_prompt_failed_start(const std::vector<ProcessSpec>& specs, const std::string& what) {
  for (int i = 0; i < repeats(); ++i) {
    const auto t0 = Clock::now();
    std::vector<Child> children;
    for (const auto& s : specs) children.emplace_back(s);
    for (size_t r = 0; r < children.size(); ++r) {
      ProcessResult res = children[r].wait();
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      EXPECT_FALSE(res.timed_out) << what << ", run " << i << ", process " << r
                                  << ": did not exit after the failed start (killed after 60 s)\n"
                                  << res.output;
      EXPECT_TRUE(res.ok()) << what << ", run " << i << ", process " << r << "\n" << res.output;
      EXPECT_LT(s, kExitBoundS) << what << ", run " << i << ", process " << r << "\n" << res.output;
      EXPECT_NE(res.output.find("could not form the world group"), std::string::npos) << res.output;
    }
    if (::testing::Test::HasFailure()) return;  // one failing run says it all
  }
}

// A TCPStore server in the test process, as a launcher agent hosts one.
c10::intrusive_ptr<c10d::TCPStore> agent_store(int port) {
  c10d::TCPStoreOptions opts = fsdp::compat::tcp_store_options();
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(30);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
}

const std::string kExpect = "could not form the world group";

}  // namespace

TEST(FailedStart, LoneRankZeroHostingTheStoreExits) {
  expect_prompt_failed_start({rank_spec(0, 2, fsdp::testing::pick_free_port(), kExpect)}, "rank 0 of 2 alone");
}

// Two of three ranks meet and connect to each other in Gloo before timing out on the third:
// a half-formed group with live connections must be torn down too. The store is already up (an
// agent's), so that a slow start of one rank cannot fail the other at the store instead.
TEST(FailedStart, HalfFormedGroupExits) {
  const int port = fsdp::testing::pick_free_port();
  auto store = agent_store(port);
  const std::map<std::string, std::string> agent = {{"TORCHELASTIC_USE_AGENT_STORE", "True"}};
  expect_prompt_failed_start({rank_spec(0, 3, port, kExpect, agent), rank_spec(1, 3, port, kExpect, agent)},
                             "ranks 0, 1 of 3 on an agent's TCP store");
}

TEST(FailedStart, LoneClientOfAnAgentStoreExits) {
  const int port = fsdp::testing::pick_free_port();
  auto store = agent_store(port);
  expect_prompt_failed_start({rank_spec(1, 2, port, kExpect, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}})},
                             "rank 1 of 2 on an agent's TCP store");
}

TEST(FailedStart, LoneRankOnAFileStoreExits) {
  fsdp::testing::TempDir dir("fsdp_filestore");
  expect_prompt_failed_start(
      {rank_spec(0, 2, 29500, kExpect, {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"FSDP_STORE_FILE", dir / "store"}})},
      "rank 0 of 2 on a FileStore");
}

// A rank waiting for its peers says so every FSDP_WAIT_REPORT_S seconds (default 30) instead of
// waiting the whole timeout in silence: how many of how many ranks, and where (the TCP store's
// address, or the store file); before the store is reachable, that it waits for the store.
TEST(FailedStart, WaitingRankSaysForWhomAndWhere) {
  const std::map<std::string, std::string> fast = {{"FSDP_COLLECTIVE_TIMEOUT_S", "4"}, {"FSDP_WAIT_REPORT_S", "1"}};
  const int port = fsdp::testing::pick_free_port();
  ProcessResult r = Child(rank_spec(0, 2, port, kExpect, fast)).wait();
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("fsdp: rank 0 waiting for 1 of 2 ranks at 127.0.0.1:" + std::to_string(port) + " ("),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("so far, timeout 4.0 s)"), std::string::npos) << r.output;
  size_t lines = 0;
  for (auto at = r.output.find("waiting for 1 of 2"); at != std::string::npos;
       at = r.output.find("waiting for 1 of 2", at + 1))
    ++lines;
  EXPECT_GE(lines, 2u) << "a line a second through a 4 s timeout\n" << r.output;

  fsdp::testing::TempDir dir("fsdp_filestore");
  auto file = fast;
  file["FSDP_STORE_FILE"] = dir / "store";
  r = Child(rank_spec(1, 3, 29500, kExpect, file)).wait();
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("fsdp: rank 1 waiting for 2 of 3 ranks at the store file " + dir / "store"),
            std::string::npos)
      << r.output;

  // Rank 1 of a TCP store nobody hosts: it waits for the store.
  r = Child(rank_spec(1, 2, fsdp::testing::pick_free_port(), "could not reach the store", fast)).wait();
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("fsdp: rank 1 waiting for the store (rank 0 or the launcher hosts it) at 127.0.0.1:"),
            std::string::npos)
      << r.output;

  // 0: silent, as before; a bad value is named before any wait.
  auto quiet = fast;
  quiet["FSDP_WAIT_REPORT_S"] = "0";
  r = Child(rank_spec(0, 2, fsdp::testing::pick_free_port(), kExpect, quiet)).wait();
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_EQ(r.output.find("waiting for"), std::string::npos) << r.output;
  auto bad = fast;
  bad["FSDP_WAIT_REPORT_S"] = "soon";
  r = Child(
          rank_spec(0, 2, fsdp::testing::pick_free_port(), "FSDP_WAIT_REPORT_S='soon' is not a number of seconds", bad))
          .wait();
  EXPECT_TRUE(r.ok()) << r.output;
}
