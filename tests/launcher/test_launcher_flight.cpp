// fsdprun --flight-recorder-dir: the workers get FSDP_FLIGHT_RECORDER_DIR, and when a worker fails
// (here rank 0's all-gather times out because rank 1 never joins it) fsdprun prints one line
// naming the dump folder and the fsdp-fr command. The test binary is its own worker.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <regex>
#include <string>
#include <thread>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "subprocess.h"
#include "test_helpers.h"

namespace {

const std::string kFsdprun = FSDPRUN_PATH;

}  // namespace

// Rank 0 all-gathers and times out (the worker then fails); rank 1 never joins and waits until
// fsdprun stops it.
FSDP_RANK_WORKER(all_gather_without_rank1) {
  auto world = fsdp::dist::world_comm();
  auto t = at::ones({4});
  world->all_reduce(t);
  if (world->rank() == 0) {
    auto out = at::empty({8});
    world->all_gather_into_tensor(out, t);  // throws CommError after FSDP_COLLECTIVE_TIMEOUT_S
    return;
  }
  std::this_thread::sleep_for(std::chrono::seconds(60));
  std::_Exit(0);
}

TEST(LauncherFlightRecorder, FailedWorkerLinePointsAtTheDumps) {
  fsdp::testing::TempDir dir("fsdprun_fr");
  const std::string fr_dir = dir / "fr";
  fsdp::testing::ProcessSpec spec;
  spec.argv = {kFsdprun,
               "--nproc-per-node",
               "2",
               "--master-port",
               "0",
               "--grace-period-s",
               "2",
               "--flight-recorder-dir",
               fr_dir,
               "--",
               fsdp::testing::self_exe()};
  spec.env_set = {{"FSDP_TEST_WORKER", "all_gather_without_rank1"}, {"FSDP_COLLECTIVE_TIMEOUT_S", "2"}};
  spec.env_unset = {"FSDP_FLIGHT_RECORDER_DIR", "FSDP_FLIGHT_RECORDER_SIZE"};
  spec.timeout = std::chrono::seconds(90);
  const auto result = fsdp::testing::run_process(spec);
  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_NE(result.exit_code, 0) << result.output;
  EXPECT_TRUE(std::filesystem::exists(fr_dir + "/rank_0.jsonl")) << result.output;
  // One line: where, which files, the command.
  const std::regex line("fsdprun: flight recorder: [0-9]+ dumps? in " + fr_dir +
                        " \\([^)]*rank_0\\.jsonl[^)]*\\); line the ranks up with: fsdp-fr " + fr_dir + "\n");
  EXPECT_TRUE(std::regex_search(result.output, line)) << result.output;
}

TEST(LauncherFlightRecorder, EmptyFolderOptionIsAUsageError) {
  fsdp::testing::ProcessSpec spec;
  spec.argv = {kFsdprun, "--flight-recorder-dir", "", "--", "/bin/true"};
  spec.timeout = std::chrono::seconds(30);
  const auto result = fsdp::testing::run_process(spec);
  EXPECT_EQ(result.exit_code, 2) << result.output;
  EXPECT_NE(result.output.find("--flight-recorder-dir is empty"), std::string::npos) << result.output;
}
