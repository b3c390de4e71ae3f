// train_gpt's checkpoint safety, end to end: a damaged checkpoint stops --resume (its files kept)
// and --resume-from PATH is the way out; one run per --checkpoint-dir (lock); --keep-checkpoints;
// resuming a finished run leaves its metrics alone; an unusable --checkpoint-dir is refused at
// start. Every run is bounded by a timeout.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mount.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "subprocess.h"
#include "train_gpt_harness.h"

namespace {

using namespace train_gpt_test;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

std::vector<std::string> checkpointed(const std::string& metrics, const std::string& ckpt,
                                      const std::vector<std::string>& extra = {}) {
  return apply(tiny(metrics, {"--checkpoint-dir", ckpt, "--checkpoint-every", "2"}), extra);
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// Every file under `dir` with its bytes.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = read_bytes(e.path());
  return files;
}

TEST(TrainGptCheckpoints, HelpDocumentsTheCheckpointOptions) {
  auto r = run_process(spec_of({kTrainGpt, "--help"}, 30s));
  ASSERT_TRUE(r.ok()) << r.output;
  for (const char* opt : {"--resume-from", "--keep-checkpoints"})
    EXPECT_NE(r.output.find(opt), std::string::npos) << opt << " missing from --help:\n" << r.output;
  auto both = run_process(spec_of({kTrainGpt, "--resume", "--resume-from", "x", "--metrics", ""}, 30s));
  EXPECT_EQ(both.exit_code, 2) << both.output;
  EXPECT_NE(both.output.find("excludes"), std::string::npos) << both.output;
}

// The first defect: a damaged index.json (nonsense, `{}`, truncated) used to make --resume
// fall back silently, retrain, and delete the damaged folder's data files when saving over it.
TEST(TrainGptCheckpoints, DamagedIndexStopsResumeAndResumeFromIsTheWayOut) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  auto a = alone(checkpointed(dir / "a.jsonl", ckpt));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto reference = losses(dir / "a.jsonl");
  ASSERT_EQ(reference.size(), 6u);
  const fs::path damaged = fs::path(ckpt) / "step_000006", index = damaged / "index.json";
  const std::string good_index = read_bytes(index);
  const std::string metrics_before = read_bytes(dir / "a.jsonl");
  const std::vector<std::pair<std::string, std::string>> damages = {
      {"nonsense", "no json here"}, {"empty object", "{}"}, {"truncated", good_index.substr(0, good_index.size() / 2)}};
  for (const auto& [what, text] : damages) {
    SCOPED_TRACE(what);
    write_bytes(index, text);
    const auto before = snapshot(damaged);
    auto r = alone(checkpointed(dir / "a.jsonl", ckpt, {"--resume", "--steps", "8"}), 60s);
    EXPECT_NE(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("train_gpt: error: checkpoint " + damaged.string() + " is damaged"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("--resume-from " + ckpt + "/step_000004"), std::string::npos) << r.output;
    EXPECT_FALSE(trained(r.output)) << r.output;
    EXPECT_EQ(snapshot(damaged), before) << "the damaged folder changed";
    EXPECT_EQ(read_bytes(dir / "a.jsonl"), metrics_before) << "the metrics file changed";
  }
  // Every rank of a distributed run stops the same way.
  auto r2 = ranks(2, checkpointed(dir / "a.jsonl", ckpt, {"--resume", "--steps", "8"}), 90s);
  EXPECT_NE(r2.exit_code, 0) << r2.output;
  EXPECT_GE(count(r2.output, "is damaged"), 2u) << r2.output;
  EXPECT_FALSE(r2.timed_out) << r2.output;

  // --resume-from an earlier checkpoint into the same directory would save into the damaged folder
  // at step 6: refused at start, nothing changed.
  const auto before = snapshot(damaged);
  auto into_damaged =
      alone(checkpointed(dir / "b.jsonl", ckpt, {"--resume-from", ckpt + "/step_000004", "--steps", "8"}), 60s);
  EXPECT_NE(into_damaged.exit_code, 0) << into_damaged.output;
  EXPECT_NE(into_damaged.output.find(damaged.string() + " is damaged"), std::string::npos) << into_damaged.output;
  EXPECT_NE(into_damaged.output.find("would save into it at step 6"), std::string::npos) << into_damaged.output;
  EXPECT_FALSE(trained(into_damaged.output)) << into_damaged.output;
  EXPECT_EQ(snapshot(damaged), before);

  // --resume-from step_000004 with the saves going elsewhere continues the same run exactly.
  auto c = alone(checkpointed(dir / "c.jsonl", dir / "other", {"--resume-from", ckpt + "/step_000004"}));
  ASSERT_TRUE(c.ok()) << c.output;
  EXPECT_NE(c.output.find("resumed " + ckpt + "/step_000004 at step 4"), std::string::npos) << c.output;
  const auto resumed = losses(dir / "c.jsonl");
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0], reference[4]);
  EXPECT_EQ(resumed[1], reference[5]);
  // Moving the damaged folder aside is the other way out: --resume then takes step_000004.
  fs::rename(damaged, fs::path(ckpt) / "moved_aside");
  auto d = alone(checkpointed(dir / "d.jsonl", ckpt, {"--resume"}));
  ASSERT_TRUE(d.ok()) << d.output;
  EXPECT_NE(d.output.find("resumed " + ckpt + "/step_000004 at step 4"), std::string::npos) << d.output;
}

