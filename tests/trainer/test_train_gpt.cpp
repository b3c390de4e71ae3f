// train_gpt end to end: the real trainer, alone (--parallel none) and under the real fsdprun,
// on tiny models so that each run takes seconds. Every run is bounded by a timeout.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "subprocess.h"

namespace {

using namespace std::chrono_literals;
using fsdp::testing::Child;
using fsdp::testing::ProcessResult;
using fsdp::testing::ProcessSpec;
using fsdp::testing::run_process;
namespace fs = std::filesystem;

const std::string kFsdprun = FSDPRUN_PATH;
const std::string kTrainGpt = TRAIN_GPT_PATH;

const std::vector<std::string> kScrub = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                         "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE",
                                         "FSDP_TEST_KILL_AT_STEP", "FSDP_TEST_KILL_RANK"};

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "train_gpt_test_XXXXXX").string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return (fs::path(path) / name).string(); }
};

// A tiny model on synthetic data: a run of a few steps takes about a second.
std::vector<std::string> tiny(const std::string& metrics, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> a = {"--data",      "synthetic", "--layers",   "2",  "--dim",           "32",
                                "--heads",     "2",         "--seq-len",  "16", "--batch-size",    "8",
                                "--steps",     "6",         "--warmup",   "2",  "--eval-every",    "0",
                                "--sample-tokens", "0",     "--checkpoint-dir", "", "--metrics",   metrics};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

ProcessSpec spec_of(std::vector<std::string> argv, std::chrono::milliseconds timeout) {
  ProcessSpec spec;
  spec.argv = std::move(argv);
  spec.env_unset = kScrub;
  spec.env_set["OMP_NUM_THREADS"] = "1";  // same threads in every mode: same float results
  spec.env_set["FSDP_NO_REEXEC"] = "1";
  spec.timeout = timeout;
  return spec;
}

ProcessResult alone(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 120s) {
  std::vector<std::string> argv = {kTrainGpt, "--parallel", "none"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(spec_of(argv, timeout));
}

std::vector<std::string> fsdprun_argv(int n, const std::vector<std::string>& args, const std::vector<std::string>& launcher = {}) {
  std::vector<std::string> argv = {kFsdprun, "--nproc-per-node", std::to_string(n), "--master-port", "0"};
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  argv.push_back("--");
  argv.push_back(kTrainGpt);
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

ProcessResult ranks(int n, const std::vector<std::string>& args, std::chrono::milliseconds timeout = 120s) {
  return run_process(spec_of(fsdprun_argv(n, args), timeout));
}

std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

std::vector<double> losses(const std::string& path) {
  std::vector<double> out;
  for (const auto& j : read_metrics(path)) {
    if (j.contains("loss") && !j.value("summary", false)) out.push_back(j["loss"].get<double>());
  }
  return out;
}

void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::abs(a[i] - b[i]), rel * std::abs(b[i])) << "step " << i + 1 << ": " << a[i] << " vs " << b[i];
  }
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(TrainGpt, HelpDocumentsEveryOption) {
  auto r = run_process(spec_of({kTrainGpt, "--help"}, 30s));
  ASSERT_TRUE(r.ok()) << r.output;
  for (const char* opt : {"--data", "--layers", "--dim", "--heads", "--seq-len", "--batch-size", "--grad-accum", "--steps",
                          "--lr", "--warmup", "--weight-decay", "--clip", "--seed", "--parallel", "--shard-size",
                          "--mixed-precision", "--reshard-after-forward", "--checkpoint-dir", "--checkpoint-every",
                          "--resume", "--eval-every", "--sample-tokens", "--metrics"}) {
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
      {{"--parallel", "hsdp"}, "train_gpt: error: --parallel hsdp needs HSDP (2-D mesh fully_shard), not available in this build"},
      {{"--parallel", "replicate"}, "train_gpt: error: --parallel replicate needs fsdp::replicate, not available in this build"},
      {{"--parallel", "bogus"}, "train_gpt: error: --parallel: bogus not in {fsdp,hsdp,replicate,none}"},
      {{"--steps", "0"}, "train_gpt: error: --steps: Value 0 not in range"},
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
  EXPECT_EQ(r.output.find("step "), std::string::npos) << "trained before failing:\n" << r.output;
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
                            "grad_bytes", "optim_bytes", "peak_rss_bytes", "max_peak_rss_bytes"}) {
      EXPECT_TRUE(j.contains(key)) << key << " missing: " << j.dump();
    }
    EXPECT_GT(j["comm_bytes"].get<int64_t>(), 0);
    EXPECT_GE(j["max_peak_rss_bytes"].get<int64_t>(), j["peak_rss_bytes"].get<int64_t>());
    EXPECT_EQ(j.contains("val_loss"), s == 2 || s == 5) << j.dump();
  }
  EXPECT_TRUE(lines[6]["summary"].get<bool>());
  EXPECT_GT(lines[6]["median_step_time_s"].get<double>(), 0.0);
  EXPECT_NE(r.output.find("[rank0]: ---- sample"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("[rank0]: step     6/6"), std::string::npos) << r.output;
}

TEST(TrainGpt, Bf16MixedPrecisionTrains) {
  TempDir dir;
  auto r = ranks(2, tiny(dir / "m.jsonl", {"--mixed-precision", "bf16", "--steps", "10"}));
  ASSERT_TRUE(r.ok()) << r.output;
  auto l = losses(dir / "m.jsonl");
  ASSERT_EQ(l.size(), 10u);
  EXPECT_LT(l.back(), l.front() * 0.95);
}

}  // namespace
