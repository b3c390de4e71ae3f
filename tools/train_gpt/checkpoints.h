#pragma once
// train_gpt's checkpoint policy, around fsdp::checkpoint: the checks made before any work (a
// writable --checkpoint-dir, its lock), which checkpoint to resume, and retention.
//
// Example (the order run_training() uses):
//   check_checkpoint_dir(o);                                   // every rank, before the group
//   auto lock = lock_checkpoint_dir(o, rank, world_comm);      // rank 0 decides, every rank obeys
//   ResumeChoice r = choose_resume(o);                         // --resume / --resume-from
//   check_save_targets(o, start_step);                         // no save into a damaged folder
//   ... save ... apply_retention(o, saved_dir);                // rank 0, --keep-checkpoints
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint/lock.h"
#include "options.h"

namespace fsdp::comm {
class Comm;
}

namespace train_gpt {

// Creates --checkpoint-dir and writes and removes a probe file in it, so that a directory that is
// a file, read-only or forbidden stops the run at start rather than at the first save. Throws
// std::invalid_argument (exit status 2) with one line. Nothing to do for --checkpoint-dir ''.
void check_checkpoint_dir(const Options& o);

// --export-hf's destination, checked at start as --checkpoint-dir is (every rank, before the
// group): not the --init-from folder (nor a link to it), not a folder holding anything but an
// earlier export (fsdp::models::kHFExportMarker), not a file or a path under one, a parent this
// process can write in (fsdp::models::check_hf_export_dir). Throws std::invalid_argument (exit
// status 2) with one line. Nothing to do without --export-hf.
void check_export_dir(const Options& o);

// Rank 0 takes the DirectoryLock on --checkpoint-dir for the run's life; its verdict (and the
// holder's record) is broadcast over `world` (null: one process), so every rank of a refused run
// throws the same one-line error before any work. The lock is released when the returned object
// (held on rank 0 only) is destroyed, or by the kernel when the process dies.
fsdp::checkpoint::DirectoryLock lock_checkpoint_dir(const Options& o, int rank, fsdp::comm::Comm* world);

// The checkpoint to continue from: --resume-from PATH (which must be committed), or with --resume
// the latest committed folder of --checkpoint-dir (none: start from scratch). A damaged folder that
// sorts after the chosen one stops the run: the message names it, its problem and the ways out
// (--resume-from an earlier one, or moving it aside). Folders skipped on the way (uncommitted
// saves, damaged older ones) come back as warnings for rank 0 to print.
struct ResumeChoice {
  std::optional<std::string> dir;
  std::vector<std::string> warnings;
};
ResumeChoice choose_resume(const Options& o);

// A save scheduled in (start_step, --steps] that would go into a damaged step_* folder is refused
// now, before training (the library would refuse it at the save, after the work).
void check_save_targets(const Options& o, int64_t start_step);

// Rank 0, after a committed save into `just_written`: keeps the --keep-checkpoints newest committed
// step_NNNNNN folders and removes older committed ones (index.json first, so that a crash half way
// leaves an uncommitted folder, never a damaged one). Never removes `just_written`, a damaged or
// uncommitted folder, or a folder not named step_NNNNNN. Returns the removed paths.
std::vector<std::string> apply_retention(const Options& o, const std::string& just_written);

}  // namespace train_gpt
