#pragma once
// An advisory lock on a checkpoint root: one training run writes a checkpoint directory at a time.
//
// Example:
//   auto lock = fsdp::checkpoint::DirectoryLock::try_acquire("runs/ckpt");   // rank 0, at start
//   if (!lock.held()) fail("runs/ckpt is in use by " + lock.holder());
//
// flock(2) on <root>/.fsdp-checkpoint.lock, held while the object lives (the descriptor is
// close-on-exec). The kernel releases it when the process exits or dies, SIGKILL included, so a
// restart after a crash takes it again. The file records the holder ("pid 123 on host node1 since
// 2026-11-30 16:40:02 UTC") for the refused run's message; a stale record left by a dead holder
// is only text, never a lock. Advisory: it keeps out only processes that take it too. On NFS,
// Linux maps flock to POSIX byte-range locks, which the server arbitrates across hosts.
#include <string>

namespace fsdp::checkpoint {

class DirectoryLock {
 public:
  static constexpr const char* kFileName = ".fsdp-checkpoint.lock";

  // Creates `root` when needed. Returns a held lock, or (another process holds it) one that is not
  // held, with the holder's record. Throws CheckpointError when the lock file cannot be created or
  // locked for another reason (permissions, a filesystem without locks).
  static DirectoryLock try_acquire(const std::string& root);

  DirectoryLock() = default;
  DirectoryLock(DirectoryLock&& other) noexcept;
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  ~DirectoryLock();  // releases the lock

  bool held() const { return fd_ >= 0; }
  // When not held: who holds it, as recorded in the lock file ("" when the record is empty).
  const std::string& holder() const { return holder_; }
  const std::string& path() const { return path_; }  // the lock file
  void release();

 private:
  int fd_ = -1;
  std::string path_;
  std::string holder_;
};

}  // namespace fsdp::checkpoint
