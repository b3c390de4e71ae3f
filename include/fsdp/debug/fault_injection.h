// layer: checkpoint
#pragma once
// Failures injected into this process's checkpoint saves, for tests of crash safety: a save killed
// half way, or one that runs out of disk, must leave the last good checkpoint loadable and nothing
// of its own behind (tests/checkpoint/test_checkpoint_safety.cpp). Never set in training.
//
// Example:
//   fsdp::checkpoint::ScopedSaveFaults faults({.fail_after_files = 0});  // this rank's data file fails
//   // fsdp::checkpoint::save(dir, state) now throws "No space left on device" and commits nothing
namespace fsdp::checkpoint {

struct SaveFaults {
  // The process aborts (std::abort) after writing this many of its data files (-1: never).
  int abort_after_files = -1;
  // This rank's writes fail as on a full disk (ENOSPC) after this many complete files (-1: never).
  // 0: its data file's temporary is half written, then the write fails; 1: its data file is
  // complete, then (rank 0 only) index.json.tmp is half written and the write fails.
  int fail_after_files = -1;
};

// The faults every later save of this process (sync or async) injects, until set again.
void set_save_faults(const SaveFaults& faults);
SaveFaults save_faults();

// Sets the faults for a scope and restores the previous ones at its end.
class ScopedSaveFaults {
 public:
  explicit ScopedSaveFaults(const SaveFaults& faults) : previous_(save_faults()) { set_save_faults(faults); }
  ~ScopedSaveFaults() { set_save_faults(previous_); }
  ScopedSaveFaults(const ScopedSaveFaults&) = delete;
  ScopedSaveFaults& operator=(const ScopedSaveFaults&) = delete;

 private:
  SaveFaults previous_;
};

}  // namespace fsdp::checkpoint