// Two runs on one --checkpoint-dir: the second is refused at start on every rank, naming the
// directory and the holder; once the first is SIGKILLed, a new run takes the lock.
TEST(TrainGptCheckpoints, SecondRunOnTheSameCheckpointDirIsRefused) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  Child first(spec_of(
      [&] {
        std::vector<std::string> argv = {kTrainGpt, "--parallel", "none"};
        auto args = checkpointed(dir / "first.jsonl", ckpt, {"--steps", "100000", "--checkpoint-every", "0"});
        argv.insert(argv.end(), args.begin(), args.end());
        return argv;
      }(),
      180s));
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (losses(dir / "first.jsonl").empty() && std::chrono::steady_clock::now() < deadline) {
    ASSERT_FALSE(first.try_wait()) << first.result().output;
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_FALSE(losses(dir / "first.jsonl").empty()) << "the first run made no progress";

  const std::string refusal = "train_gpt: error: --checkpoint-dir " + ckpt + " is in use by another run (pid " +
                              std::to_string(first.pid()) + " on host ";
  const auto t0 = std::chrono::steady_clock::now();
  auto two = ranks(2, checkpointed(dir / "second.jsonl", ckpt, {"--steps", "2"}), 90s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(two.exit_code, 0) << two.output;
  EXPECT_FALSE(two.timed_out) << two.output;
  EXPECT_EQ(count(two.output, refusal), 2u) << "every rank should say it:\n" << two.output;
  EXPECT_FALSE(trained(two.output)) << two.output;
  EXPECT_FALSE(fs::exists(dir / "second.jsonl"));
  EXPECT_LT(seconds, 45.0) << two.output;
  auto one = alone(checkpointed(dir / "third.jsonl", ckpt, {"--steps", "2"}), 60s);
  EXPECT_NE(one.exit_code, 0) << one.output;
  EXPECT_EQ(one.output.rfind(refusal, 0), 0u) << one.output;
  EXPECT_EQ(count(one.output, "\n"), 1u) << one.output;

  first.send_signal(SIGKILL);
  auto killed = first.wait();
  EXPECT_EQ(killed.term_signal, SIGKILL) << killed.output;
  auto after = alone(checkpointed(dir / "after.jsonl", ckpt, {"--steps", "2"}), 60s);
  ASSERT_TRUE(after.ok()) << after.output;
  EXPECT_TRUE(fs::exists(fs::path(ckpt) / "step_000002" / "index.json"));
}

// --keep-checkpoints 2: the two newest committed step folders stay; damaged, uncommitted and
// foreign folders are never removed.
TEST(TrainGptCheckpoints, KeepCheckpointsRemovesOnlyOlderCommittedOnes) {
  TempDir dir;
  const fs::path ckpt = dir / "ckpt";
  fs::create_directories(ckpt / "step_000001");
  write_bytes(ckpt / "step_000001" / "index.json", "{}");  // damaged
  write_bytes(ckpt / "step_000001" / "data-00000000000000aa-rank00000.safetensors", "precious");
  fs::create_directories(ckpt / "step_000003");  // uncommitted
  write_bytes(ckpt / "step_000003" / "data-00000000000000bb-rank00000.safetensors", "partial");
  fs::create_directories(ckpt / "notes");
  write_bytes(ckpt / "notes" / "readme.txt", "mine");
  const auto others = snapshot(ckpt);
  auto r = alone(checkpointed(dir / "m.jsonl", ckpt, {"--steps", "8", "--keep-checkpoints", "2"}));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("checkpoint: removed " + (ckpt / "step_000002").string() + " (--keep-checkpoints 2)"),
            std::string::npos)
      << r.output;
  EXPECT_FALSE(fs::exists(ckpt / "step_000002"));
  EXPECT_FALSE(fs::exists(ckpt / "step_000004"));
  EXPECT_TRUE(fs::exists(ckpt / "step_000006" / "index.json"));
  EXPECT_TRUE(fs::exists(ckpt / "step_000008" / "index.json"));
  for (const auto& [name, bytes] : others) {
    EXPECT_TRUE(fs::exists(ckpt / name)) << name << " was removed";
    EXPECT_EQ(read_bytes(ckpt / name), bytes) << name;
  }
  // Default 0 keeps every checkpoint.
  auto all = alone(checkpointed(dir / "n.jsonl", dir / "all", {"--steps", "8"}));
  ASSERT_TRUE(all.ok()) << all.output;
  for (const char* s : {"step_000002", "step_000004", "step_000006", "step_000008"})
    EXPECT_TRUE(fs::exists(fs::path(dir / "all") / s / "index.json")) << s;
}

