// train_gpt refuses bad input before any work and honours stop signals in every phase:
// the memory preflight and size bounds, --data that is no regular file, non-finite numbers, the
// configuration fingerprint across ranks, whole error messages, and SIGTERM while a large model
// is being built. Every run is bounded by a timeout; "within seconds" is measured.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <c10/util/Exception.h>

#include "error_text.h"
#include "subprocess.h"
#include "train_gpt_harness.h"

namespace {

using namespace train_gpt_test;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// train_gpt alone (--parallel none) on `args`, nothing written; the result and its duration.
struct Timed {
  ProcessResult r;
  double seconds;
};
Timed timed(ProcessSpec spec) {
  const auto t0 = Clock::now();
  ProcessResult r = run_process(spec);
  return {r, seconds_since(t0)};
}
ProcessSpec alone_spec(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 60s) {
  std::vector<std::string> argv = {kTrainGpt, "--parallel", "none"};
  const auto all = apply({"--checkpoint-dir", "", "--metrics", ""}, args);
  argv.insert(argv.end(), all.begin(), all.end());
  return spec_of(argv, timeout);
}

// Exit status 2 and exactly one line starting with `prefix`.
void expect_one_line_error(const Timed& t, const std::string& prefix, const std::string& what) {
  EXPECT_FALSE(t.r.timed_out) << what << ": timed out\n" << t.r.output;
  EXPECT_EQ(t.r.exit_code, 2) << what << "\n" << t.r.output;
  EXPECT_EQ(t.r.output.rfind(prefix, 0), 0u) << what << "\nexpected: " << prefix << "\ngot: " << t.r.output;
  EXPECT_EQ(count(t.r.output, "\n"), 1u) << what << "\n" << t.r.output;
}

// Sizes beyond the bounds exit 2 at once; sizes within them that cannot fit the memory are
// refused by the estimate within seconds, naming the option(s) and the estimate vs the available.
TEST(TrainGptInput, SizesThatCannotFitAreRefusedWithTheEstimate) {
  auto t = timed(alone_spec({"--data", "synthetic", "--layers", "99999999999"}));
  expect_one_line_error(t, "train_gpt: error: --layers: must be at most 10000, not '99999999999'", "--layers bound");
  t = timed(alone_spec({"--data", "synthetic", "--dim", "123456789012345678901234567890"}));
  expect_one_line_error(t, "train_gpt: error: --dim: must be at most 65536, not '", "--dim bound");

  struct Case {
    std::vector<std::string> args;
    std::string prefix;  // the named option(s)
  };
  const std::vector<Case> cases = {
      {{"--layers", "5000", "--dim", "8192", "--heads", "8"}, "train_gpt: error: --layers 5000 --dim 8192 ("},
      {{"--layers", "1", "--dim", "65536", "--heads", "1"}, "train_gpt: error: --layers 1 --dim 65536 ("},
      {{"--seq-len", "65536", "--batch-size", "1048576"}, "train_gpt: error: --batch-size 1048576 --seq-len 65536 ("},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {"--data", "synthetic"};
    args.insert(args.end(), c.args.begin(), c.args.end());
    t = timed(alone_spec(args));
    expect_one_line_error(t, c.prefix, c.prefix);
    EXPECT_LT(t.seconds, 15.0) << t.r.output;
    EXPECT_TRUE(std::regex_search(t.r.output, std::regex(R"(need about [0-9.]+ [KMGTPE]iB per rank \(parameters)")))
        << t.r.output;
    EXPECT_NE(t.r.output.find("available per rank (MemAvailable"), std::string::npos) << t.r.output;
  }

  // The override makes an ordinary model too big for the memory "available"; per rank, so 2
  // ranks on one host get half each.
  auto spec = alone_spec(tiny("", {"--layers", "4", "--dim", "128", "--heads", "4"}));
  spec.env_set["FSDP_TEST_MEMORY_AVAILABLE"] = "64M";
  t = timed(spec);
  expect_one_line_error(t, "train_gpt: error: --layers 4 --dim 128 (", "override");
  EXPECT_NE(t.r.output.find("more than the 64 MiB available per rank (FSDP_TEST_MEMORY_AVAILABLE 64 MiB)"),
            std::string::npos)
      << t.r.output;
  spec.env_set["FSDP_TEST_MEMORY_AVAILABLE"] = "16G";
  t = timed(spec);
  EXPECT_TRUE(t.r.ok()) << t.r.output;
  EXPECT_NE(t.r.output.find("train_gpt: memory: about "), std::string::npos) << t.r.output;

  auto two = spec_of(fsdprun_argv(2, tiny("")), 60s);
  two.env_set["FSDP_TEST_MEMORY_AVAILABLE"] = "400M";  // 200 MiB per rank: less than the runtime alone
  t = timed(two);
  EXPECT_NE(t.r.exit_code, 0) << t.r.output;
  EXPECT_NE(t.r.output.find("available per rank (FSDP_TEST_MEMORY_AVAILABLE 400 MiB / 2 ranks on this host)"),
            std::string::npos)
      << t.r.output;
  EXPECT_EQ(t.r.output.find("[rank0]: step "), std::string::npos) << t.r.output;
}

// A directory, endless devices and a FIFO are refused by their file type, within seconds, with one
// line naming the path; nothing is read (a virtual-memory limit guards against an unbounded read).
TEST(TrainGptInput, DataThatIsNotARegularFileIsRefused) {
  TempDir dir;
  const std::string fifo = dir / "pipe";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir.path, "it is a directory"},
      {"/dev/zero", "it is a character device"},
      {"/dev/urandom", "it is a character device"},
      {fifo, "it is a FIFO (named pipe)"},
  };
  for (const auto& [path, why] : cases) {
    auto spec = alone_spec(tiny("", {"--data", path}), 30s);
    // 8 GiB of address space at most: reading /dev/zero whole would otherwise take the machine.
    spec.argv.insert(spec.argv.begin(), {"/bin/sh", "-c", "ulimit -v 8388608 && exec \"$0\" \"$@\""});
    auto t = timed(spec);
    expect_one_line_error(t, "train_gpt: error: cannot read data file '" + path + "': " + why + ", not a regular file",
                          path);
    EXPECT_LT(t.seconds, 15.0) << path;
  }
}

