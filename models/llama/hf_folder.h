#pragma once
// The file-system side of Hugging Face folders (models/llama/hf.cpp's helper, not a public
// header): what a model folder we read may hold, and how an export reaches its destination
// without ever losing what was there (the checkpoint's commit protocol, docs/checkpointing.md):
//
//   ExportFolder out(dest, init_from);          // checks dest, creates a sibling temporary folder
//   ... write config.json and the weights into out.dir() ...
//   auto files = out.commit(dtype_name);        // marker, fsync, rename into place
//   // a throw before commit(): ~ExportFolder removes the temporary folder, dest is untouched
#include <filesystem>
#include <string>
#include <vector>

namespace fsdp::models::detail {

// Throws HFError when `path` exists but is not a regular file (or a symlink to one), naming what
// it is: checked with stat before anything opens it, so a FIFO cannot block open(). Returns
// whether it exists.
bool check_regular_file(const std::filesystem::path& path);

// " (an export interrupted while replacing DIR left ...; ...)" when a sibling of `dir` is an
// export's temporary or backup folder; "" otherwise. For messages about a missing folder or file.
std::string interrupted_export_note(const std::filesystem::path& dir);

// The files copied along from HFSaveOptions::copy_from where present.
const std::vector<std::string>& copied_file_names();

// See hf.h's check_hf_export_dir.
void check_export_destination(const std::string& dest, const std::string& init_from);

// Rank 0's side of one export: a fresh temporary folder next to the destination (same parent, so
// the final rename is atomic), committed into place or removed.
class ExportFolder {
 public:
  ExportFolder(const std::string& dest, const std::string& init_from);
  ~ExportFolder();  // not committed: removes the temporary folder (and only it)
  ExportFolder(const ExportFolder&) = delete;
  ExportFolder& operator=(const ExportFolder&) = delete;

  const std::filesystem::path& dir() const { return tmp_; }
  // A file (or, after export_safetensors, `n` files) complete in dir(): HFExportFaults counts them.
  void file_written(int n = 1);
  // Writes the marker, fsyncs every file and the folder, then puts it in place: renamed to the
  // destination, or swapped with an empty folder or an earlier export, which is then removed.
  // Returns the destination's files. Throws HFError if the destination changed into something
  // that may not be replaced, HFExportError if a step fails.
  std::vector<std::string> commit(const std::string& dtype_name);
  // Removes the temporary folder; the sentence to append to the error that stopped the export.
  std::string abandon();

 private:
  std::string user_dest_;       // as given, for messages
  std::filesystem::path dest_;  // absolute, parent resolved
  std::filesystem::path tmp_;
  std::string id_;
  int files_ = 0;
  bool done_ = false;
};

}  // namespace fsdp::models::detail
