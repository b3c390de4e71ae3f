#pragma once
// What the train_gpt end-to-end suites share: the trainer and launcher paths, a tiny model's
// arguments, running alone or under fsdprun with a timeout, reading the metrics file, and
// comparing two checkpoints' tensors.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/safetensors.h"
#include "subprocess.h"
#include "test_helpers.h"

namespace train_gpt_test {

namespace fs = std::filesystem;

using namespace std::chrono_literals;
using fsdp::testing::Child;
using fsdp::testing::ProcessResult;
using fsdp::testing::ProcessSpec;
using fsdp::testing::run_process;

inline const std::string kFsdprun = FSDPRUN_PATH;
inline const std::string kTrainGpt = TRAIN_GPT_PATH;

inline const std::vector<std::string> kScrub = {"RANK",
                                                "WORLD_SIZE",
                                                "LOCAL_RANK",
                                                "LOCAL_WORLD_SIZE",
                                                "MASTER_ADDR",
                                                "MASTER_PORT",
                                                "TORCHELASTIC_RESTART_COUNT",
                                                "TORCHELASTIC_USE_AGENT_STORE",
                                                "FSDP_TEST_KILL_AT_STEP",
                                                "FSDP_TEST_KILL_RANK"};

// A fresh directory removed at scope exit (tests/support/test_helpers.h).
struct TempDir : fsdp::testing::TempDir {
  TempDir() : fsdp::testing::TempDir("train_gpt_test") {}
};

// `name value` replaced or appended (options may be given once only); "--resume" appended.
inline std::vector<std::string> apply(std::vector<std::string> args, const std::vector<std::string>& extra);
inline std::vector<std::string> set_arg(std::vector<std::string> args, const std::string& name,
                                        const std::string& value) {
  for (size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == name) {
      args[i + 1] = value;
      return args;
    }
  }
  args.push_back(name);
  args.push_back(value);
  return args;
}

inline std::vector<std::string> apply(std::vector<std::string> args, const std::vector<std::string>& extra) {
  for (size_t i = 0; i < extra.size(); ++i) {
    if (extra[i] == "--resume") {
      args.push_back("--resume");
    } else {
      args = set_arg(args, extra[i], extra.at(i + 1));
      ++i;
    }
  }
  return args;
}

// A tiny model on synthetic data: a run of a few steps takes about a second.
inline std::vector<std::string> tiny(const std::string& metrics, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> a = {"--data",          "synthetic", "--layers",         "2",  "--dim",        "32",
                                "--heads",         "2",         "--seq-len",        "16", "--batch-size", "8",
                                "--steps",         "6",         "--warmup",         "2",  "--eval-every", "0",
                                "--sample-tokens", "0",         "--checkpoint-dir", "",   "--metrics",    metrics};
  return apply(a, extra);
}

inline ProcessSpec spec_of(std::vector<std::string> argv, std::chrono::milliseconds timeout) {
  ProcessSpec spec;
  spec.argv = std::move(argv);
  spec.env_unset = kScrub;
  // Built whole, not `env_set["K"] = "v"`: GCC 12 at -O3 warns a false -Wstringop-overflow on that
  // assignment once inlined (GCC bug 105651).
  spec.env_set = {
      {"OMP_NUM_THREADS", "1"},       // same threads in every mode: same float results
      {"CUDA_VISIBLE_DEVICES", ""}};  // CPU runs even on a GPU machine (--device auto; tests/gpu covers GPUs)
  spec.timeout = timeout;
  return spec;
}

inline ProcessResult alone(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 120s) {
  std::vector<std::string> argv = {kTrainGpt, "--parallel", "none"};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_process(spec_of(argv, timeout));
}

inline std::vector<std::string> fsdprun_argv(int n, const std::vector<std::string>& args,
                                             const std::vector<std::string>& launcher = {}) {
  std::vector<std::string> argv = {kFsdprun, "--nproc-per-node", std::to_string(n), "--master-port", "0"};
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  argv.push_back("--");
  argv.push_back(kTrainGpt);
  argv.insert(argv.end(), args.begin(), args.end());
  return argv;
}

inline ProcessResult ranks(int n, const std::vector<std::string>& args, std::chrono::milliseconds timeout = 120s) {
  return run_process(spec_of(fsdprun_argv(n, args), timeout));
}

inline std::vector<nlohmann::json> read_metrics(const std::string& path) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

inline std::vector<double> losses(const std::string& path) {
  std::vector<double> out;
  for (const auto& j : read_metrics(path)) {
    if (j.contains("loss") && !j.value("summary", false)) out.push_back(j["loss"].get<double>());
  }
  return out;
}

inline void expect_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE(std::abs(a[i] - b[i]), rel * std::abs(b[i])) << "step " << i + 1 << ": " << a[i] << " vs " << b[i];
  }
}

// True when the output holds a progress line ("step N/M ..."), alone or under fsdprun's
// "[rankK]: " prefix; other lines that mention a step (e.g. the stop-signal notice) do not count.
inline bool trained(const std::string& output) {
  static const std::regex progress(R"((^|\n)(\[rank[0-9]+\]: )?step +[0-9]+/[0-9]+)");
  return std::regex_search(output, progress);
}

inline size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// A checkpoint's data files by writing rank ("data-<save id>-rankNNNNN.safetensors"; the save id
// differs between runs).
inline std::map<std::string, std::string> data_files(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    const auto r = name.rfind("-rank");
    if (e.path().extension() == ".safetensors" && r != std::string::npos) out[name.substr(r)] = e.path().string();
  }
  return out;
}

// Every tensor of every data file of two checkpoints, bit for bit.
inline void expect_same_checkpoint_tensors(const std::string& a, const std::string& b) {
  const auto fa = data_files(a), fb = data_files(b);
  ASSERT_FALSE(fa.empty()) << "no data files in " << a;
  ASSERT_EQ(fa.size(), fb.size());
  for (const auto& [rank, path] : fa) {
    ASSERT_TRUE(fb.count(rank)) << rank << " missing in " << b;
    fsdp::safetensors::Reader ra(path), rb(fb.at(rank));
    ASSERT_EQ(ra.header().tensors.size(), rb.header().tensors.size()) << path;
    for (const auto& t : ra.header().tensors) {
      auto x = ra.read(t.name), y = rb.read(t.name);
      EXPECT_TRUE(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() && x.equal(y))
          << t.name << " differs (" << rank << ")";
    }
  }
}

#ifdef FSDP_HF_FIXTURES
// A Hugging Face folder of tests/models/fixtures (suites that define FSDP_HF_FIXTURES).
inline std::string fixture(const std::string& name) { return std::string(FSDP_HF_FIXTURES) + "/" + name; }

// A Llama from a folder: no sizing options (--init-from refuses them), `steps` steps, no
// evaluation, sample or checkpoint; `extra` replaces or adds options (apply).
inline std::vector<std::string> from_folder(const std::string& dir, const std::string& metrics,
                                            const std::vector<std::string>& extra = {}, int steps = 2) {
  std::vector<std::string> a = {"--init-from",      dir,
                                "--data",           "synthetic",
                                "--seq-len",        "16",
                                "--batch-size",     "8",
                                "--steps",          std::to_string(steps),
                                "--warmup",         "1",
                                "--eval-every",     "0",
                                "--sample-tokens",  "0",
                                "--checkpoint-dir", "",
                                "--metrics",        metrics};
  return apply(a, extra);
}
#endif

}  // namespace train_gpt_test