// Non-finite and out-of-range numbers exit 2 with the readable range (no 300-digit numbers).
TEST(TrainGptInput, NonFiniteNumbersExitTwoWithReadableRanges) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--lr", "nan"}, "--lr: must be a finite number in (0, 100], not 'nan'"},
      {{"--lr", "inf"}, "--lr: must be a finite number in (0, 100], not 'inf'"},
      {{"--lr", "0"}, "--lr: must be a number > 0, not '0'"},
      {{"--lr", "1e300"}, "--lr: must be at most 100, not '1e300'"},
      {{"--weight-decay", "inf"}, "--weight-decay: must be a finite number in [0, 100], not 'inf'"},
      {{"--weight-decay", "-0.5"}, "--weight-decay: must be a number >= 0, not '-0.5'"},
      {{"--clip", "nan"}, "--clip: must be a finite number in [0, 1000000000], not 'nan'"},
      {{"--clip", "inf"}, "--clip: must be a finite number in [0, 1000000000], not 'inf'"},
      {{"--warmup", "1.5"}, "--warmup: must be a whole number in [0, 1000000000000], not '1.5'"},
      {{"--steps", "1e3"}, "--steps: must be a whole number in [1, 1000000000000], not '1e3'"},
      {{"--seq-len", "99999999999999999999999"}, "--seq-len: must be at most 1048576, not '99999999999999999999999'"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> all = {"--data", "synthetic"};
    all.insert(all.end(), args.begin(), args.end());
    auto t = timed(alone_spec(all, 30s));
    expect_one_line_error(t, "train_gpt: error: " + message, args[0] + " " + args[1]);
    EXPECT_FALSE(std::regex_search(t.r.output, std::regex("[0-9]{20,}[^0-9']"))) << "an unreadable number:\n"
                                                                                 << t.r.output;
  }
}

