// train_gpt end to end: the real trainer, alone (--parallel none) and under the real fsdprun,
// on tiny models so that each run takes seconds. Every run is bounded by a timeout.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "subprocess.h"
#include "train_gpt_harness.h"

namespace {

using namespace train_gpt_test;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

TEST(TrainGpt, HelpDocumentsEveryOption) {
  auto r = run_process(spec_of({kTrainGpt, "--help"}, 30s));
  ASSERT_TRUE(r.ok()) << r.output;
  for (const char* opt : {"--data",
                          "--layers",
                          "--dim",
                          "--heads",
                          "--seq-len",
                          "--batch-size",
                          "--grad-accum",
                          "--steps",
                          "--lr",
                          "--warmup",
                          "--weight-decay",
                          "--clip",
                          "--seed",
                          "--parallel",
                          "--shard-size",
                          "--mixed-precision",
                          "--reshard-after-forward",
                          "--checkpoint-dir",
                          "--checkpoint-every",
                          "--resume",
                          "--eval-every",
                          "--sample-tokens",
                          "--metrics"}) {
    EXPECT_NE(r.output.find(opt), std::string::npos) << opt << " missing from --help:\n" << r.output;
  }
}

// Each bad command stops before any work with exit status 2 and one line naming the problem.
TEST(TrainGpt, InvalidOptionsFailWithOneLine) {
  TempDir dir;
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{"--heads", "3", "--dim", "32"}, "train_gpt: error: --heads 3 does not divide --dim 32"},
      {{"--batch-size", "8", "--grad-accum", "3"}, "train_gpt: error: --grad-accum 3 does not divide --batch-size 8"},
      {{"--data", dir / "missing.txt"}, "train_gpt: error: cannot read data file '" + (dir / "missing.txt") + "'"},
      {{"--data", "synthetic", "--parallel", "replicate", "--mixed-precision", "bf16"},
       "train_gpt: error: --mixed-precision bf16 needs fully_shard's MixedPrecisionPolicy: use --parallel fsdp or "
       "hsdp"},
      {{"--parallel", "bogus"}, "train_gpt: error: --parallel: bogus not in {fsdp,hsdp,replicate,none}"},
      {{"--steps", "0"}, "train_gpt: error: --steps: must be a number >= 1, not '0'"},
      {{"--no-such-option"}, "train_gpt: error: The following argument was not expected: --no-such-option"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {kTrainGpt, "--checkpoint-dir", "", "--metrics", ""};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    auto r = run_process(spec_of(argv, 30s));
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output.rfind(c.message, 0), 0u) << "expected: " << c.message << "\ngot: " << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
  }
  // The world size matters: 2 ranks x grad-accum 2 do not divide a batch of 6.
  auto r = ranks(2, tiny("", {"--batch-size", "6", "--grad-accum", "2"}), 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train_gpt: error: --batch-size 6 is not divisible by world size 2 x --grad-accum 2 = 4"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(trained(r.output)) << "trained before failing:\n" << r.output;
  // HSDP's shard groups must split the world evenly.
  r = ranks(2, tiny("", {"--parallel", "hsdp", "--shard-size", "3"}), 60s);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("train_gpt: error: --shard-size 3 does not divide the world size 2"), std::string::npos)
      << r.output;
}

// One process without a process group and FSDP on 2 ranks see the same global batches and give
// the same losses (float32, 1e-5 relative), with and without gradient accumulation.
TEST(TrainGpt, NoneAndFsdpTwoRanksGiveTheSameLosses) {
  TempDir dir;
  auto a = alone(tiny(dir / "none.jsonl"));
  ASSERT_TRUE(a.ok()) << a.output;
  auto b = ranks(2, tiny(dir / "fsdp.jsonl"));
  ASSERT_TRUE(b.ok()) << b.output;
  auto c = ranks(2, tiny(dir / "fsdp_accum.jsonl", {"--grad-accum", "2"}));
  ASSERT_TRUE(c.ok()) << c.output;
  const auto reference = losses(dir / "none.jsonl");
  ASSERT_EQ(reference.size(), 6u);
  EXPECT_LT(reference.back(), reference.front()) << "not learning";
  expect_close(losses(dir / "fsdp.jsonl"), reference, 1e-5);
  expect_close(losses(dir / "fsdp_accum.jsonl"), reference, 1e-5);
}

