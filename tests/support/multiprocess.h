#pragma once
// Multi-process tests: the test binary starts N copies of itself, one per rank, with torchrun's
// environment; each copy runs a registered worker function instead of the test suite.
//
//   FSDP_RANK_WORKER(all_gather_works) { auto world = fsdp::dist::world_comm(); ... }
//   TEST(Comm, AllGather) { EXPECT_RANKS_PASS(2, "all_gather_works"); }
//
// A worker fails by throwing (TORCH_CHECK, or any exception) or exiting non-zero. Every run has a
// timeout: a hang kills the process group and fails the test.
#include <chrono>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "subprocess.h"

namespace fsdp::testing {

using RankWorker = std::function<void()>;
bool register_rank_worker(const std::string& name, RankWorker fn);

struct RanksOptions {
  std::chrono::milliseconds timeout{90000};
  std::map<std::string, std::string> env;  // extra variables for every rank
  bool init_runtime = true;                // call init_distributed() before the worker body
};

struct RanksResult {
  std::vector<ProcessResult> ranks;
  bool all_ok() const;
  std::string report() const;  // every rank's status and output, for failure messages
};

// Starts `world` ranks of this binary running worker `name`, waits for all of them.
RanksResult run_ranks(int world, const std::string& name, const RanksOptions& options = {});

// Call from main(): runs the worker selected by FSDP_TEST_WORKER and returns its exit code, or
// returns -1 when this process is the test runner itself.
int maybe_run_worker();

}  // namespace fsdp::testing

#define FSDP_RANK_WORKER(name)                                                                                        \
  static void fsdp_worker_##name();                                                                                   \
  static const bool fsdp_worker_registered_##name = ::fsdp::testing::register_rank_worker(#name, fsdp_worker_##name); \
  static void fsdp_worker_##name()

#define EXPECT_RANKS_PASS(world, name, ...)                                     \
  do {                                                                          \
    auto fsdp_result_ = ::fsdp::testing::run_ranks(world, name, ##__VA_ARGS__); \
    EXPECT_TRUE(fsdp_result_.all_ok()) << fsdp_result_.report();                \
  } while (0)