// Ranks started with different --seed (a wrapper script appends --seed $RANK) fail before step 1,
// every rank, within seconds, naming --seed and the values per rank.
TEST(TrainGptInput, RanksWithDifferentOptionsFailBeforeTheFirstStep) {
  TempDir dir;
  std::vector<std::string> argv = {kFsdprun,
                                   "--nproc-per-node",
                                   "2",
                                   "--master-port",
                                   "0",
                                   "--",
                                   "/bin/sh",
                                   "-c",
                                   "exec \"$0\" \"$@\" --seed \"$RANK\"",
                                   kTrainGpt};
  const auto args = tiny(dir / "m.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  auto t = timed(spec_of(argv, 120s));
  EXPECT_FALSE(t.r.timed_out) << t.r.output;
  EXPECT_NE(t.r.exit_code, 0) << t.r.output;
  const std::string msg =
      "train_gpt: error: the ranks were started with different options: --seed is '0' on rank 0 and '1' on rank 1";
  EXPECT_NE(t.r.output.find("[rank0]: " + msg), std::string::npos) << t.r.output;
  EXPECT_NE(t.r.output.find("[rank1]: " + msg), std::string::npos) << t.r.output;
  EXPECT_EQ(t.r.output.find("[rank0]: step "), std::string::npos) << "trained before failing:\n" << t.r.output;
  EXPECT_TRUE(losses(dir / "m.jsonl").empty());
  EXPECT_LT(t.seconds, 45.0) << t.r.output;  // the alternative: a 5-minute collective timeout
}

// The pid of the worker with RANK=`rank` among the processes whose parent is `parent`.
int worker_pid(int parent, int rank) {
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(e.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    std::ifstream env(e.path() / "environ");
    std::string var;
    while (std::getline(env, var, '\0')) {
      if (var == "RANK=" + std::to_string(rank)) return std::stoi(name);
    }
  }
  return -1;
}

// A real multi-line error reaches the user whole: rank 1 is stopped (SIGSTOP) mid-training, rank 0's
// collective times out, and its message's hint naming FSDP_COLLECTIVE_TIMEOUT_S (on a later line)
// is printed, without LibTorch's C++ backtrace.
TEST(TrainGptInput, WholeErrorMessageIsPrinted) {
  TempDir dir;
  auto spec = spec_of(fsdprun_argv(2, tiny(dir / "m.jsonl", {"--steps", "100000"}), {"--grace-period-s", "2"}), 120s);
  spec.env_set["FSDP_COLLECTIVE_TIMEOUT_S"] = "10";
  Child child(spec);
  const auto deadline = Clock::now() + 60s;
  while (losses(dir / "m.jsonl").size() < 2 && Clock::now() < deadline && !child.try_wait())
    std::this_thread::sleep_for(100ms);
  ASSERT_GE(losses(dir / "m.jsonl").size(), 2u) << "no training progress\n" << child.result().output;
  const int rank1 = worker_pid(child.pid(), 1);
  ASSERT_GT(rank1, 0) << "rank 1's process not found";
  ASSERT_EQ(kill(rank1, SIGSTOP), 0);
  auto r = child.wait();
  if (fsdp::testing::process_alive(rank1)) kill(rank1, SIGKILL);  // its own process group
  EXPECT_FALSE(r.timed_out) << r.output;
  const auto err = r.output.find("[rank0]: train_gpt: error: ");
  ASSERT_NE(err, std::string::npos) << r.output;
  const std::string tail = r.output.substr(err);
  EXPECT_NE(tail.find("FSDP_COLLECTIVE_TIMEOUT_S"), std::string::npos) << "the hint was cut off:\n" << r.output;
  EXPECT_GE(count(tail.substr(0, tail.find("FSDP_COLLECTIVE_TIMEOUT_S")), "\n"), 1u) << "not a multi-line message:\n"
                                                                                     << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("frame #"), std::string::npos) << r.output;
}