// FSDP in a world of one (the trainer skips its own collectives there: the loss and stop flag,
// the memory gather, the validation sum, the sampled token) gives one process's losses and
// validation losses, and still reports its memory and its sample.
TEST(TrainGpt, FsdpWorldOfOneGivesTheLossesOfOneProcess) {
  TempDir dir;
  const std::vector<std::string> extra = {"--eval-every", "3", "--sample-tokens", "8"};
  auto a = alone(tiny(dir / "none.jsonl", extra));
  ASSERT_TRUE(a.ok()) << a.output;
  auto b = ranks(1, tiny(dir / "one.jsonl", extra));
  ASSERT_TRUE(b.ok()) << b.output;
  EXPECT_NE(b.output.find("--parallel fsdp, 1 rank"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("[rank0]: ---- sample"), std::string::npos) << b.output;
  expect_close(losses(dir / "one.jsonl"), losses(dir / "none.jsonl"), 1e-5);
  const auto none = read_metrics(dir / "none.jsonl"), one = read_metrics(dir / "one.jsonl");
  ASSERT_EQ(one.size(), none.size());
  for (size_t s = 0; s + 1 < one.size(); ++s) {
    EXPECT_GT(one[s]["peak_rss_bytes"].get<int64_t>(), 0) << one[s].dump();
    EXPECT_EQ(one[s]["max_peak_rss_bytes"].get<int64_t>(), one[s]["peak_rss_bytes"].get<int64_t>()) << one[s].dump();
    ASSERT_EQ(one[s].contains("val_loss"), none[s].contains("val_loss")) << one[s].dump();
    if (one[s].contains("val_loss")) {
      expect_close({one[s]["val_loss"].get<double>()}, {none[s]["val_loss"].get<double>()}, 1e-5);
    }
  }
}

// HSDP (2 replicas x 1, and 1 x 2) and replicate (DDP), with and without accumulation, see the
// same batches and give the same losses as one process.
TEST(TrainGpt, HsdpAndReplicateGiveTheSameLossesAsOneProcess) {
  TempDir dir;
  auto a = alone(tiny(dir / "none.jsonl"));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto reference = losses(dir / "none.jsonl");
  const std::vector<std::pair<std::string, std::vector<std::string>>> runs = {
      {"hsdp_2x1", {"--parallel", "hsdp", "--shard-size", "1"}},
      {"hsdp_1x2", {"--parallel", "hsdp", "--shard-size", "2", "--grad-accum", "2"}},
      {"replicate", {"--parallel", "replicate"}},
      {"replicate_accum", {"--parallel", "replicate", "--grad-accum", "2"}},
  };
  for (const auto& [name, extra] : runs) {
    auto r = ranks(2, tiny(dir / (name + ".jsonl"), extra));
    ASSERT_TRUE(r.ok()) << name << "\n" << r.output;
    EXPECT_NE(r.output.find("--parallel " + extra[1]), std::string::npos) << r.output;
    expect_close(losses(dir / (name + ".jsonl")), reference, 1e-5);
  }
}

TEST(TrainGpt, MetricsFileHasEveryFieldAndASummary) {
  TempDir dir;
  auto r = ranks(2, tiny(dir / "m.jsonl", {"--eval-every", "3", "--sample-tokens", "20"}));
  ASSERT_TRUE(r.ok()) << r.output;
  auto lines = read_metrics(dir / "m.jsonl");
  ASSERT_EQ(lines.size(), 7u);
  for (int s = 0; s < 6; ++s) {
    const auto& j = lines[s];
    EXPECT_EQ(j["step"].get<int>(), s + 1);
    for (const char* key : {"loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "comm_bytes", "param_bytes",
                            "grad_bytes", "optim_bytes", "peak_rss_bytes", "max_peak_rss_bytes", "minor_faults"}) {
      EXPECT_TRUE(j.contains(key)) << key << " missing: " << j.dump();
    }
    EXPECT_GT(j["comm_bytes"].get<int64_t>(), 0);
    EXPECT_GE(j["minor_faults"].get<int64_t>(), 0) << j.dump();
    EXPECT_GE(j["max_peak_rss_bytes"].get<int64_t>(), j["peak_rss_bytes"].get<int64_t>());
    EXPECT_EQ(j.contains("val_loss"), s == 2 || s == 5) << j.dump();
  }
  EXPECT_TRUE(lines[6]["summary"].get<bool>());
  EXPECT_GT(lines[6]["median_step_time_s"].get<double>(), 0.0);
  // The first step maps the optimizer's state and the first activations in: it faults. A steady step
  // may fault no page at all (glibc reuses what the previous step freed), so the summary is checked
  // as what it is: the median of steps 2..6's counts.
  EXPECT_GT(lines[0]["minor_faults"].get<int64_t>(), 0) << lines[0].dump();
  std::vector<double> steady;
  for (int s = 1; s < 6; ++s) steady.push_back(static_cast<double>(lines[s]["minor_faults"].get<int64_t>()));
  std::sort(steady.begin(), steady.end());
  EXPECT_EQ(lines[6]["median_minor_faults_per_step"].get<double>(), steady[2]) << lines[6].dump();
  EXPECT_NE(r.output.find("[rank0]: ---- sample"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank0]: step     6/6"), std::string::npos) << r.output;
}

TEST(TrainGpt, Bf16MixedPrecisionTrains) {
  TempDir dir;
  // English-like text: its byte statistics are learnt within a few steps.
  {
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 400; ++i) text << "the quick brown fox " << i << " jumps over the lazy dog.\n";
  }
  const std::vector<std::string> longer = {"--data", dir / "text.txt", "--steps",  "20",
                                           "--lr",   "0.01",           "--warmup", "5"};
  auto fp32 = ranks(2, tiny(dir / "fp32.jsonl", longer));
  ASSERT_TRUE(fp32.ok()) << fp32.output;
  auto extra = longer;
  extra.insert(extra.end(), {"--mixed-precision", "bf16"});
  auto r = ranks(2, tiny(dir / "bf16.jsonl", extra));
  ASSERT_TRUE(r.ok()) << r.output;
  auto l = losses(dir / "bf16.jsonl"), ref = losses(dir / "fp32.jsonl");
  ASSERT_EQ(l.size(), 20u);
  EXPECT_LT(l.back(), l.front() * 0.9) << "bf16 is not learning";
  EXPECT_NEAR(l.back(), ref.back(), 0.05 * ref.back()) << "bf16 drifts from fp32";
}

std::vector<std::string> with_checkpoints(const std::string& metrics, const std::string& ckpt,
                                          const std::vector<std::string>& extra = {}) {
  return apply(tiny(metrics, {"--checkpoint-dir", ckpt, "--checkpoint-every", "2"}), extra);
}

// A run resumed from its step-4 checkpoint continues the same data stream and optimizer state:
// same world size, bitwise the same losses; another world size (--parallel none), 1e-5.
TEST(TrainGpt, ResumeContinuesTheUninterruptedRun) {
  TempDir dir;
  auto a = ranks(2, with_checkpoints(dir / "a.jsonl", dir / "a"));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto reference = losses(dir / "a.jsonl");
  ASSERT_EQ(reference.size(), 6u);
  for (const char* step : {"step_000002", "step_000004", "step_000006"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir / "a") / step / "index.json")) << step;
  }
  // Two copies of the checkpoints up to step 4; resume each.
  for (const char* name : {"b", "c"}) {
    fs::create_directories(dir / name);
    for (const char* step : {"step_000002", "step_000004"}) {
      fs::copy(fs::path(dir / "a") / step, fs::path(dir / name) / step, fs::copy_options::recursive);
    }
    std::ofstream(dir / (std::string(name) + ".jsonl")) << "{\"step\":1,\"loss\":9}\n";  // replaced up to step 4
  }
  auto b = ranks(2, with_checkpoints(dir / "b.jsonl", dir / "b", {"--resume"}));
  ASSERT_TRUE(b.ok()) << b.output;
  EXPECT_NE(b.output.find("resumed " + (dir / "b") + "/step_000004 at step 4"), std::string::npos) << b.output;
  auto resumed = losses(dir / "b.jsonl");
  ASSERT_EQ(resumed.size(), 3u);  // the kept line of step 1, then steps 5 and 6
  EXPECT_EQ(resumed[1], reference[4]);
  EXPECT_EQ(resumed[2], reference[5]);
  expect_same_checkpoint_tensors(fs::path(dir / "a") / "step_000006", fs::path(dir / "b") / "step_000006");

  auto c = alone(with_checkpoints(dir / "c.jsonl", dir / "c", {"--resume"}));
  ASSERT_TRUE(c.ok()) << c.output;
  auto other_world = losses(dir / "c.jsonl");
  ASSERT_EQ(other_world.size(), 3u);
  expect_close({other_world[1], other_world[2]}, {reference[4], reference[5]}, 1e-5);
}