// --resume with a checkpoint at or past --steps: one line, exit 0, the metrics file byte-identical.
TEST(TrainGptCheckpoints, ResumePastStepsSaysSoAndLeavesTheMetricsAlone) {
  TempDir dir;
  const std::string ckpt = dir / "ckpt";
  auto a = alone(checkpointed(dir / "m.jsonl", ckpt, {"--steps", "4"}));
  ASSERT_TRUE(a.ok()) << a.output;
  const std::string metrics = read_bytes(dir / "m.jsonl");
  for (const char* steps : {"4", "3"}) {
    auto r = alone(checkpointed(dir / "m.jsonl", ckpt, {"--resume", "--steps", steps}), 60s);
    ASSERT_TRUE(r.ok()) << r.output;
    EXPECT_NE(r.output.find("train_gpt: checkpoint " + ckpt + "/step_000004 is at step 4, --steps " + steps +
                            ": nothing to train (raise --steps to continue it)"),
              std::string::npos)
        << r.output;
    EXPECT_FALSE(trained(r.output)) << r.output;
    EXPECT_EQ(read_bytes(dir / "m.jsonl"), metrics) << "--steps " << steps;
  }
  auto two = ranks(2, checkpointed(dir / "m.jsonl", ckpt, {"--resume", "--steps", "4"}), 90s);
  ASSERT_TRUE(two.ok()) << two.output;
  EXPECT_NE(two.output.find("nothing to train"), std::string::npos) << two.output;
  EXPECT_EQ(read_bytes(dir / "m.jsonl"), metrics);
}

// An unusable --checkpoint-dir stops the run at start with one line and exit status 2 (it used to
// train first and fail at the first save).
TEST(TrainGptCheckpoints, UnusableCheckpointDirIsRefusedAtStart) {
  TempDir dir;
  write_bytes(dir / "a_file", "x");
  struct Case {
    std::string path, problem;
  };
  std::vector<Case> cases = {{dir / "a_file", "exists and is not a directory"},
                             {dir / "a_file/sub", "cannot be created: Not a directory"}};
  // A read-only directory: root ignores permissions, so root mounts a read-only tmpfs instead.
  const std::string ro = dir / "read_only";
  fs::create_directories(ro);
  bool mounted = false;
  if (::geteuid() == 0) {
    mounted = ::mount("tmpfs", ro.c_str(), "tmpfs", MS_RDONLY, "size=64k") == 0;
    if (mounted)
      cases.push_back({ro, "cannot write in it: Read-only file system"});
    else
      std::cout << "[ note ] read-only case skipped: mount failed (" << std::strerror(errno) << ")\n";
  } else {
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
    cases.push_back({ro, "cannot write in it: Permission denied"});
  }
  for (const auto& c : cases) {
    SCOPED_TRACE(c.path);
    const auto t0 = std::chrono::steady_clock::now();
    auto r = alone(checkpointed(dir / "m.jsonl", c.path), 60s);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(r.output.rfind("train_gpt: error: --checkpoint-dir " + c.path + ": " + c.problem, 0), 0u) << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
    EXPECT_FALSE(fs::exists(dir / "m.jsonl")) << "it trained first";
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 30.0);
  }
  // Under fsdprun every rank checks before the group forms.
  auto two = ranks(2, checkpointed(dir / "m.jsonl", dir / "a_file"), 60s);
  EXPECT_NE(two.exit_code, 0) << two.output;
  EXPECT_NE(two.output.find("exists and is not a directory"), std::string::npos) << two.output;
  EXPECT_FALSE(trained(two.output)) << two.output;
  if (mounted)
    ::umount2(ro.c_str(), MNT_DETACH);
  else
    fs::permissions(ro, fs::perms::owner_all);
}

}  // namespace