// The text printed for an error keeps every line of the message and drops LibTorch's backtrace,
// also where a c10::Error's what() is wrapped in another exception's message.
TEST(TrainGptInput, ErrorTextKeepsHintsAndDropsBacktraces) {
  try {
    TORCH_CHECK(false, "first line\n  the hint on a second line");
  } catch (const c10::Error& e) {
    EXPECT_EQ(train_gpt::error_text(e), "first line\n  the hint on a second line");
    const std::runtime_error wrapped(std::string("collective failed: ") + e.what() +
                                     "\n  If it timed out, see FSDP_COLLECTIVE_TIMEOUT_S.");
    const std::string text = train_gpt::error_text(wrapped);
    EXPECT_EQ(text.rfind("collective failed: first line\n  the hint on a second line\n", 0), 0u) << text;
    EXPECT_NE(text.find("\n  If it timed out, see FSDP_COLLECTIVE_TIMEOUT_S."), std::string::npos) << text;
    EXPECT_EQ(text.find("Exception raised from"), std::string::npos) << text;
    EXPECT_EQ(text.find("frame #"), std::string::npos) << text;
  }
  EXPECT_EQ(train_gpt::strip_backtrace("a\nException raised from f at x.cpp:1 (most recent call first):\nframe #0: g\n"
                                       "frame #1: h\n\n  hint\n"),
            "a\n  hint");
}

// SIGTERM to fsdprun while its ranks build a large model ends the job within seconds, not after
// the launcher's grace period. On 2 ranks of the 2-core development machine, 3000 blocks of dim 16
// took 3 s to the memory line (meta construction), 8 s more to shard, materialise and initialise
// and 23 s for the first step, in little memory; 5000 blocks leave a wide margin.
TEST(TrainGptInput, SigtermDuringModelConstructionExitsWithinSeconds) {
  TempDir dir;
  const auto args = tiny(dir / "m.jsonl", {"--layers", "5000", "--dim", "16", "--heads", "4"});
  Child child(spec_of(fsdprun_argv(2, args, {"--grace-period-s", "60"}), 120s));
  const auto deadline = Clock::now() + 60s;
  while (child.result().output.find("train_gpt: memory:") == std::string::npos && Clock::now() < deadline &&
         !child.try_wait()) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_NE(child.result().output.find("train_gpt: memory:"), std::string::npos) << child.result().output;
  std::this_thread::sleep_for(1s);  // into fully_shard / to_empty / initialisation
  child.try_wait();
  ASSERT_EQ(child.result().output.find("train_gpt: GPT "), std::string::npos)
      << "the model was already built: make it larger\n"
      << child.result().output;
  const auto t0 = Clock::now();
  child.send_signal(SIGTERM);
  auto r = child.wait();
  const double s = seconds_since(t0);
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_LT(s, 10.0) << r.output;
  EXPECT_NE(r.output.find("SIGTERM before the first step finished: nothing to save, exiting now"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("[rank0]: step "), std::string::npos) << r.output;
}

// SIGINT during a long validation stops it at the next batch on every rank (the ranks agree, the
// collectives stay matched), saves the step's checkpoint and exits 0 within seconds.
TEST(TrainGptInput, SigintDuringValidationSavesAndExits) {
  TempDir dir;
  const auto args = tiny(dir / "m.jsonl", {"--steps", "3", "--eval-every", "1", "--eval-batches", "1000000",
                                           "--checkpoint-dir", dir / "ckpt", "--checkpoint-every", "0"});
  Child child(spec_of(fsdprun_argv(2, args), 120s));
  const auto deadline = Clock::now() + 60s;
  while (child.result().output.find("train_gpt: checkpoints ->") == std::string::npos && Clock::now() < deadline &&
         !child.try_wait()) {
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_NE(child.result().output.find("train_gpt: checkpoints ->"), std::string::npos) << child.result().output;
  std::this_thread::sleep_for(3s);  // step 1 takes milliseconds; its validation, minutes
  child.try_wait();
  ASSERT_TRUE(losses(dir / "m.jsonl").empty()) << "validation already over";
  const auto t0 = Clock::now();
  child.send_signal(SIGINT);
  auto r = child.wait();
  EXPECT_LT(seconds_since(t0), 10.0) << r.output;
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.output.find("fsdprun: worker rank"), std::string::npos) << "a rank failed:\n" << r.output;
  EXPECT_NE(r.output.find("stopped by a signal after step 1/3"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(fs::path(dir / "ckpt") / "step_000001" / "index.json")) << r.output;
  const auto lines = read_metrics(dir / "m.jsonl");
  ASSERT_FALSE(lines.empty()) << r.output;
  EXPECT_FALSE(lines[0].contains("val_loss")) << "the validation was not interrupted: " << lines[0].dump();
}

}  // namespace
