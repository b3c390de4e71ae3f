// train_gpt --optimizer adamw|adam|sgd|adagrad|rmsprop, end to end: each trains, saves at 2 ranks
// and resumes in one process (another world size) to the same losses as an uninterrupted run;
// resuming with another optimizer stops with one line naming both (as --optimizer values).
#include <gtest/gtest.h>

#include <map>

#include "subprocess.h"
#include "train_gpt_harness.h"

namespace {

using namespace train_gpt_test;
using namespace std::chrono_literals;

std::vector<std::string> with_optimizer(const std::string& metrics, const std::string& optimizer,
                                        const std::string& ckpt, const std::vector<std::string>& extra = {}) {
  // A learning rate each optimizer trains with in 6 steps.
  const std::map<std::string, std::string> lr = {
      {"adamw", "0.003"},    {"adam", "0.003"},        {"sgd", "0.05"},         {"adagrad", "0.005"},
      {"rmsprop", "0.0003"}, {"fused-adamw", "0.003"}, {"fused-adam", "0.003"}, {"fused-sgd", "0.05"}};
  return apply(tiny(metrics, {"--optimizer", optimizer, "--lr", lr.at(optimizer), "--checkpoint-dir", ckpt,
                              "--checkpoint-every", "2"}),
               extra);
}

class TrainGptOptimizer : public ::testing::TestWithParam<std::string> {};

TEST_P(TrainGptOptimizer, SavedAtTwoRanksResumesInOneProcessLikeAnUninterruptedRun) {
  TempDir dir;
  const std::string opt = GetParam();
  auto reference = alone(with_optimizer(dir / "ref.jsonl", opt, ""), 90s);
  ASSERT_TRUE(reference.ok()) << reference.output;
  const auto want = losses(dir / "ref.jsonl");
  ASSERT_EQ(want.size(), 6u);
  EXPECT_LT(want.back(), want.front()) << opt << " did not train";

  // The same 6-step run (same lr schedule) at 2 ranks, checkpointing every 2 steps; then one
  // process resumes its step_000004 (saves going elsewhere) and runs steps 5 and 6.
  auto first = ranks(2, with_optimizer(dir / "a.jsonl", opt, dir / "ckpt"), 120s);
  ASSERT_TRUE(first.ok()) << first.output;
  auto resumed =
      alone(with_optimizer(dir / "b.jsonl", opt, dir / "other", {"--resume-from", dir / "ckpt/step_000004"}), 90s);
  ASSERT_TRUE(resumed.ok()) << resumed.output;
  EXPECT_NE(resumed.output.find("at step 4"), std::string::npos) << resumed.output;
  const auto got = losses(dir / "b.jsonl");
  ASSERT_EQ(got.size(), 2u) << resumed.output;
  // Another world size sums in another order: equal within float rounding, as
  // TrainGpt.NoneAndFsdpTwoRanksGiveTheSameLosses.
  expect_close(got, {want[4], want[5]}, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Every, TrainGptOptimizer, ::testing::Values("adamw", "adam", "sgd", "adagrad", "rmsprop"),
                         [](const auto& info) { return info.param; });

// --optimizer fused-adamw (fsdp::optim::FusedAdamW) at 2 ranks: adamw's losses to 1e-5; its
// checkpoint (the same keys as LibTorch's AdamW) resumes under adamw in one process as the
// uninterrupted run goes on.
TEST(TrainGptOptimizers, FusedAdamwTrainsLikeAdamwAndAdamwResumesItsCheckpoint) {
  TempDir dir;
  auto plain = ranks(2, with_optimizer(dir / "a.jsonl", "adamw", ""), 120s);
  ASSERT_TRUE(plain.ok()) << plain.output;
  const auto want = losses(dir / "a.jsonl");
  ASSERT_EQ(want.size(), 6u);
  auto fused = ranks(2, with_optimizer(dir / "f.jsonl", "fused-adamw", dir / "ckpt"), 120s);
  ASSERT_TRUE(fused.ok()) << fused.output;
  expect_close(losses(dir / "f.jsonl"), want, 1e-5);
  auto resumed =
      alone(with_optimizer(dir / "r.jsonl", "adamw", dir / "other", {"--resume-from", dir / "ckpt/step_000004"}), 90s);
  ASSERT_TRUE(resumed.ok()) << resumed.output;
  expect_close(losses(dir / "r.jsonl"), {want[4], want[5]}, 1e-5);
}

TEST(TrainGptOptimizers, ResumingWithAnotherOptimizerStopsWithOneLine) {
  TempDir dir;
  auto first = alone(with_optimizer(dir / "a.jsonl", "sgd", dir / "ckpt", {"--steps", "2"}), 90s);
  ASSERT_TRUE(first.ok()) << first.output;
  auto other = alone(with_optimizer(dir / "b.jsonl", "rmsprop", dir / "ckpt", {"--resume"}), 90s);
  EXPECT_FALSE(other.ok()) << other.output;
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_NE(other.output.find("holds the state of another optimizer than --optimizer rmsprop: resume with "
                              "--optimizer sgd (what it was trained with)"),
            std::string::npos)
      << other.output;
  EXPECT_FALSE(trained(other.output)) << other.output;
}

// --cpu-offload (fully_shard with CPUOffloadPolicy for every unit) with its fast pairing,
// fused-adamw, at 2 ranks: on the CPU nothing moves, so the losses are those of the run without
// it, bit for bit; the banner counts the units under the policy and the shards on the host; its
// checkpoint resumes under --cpu-offload as the uninterrupted run goes on. Without fully_shard
// (--parallel none or replicate) it is refused in one line.
TEST(TrainGptOptimizers, CpuOffloadTrainsAndResumesLikeTheRunWithoutIt) {
  TempDir dir;
  auto offload = [](std::vector<std::string> args) {
    args.push_back("--cpu-offload");
    return args;
  };
  auto plain = ranks(2, with_optimizer(dir / "a.jsonl", "fused-adamw", ""), 120s);
  ASSERT_TRUE(plain.ok()) << plain.output;
  const auto want = losses(dir / "a.jsonl");
  ASSERT_EQ(want.size(), 6u);
  EXPECT_EQ(plain.output.find("cpu offload"), std::string::npos) << plain.output;
  auto off = ranks(2, offload(with_optimizer(dir / "o.jsonl", "fused-adamw", dir / "ckpt")), 120s);
  ASSERT_TRUE(off.ok()) << off.output;
  EXPECT_EQ(losses(dir / "o.jsonl"), want);
  // 2 blocks and the root; this rank's shards of the 2-layer GPT's 29 parameters, all on the host.
  EXPECT_NE(off.output.find("cpu offload: fully_shard's CPUOffloadPolicy on 3 units; 29 of 29 parameter shards"),
            std::string::npos)
      << off.output;
  auto resumed = ranks(2,
                       offload(with_optimizer(dir / "r.jsonl", "fused-adamw", dir / "other",
                                              {"--resume-from", dir / "ckpt/step_000004"})),
                       120s);
  ASSERT_TRUE(resumed.ok()) << resumed.output;
  EXPECT_EQ(losses(dir / "r.jsonl"), (std::vector<double>{want[4], want[5]}));
  for (const std::string parallel : {"none", "replicate"}) {
    std::vector<std::string> argv = {kTrainGpt, "--parallel", parallel};
    for (const auto& arg : offload(tiny(dir / "n.jsonl"))) argv.push_back(arg);
    auto refused = run_process(spec_of(argv, 60s));
    EXPECT_EQ(refused.exit_code, 2) << refused.output;
    EXPECT_NE(refused.output.find("train_gpt: error: --cpu-offload needs fully_shard's CPUOffloadPolicy: --parallel " +
                                  parallel),
              std::string::npos)
        << refused.output;
    EXPECT_FALSE(trained(refused.output)) << refused.output;
  }
}

TEST(TrainGptOptimizers, HelpNamesEveryOptimizerAndABadOneIsRefused) {
  auto help = run_process(spec_of({kTrainGpt, "--help"}, 30s));
  ASSERT_TRUE(help.ok()) << help.output;
  EXPECT_NE(help.output.find("adamw | adam | sgd"), std::string::npos) << help.output;
  EXPECT_NE(help.output.find("--cpu-offload"), std::string::npos) << help.output;
  auto bad = run_process(spec_of({kTrainGpt, "--optimizer", "lbfgs", "--checkpoint-dir", "", "--metrics", ""}, 30s));
  EXPECT_FALSE(bad.ok());
  EXPECT_NE(bad.output.find("--optimizer: lbfgs not in"), std::string::npos) << bad.output;
}

}  // namespace

namespace {

// --optimizer is among the options every rank must agree on (fingerprint.h): rank 1 with sgd
// while rank 0 has adamw fails before the first step, naming the option.
TEST(TrainGptOptimizers, RanksWithDifferentOptimizersFailBeforeTheFirstStep) {
  TempDir dir;
  std::vector<std::string> argv = {
      kFsdprun,
      "--nproc-per-node",
      "2",
      "--master-port",
      "0",
      "--",
      "/bin/sh",
      "-c",
      "if [ \"$RANK\" = 1 ]; then exec \"$0\" \"$@\" --optimizer sgd; else exec \"$0\" \"$@\"; fi",
      kTrainGpt};
  const auto args = tiny(dir / "m.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = run_process(spec_of(argv, 120s));
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("--optimizer is 'adamw' on rank 0 and 'sgd' on rank 1"), std::string::npos) << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
}

}  // namespace
