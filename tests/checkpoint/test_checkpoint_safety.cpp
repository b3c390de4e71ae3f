// Checkpoint safety: a damaged index is never skipped silently nor written over, a commit deletes
// only what the replaced index named and leftovers of saves that never committed, a failed save
// (a rank that cannot write, a full disk) removes its own files, and DirectoryLock keeps a second
// holder out until the first one is gone.
#include <gtest/gtest.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/lock.h"
#include "fsdp/debug/fault_injection.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"

using namespace fsdp::testing;
namespace ckpt = fsdp::checkpoint;
namespace fs = std::filesystem;

namespace {

// One [kRows, kCols] float parameter; its values are (step + position), so a load that read
// another save's bytes cannot pass.
constexpr int64_t kRows = 256, kCols = 256;
struct NetImpl : torch::nn::Module {
  at::Tensor w;
  NetImpl() { w = register_parameter("w", at::zeros({kRows, kCols})); }
};
TORCH_MODULE(Net);

at::Tensor values_at(int64_t step) {
  return at::arange(kRows * kCols, at::kFloat).reshape({kRows, kCols}) + static_cast<float>(step);
}

struct Saved {
  Net net;
  ckpt::ScalarState progress;
  ckpt::State state() { return ckpt::State{net.ptr(), nullptr, {{"progress", &progress}}}; }
};

// Saves step `step`'s values into `dir` from this process (no process group, or the mesh's ranks).
void save_step(const std::string& dir, int64_t step, bool shard) {
  Saved s;
  {
    at::NoGradGuard g;
    s.net->w.copy_(values_at(step));
  }
  if (shard) fsdp::fully_shard(s.net);
  s.progress.ints["step"] = step;
  ckpt::save(dir, s.state());
}

// Loads `dir` in this process and returns the step it holds, checking the values.
int64_t load_step(const std::string& dir) {
  Saved s;
  ckpt::load(dir, s.state());
  const int64_t step = s.progress.ints.at("step");
  EXPECT_TRUE(at::equal(s.net->w, values_at(step))) << dir;
  return step;
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_bytes(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

// Every file of a directory (recursively) with its bytes.
std::map<std::string, std::string> snapshot(const fs::path& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = read_bytes(e.path());
  return files;
}

std::set<std::string> names(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// The three damages of the issue: nonsense, an empty object, a truncated index.
std::vector<std::pair<std::string, std::string>> damages(const std::string& index_text) {
  return {{"nonsense", "this is not json \x01\x02"},
          {"empty object", "{}"},
          {"truncated", index_text.substr(0, index_text.size() / 2)}};
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v, name, " is not set");
  return v;
}

}  // namespace

// ---- rank workers ------------------------------------------------------------------------

// Saves step 1, then step 2 into the same directory with one rank's write failing (FAIL_RANK,
// FAIL_AFTER: SaveFaults::fail_after_files); the second save must fail on every rank.
FSDP_RANK_WORKER(save_then_fail) {
  const std::string dir = env("CKPT_DIR");
  save_step(dir, 1, /*shard=*/true);
  ckpt::SaveFaults faults;
  if (fsdp::dist::rank() == std::atoi(env("FAIL_RANK").c_str()))
    faults.fail_after_files = std::atoi(env("FAIL_AFTER").c_str());
  ckpt::ScopedSaveFaults injected(faults);
  expect_error([&] { save_step(dir, 2, /*shard=*/true); }, "nothing was committed");
}

// ---- scan and latest_checkpoint ------------------------------------------------------------

TEST(CheckpointScan, ReportsCommittedUncommittedAndDamagedFolders) {
  TempDir root("ckpt_scan");
  save_step(root / "step_000001", 1, false);
  save_step(root / "step_000002", 2, false);
  write_bytes(fs::path(root / "step_000002") / "index.json", "{}");
  fs::create_directories(root / "step_000003");
  write_bytes(fs::path(root / "step_000003") / "data-0123456789abcdef-rank00000.safetensors", "x");
  fs::create_directories(root / "zz_notes");
  const auto all = ckpt::scan_checkpoints(root.path);
  ASSERT_EQ(all.size(), 4u);
  EXPECT_EQ(all[0].status, ckpt::CheckpointStatus::committed);
  EXPECT_EQ(all[1].status, ckpt::CheckpointStatus::damaged);
  EXPECT_NE(all[1].problem.find("index.json"), std::string::npos) << all[1].problem;
  EXPECT_EQ(all[2].status, ckpt::CheckpointStatus::uncommitted);
  EXPECT_NE(all[2].problem.find("1 data file"), std::string::npos) << all[2].problem;
  EXPECT_EQ(all[3].status, ckpt::CheckpointStatus::uncommitted);
  EXPECT_NE(all[3].problem.find("no checkpoint files"), std::string::npos) << all[3].problem;
  // The uncommitted folders after it are skipped; the damaged one is not.
  const std::string message = error_of([&] { ckpt::latest_checkpoint(root.path); });
  EXPECT_NE(message.find(root / "step_000002"), std::string::npos) << message;
  EXPECT_NE(message.find("damaged"), std::string::npos) << message;
  EXPECT_NE(message.find("move the damaged folder aside"), std::string::npos) << message;
  // Moved aside ("damaged" sorts before "step_"): latest_checkpoint returns the intact one.
  fs::rename(root / "step_000002", root / "damaged_step_000002");
  EXPECT_EQ(ckpt::latest_checkpoint(root.path), root / "step_000001");
}

// Nonsense, `{}` and a truncated index: latest_checkpoint stops naming the folder instead of
// falling back, and the damaged folder's files are byte-identical afterwards.
TEST(CheckpointScan, DamagedIndexIsAnErrorAndItsFilesAreKept) {
  TempDir root("ckpt_damaged");
  save_step(root / "step_000001", 1, false);
  save_step(root / "step_000002", 2, false);
  const fs::path index = fs::path(root / "step_000002") / "index.json";
  for (const auto& [what, text] : damages(read_bytes(index))) {
    SCOPED_TRACE(what);
    const std::string good = read_bytes(index);
    write_bytes(index, text);
    const auto before = snapshot(root / "step_000002");
    const std::string message = error_of([&] { ckpt::latest_checkpoint(root.path); });
    EXPECT_NE(message.find(root / "step_000002"), std::string::npos) << message;
    EXPECT_FALSE(ckpt::is_committed(root / "step_000002"));
    EXPECT_EQ(snapshot(root / "step_000002"), before);
    write_bytes(index, good);
  }
  EXPECT_EQ(ckpt::latest_checkpoint(root.path), root / "step_000002");
  EXPECT_EQ(load_step(root / "step_000002"), 2);
}

// ---- what a save deletes -------------------------------------------------------------------

TEST(CheckpointSaveSafety, SavingOverADamagedIndexIsRefusedAndChangesNothing) {
  TempDir root("ckpt_refuse");
  const std::string dir = root / "step_000002";
  save_step(dir, 2, false);
  const fs::path index = fs::path(dir) / "index.json";
  for (const auto& [what, text] : damages(read_bytes(index))) {
    SCOPED_TRACE(what);
    write_bytes(index, text);
    const auto before = snapshot(dir);
    const std::string message = error_of([&] { save_step(dir, 3, false); });
    EXPECT_NE(message.find("refusing to save into '" + dir + "'"), std::string::npos) << message;
    EXPECT_NE(message.find("Move the folder aside"), std::string::npos) << message;
    EXPECT_EQ(snapshot(dir), before) << "the refused save changed the folder";
  }
}

TEST(CheckpointSaveSafety, CommitDeletesOnlyTheReplacedFilesAndUncommittedLeftovers) {
  TempDir root("ckpt_delete");
  const std::string dir = root / "ckpt";
  save_step(dir, 1, false);
  const auto first = names(dir);
  // Leftovers of a save that never committed here, and files that are not the library's.
  const std::vector<std::string> leftovers = {"data-00000000deadbeef-rank00000.safetensors",
                                              "data-00000000deadbeef-rank00001.safetensors.tmp", "index.json.tmp"};
  const std::vector<std::string> foreign = {"notes.txt", "data-notes.txt",
                                            "data-00000000deadbeef-rank00000.safetensors.bak"};
  for (const auto& n : leftovers) write_bytes(fs::path(dir) / n, "leftover");
  for (const auto& n : foreign) write_bytes(fs::path(dir) / n, "mine");
  save_step(dir, 2, false);
  const auto after = names(dir);
  for (const auto& n : first)
    if (n != "index.json") EXPECT_FALSE(after.count(n)) << n << " (named by the replaced index) was kept";
  for (const auto& n : leftovers) EXPECT_FALSE(after.count(n)) << n << " (uncommitted leftover) was kept";
  for (const auto& n : foreign) {
    EXPECT_TRUE(after.count(n)) << n << " (not the library's) was deleted";
    EXPECT_EQ(read_bytes(fs::path(dir) / n), "mine");
  }
  EXPECT_EQ(load_step(dir), 2);
}

// ---- a failed save cleans up after itself ---------------------------------------------------

TEST(CheckpointSaveSafety, FailedSaveRemovesItsFilesOnEveryRank) {
  TempDir root("ckpt_failed");
  // {rank that fails, fail_after_files}: rank 1's data file fails half way (rank 0's data file is
  // complete and must go); rank 0's index.json.tmp fails half way (both data files must go).
  for (const auto& [rank, after] :
       std::vector<std::pair<std::string, std::string>>{{"1", "0"}, {"0", "0"}, {"0", "1"}}) {
    SCOPED_TRACE("rank " + rank + " fails after " + after + " files");
    const std::string dir = root / ("r" + rank + "_a" + after);
    RanksOptions o;
    o.timeout = std::chrono::seconds(120);
    o.env["CKPT_DIR"] = dir;
    o.env["FAIL_RANK"] = rank;
    o.env["FAIL_AFTER"] = after;
    auto result = run_ranks(2, "save_then_fail", o);
    EXPECT_TRUE(result.all_ok()) << result.report();
    std::set<std::string> files = names(dir);
    ASSERT_EQ(files.size(), 3u) << "left behind: " << ::testing::PrintToString(files);  // index + 2 data files
    EXPECT_EQ(load_step(dir), 1);
  }
}

TEST(CheckpointSaveSafety, FailedSaveInOneProcessLeavesOnlyThePreviousCheckpoint) {
  TempDir root("ckpt_failed1");
  const std::string dir = root / "ckpt";
  save_step(dir, 1, false);
  const auto before = snapshot(dir);
  for (int after : {0, 1}) {
    ckpt::ScopedSaveFaults injected({.fail_after_files = after});
    const std::string message = error_of([&] { save_step(dir, 2, false); });
    EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
    EXPECT_EQ(snapshot(dir), before) << "fail_after_files " << after;
  }
  EXPECT_EQ(load_step(dir), 1);
}

// A real full disk: a tmpfs with room for one checkpoint and a half. The second save runs out of
// space; it must leave exactly the first checkpoint (so the space is free again) and a retry fails
// the same way instead of finding the disk fuller. Needs root (mount); skipped otherwise.
TEST(CheckpointSaveSafety, FullDiskSaveCleansUp) {
  TempDir probe("ckpt_size");
  save_step(probe / "ckpt", 1, false);
  uint64_t bytes = 0;
  for (const auto& e : fs::directory_iterator(probe / "ckpt")) bytes += fs::file_size(e.path());
  TempDir mnt("ckpt_tmpfs");
  const std::string opts = "size=" + std::to_string((bytes * 3 / 2 + 4095) / 4096 * 4096) + ",mode=0700";
  if (::geteuid() != 0 || ::mount("tmpfs", mnt.path.c_str(), "tmpfs", 0, opts.c_str()) != 0)
    GTEST_SKIP() << "mounting a small tmpfs needs root (CAP_SYS_ADMIN): " << std::strerror(errno)
                 << "; the write-failure hook tests cover the cleanup";
  struct Unmount {
    std::string path;
    ~Unmount() { ::umount2(path.c_str(), MNT_DETACH); }
  } unmount{mnt.path};
  auto free_bytes = [&] {
    struct statvfs s {};
    ::statvfs(mnt.path.c_str(), &s);
    return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
  };
  const std::string dir = mnt / "ckpt";
  save_step(dir, 1, false);
  const auto before = snapshot(dir);
  const uint64_t free_before = free_bytes();
  for (int attempt = 0; attempt < 2; ++attempt) {
    const std::string message = error_of([&] { save_step(dir, 2, false); });
    EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
    EXPECT_EQ(snapshot(dir), before) << "attempt " << attempt;
    EXPECT_EQ(free_bytes(), free_before) << "attempt " << attempt;
  }
  EXPECT_EQ(load_step(dir), 1);
}

// ---- DirectoryLock ----------------------------------------------------------------------------

TEST(CheckpointLock, SecondHolderIsRefusedUntilTheFirstIsGone) {
  TempDir root("ckpt_lock");
  const std::string dir = root / "ckpt";
  {
    auto first = ckpt::DirectoryLock::try_acquire(dir);
    ASSERT_TRUE(first.held());
    auto second = ckpt::DirectoryLock::try_acquire(dir);
    EXPECT_FALSE(second.held());
    EXPECT_NE(second.holder().find("pid " + std::to_string(::getpid())), std::string::npos) << second.holder();
  }
  EXPECT_TRUE(ckpt::DirectoryLock::try_acquire(dir).held()) << "not released with its holder";

  // A holder killed with SIGKILL: the kernel releases its lock.
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  if (child == 0) {
    auto held = ckpt::DirectoryLock::try_acquire(dir);
    const char c = held.held() ? '1' : '0';
    (void)!::write(ready[1], &c, 1);
    ::pause();
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, '1');
  auto refused = ckpt::DirectoryLock::try_acquire(dir);
  EXPECT_FALSE(refused.held());
  EXPECT_NE(refused.holder().find("pid " + std::to_string(child)), std::string::npos) << refused.holder();
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  EXPECT_TRUE(ckpt::DirectoryLock::try_acquire(dir).held()) << "a killed holder's lock was not released";
}