TEST(TrainGpt, ResumingAnotherModelShapeFailsWithOneLine) {
  TempDir dir;
  auto a = alone(with_checkpoints(dir / "a.jsonl", dir / "ckpt", {"--steps", "2"}));
  ASSERT_TRUE(a.ok()) << a.output;
  auto args = with_checkpoints(dir / "b.jsonl", dir / "ckpt", {"--resume", "--dim", "48"});
  std::vector<std::string> argv = {kTrainGpt, "--parallel", "none"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = run_process(spec_of(argv, 60s));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.output.rfind("train_gpt: error: checkpoint " + (dir / "ckpt") +
                               "/step_000002 holds another model than this run's: it holds GPT 2 layers, dim 32, ",
                           0),
            0u)
      << r.output;
  EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
}

// The fault-tolerance check: under fsdprun --max-restarts 1, rank 1 SIGKILLs itself
// before step 4 (FSDP_TEST_KILL_AT_STEP=3); the launcher stops rank 0 and restarts the group,
// which resumes from step_000002; the final parameters and optimizer state equal an
// uninterrupted run's bit for bit.
TEST(TrainGpt, KilledRankRestartsFromTheLastCheckpoint) {
  TempDir dir;
  auto a = ranks(2, with_checkpoints(dir / "a.jsonl", dir / "a"));
  ASSERT_TRUE(a.ok()) << a.output;
  auto spec = spec_of(fsdprun_argv(2, with_checkpoints(dir / "b.jsonl", dir / "b", {"--resume"}),
                                   {"--max-restarts", "1", "--grace-period-s", "5"}),
                      180s);
  spec.env_set["FSDP_TEST_KILL_AT_STEP"] = "3";
  auto b = run_process(spec);
  ASSERT_TRUE(b.ok()) << b.output;
  EXPECT_NE(b.output.find("rank 1 kills itself"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resumed " + (dir / "b") + "/step_000002 at step 2"), std::string::npos) << b.output;
  EXPECT_EQ(losses(dir / "b.jsonl"), losses(dir / "a.jsonl"));
  expect_same_checkpoint_tensors(fs::path(dir / "a") / "step_000006", fs::path(dir / "b") / "step_000006");
}

// SIGINT to fsdprun reaches the ranks; they agree at the next step boundary, save and exit 0.
TEST(TrainGpt, SigintSavesACheckpointAndExitsCleanly) {
  TempDir dir;
  auto args = with_checkpoints(dir / "m.jsonl", dir / "ckpt", {"--steps", "100000", "--checkpoint-every", "0"});
  Child child(spec_of(fsdprun_argv(2, args), 120s));
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (losses(dir / "m.jsonl").size() < 3 && std::chrono::steady_clock::now() < deadline) {
    child.try_wait();
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_GE(losses(dir / "m.jsonl").size(), 3u) << "no training progress";
  child.send_signal(SIGINT);
  auto r = child.wait();
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_NE(r.output.find("stopped by a signal after step"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("fsdprun: worker rank"), std::string::npos) << "a rank failed:\n" << r.output;
  ASSERT_TRUE(fs::exists(dir / "ckpt"));
  bool committed = false;
  for (const auto& e : fs::directory_iterator(dir / "ckpt")) committed |= fs::exists(e.path() / "index.json");
  EXPECT_TRUE(committed) << r.output;
}

}  // namespace
