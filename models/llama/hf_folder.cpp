// Hugging Face folders on disk: see hf_folder.h. An export follows the checkpoint's commit
// protocol (docs/checkpointing.md): everything is written into a fresh sibling folder, fsynced,
// and only then renamed into place; nothing it did not write is ever deleted.
#include "models/llama/hf_folder.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "fsdp/detail/checkpoint_files.h"
#include "models/llama/hf.h"

namespace fsdp::models {

namespace {
std::mutex& faults_mutex() {
  static std::mutex m;
  return m;
}
HFExportFaults& faults_slot() {
  static HFExportFaults faults;
  return faults;
}
}  // namespace

void set_hf_export_faults(const HFExportFaults& faults) {
  std::lock_guard<std::mutex> lock(faults_mutex());
  faults_slot() = faults;
}

HFExportFaults hf_export_faults() {
  std::lock_guard<std::mutex> lock(faults_mutex());
  return faults_slot();
}

void check_hf_export_dir(const std::string& dir, const std::string& init_from) {
  detail::check_export_destination(dir, init_from);
}

namespace detail {

namespace fs = std::filesystem;

namespace {

const char* kTmpTag = ".fsdp-export-tmp-";
const char* kOldTag = ".fsdp-export-old-";

std::string kind_of(fs::file_type type) {
  switch (type) {
    case fs::file_type::directory: return "a folder";
    case fs::file_type::fifo: return "a FIFO (named pipe)";
    case fs::file_type::socket: return "a socket";
    case fs::file_type::block: return "a block device";
    case fs::file_type::character: return "a character device";
    default: return "not a regular file";
  }
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A name an export writes (model-00001-of-00003.safetensors, config.json, ...).
bool export_file_name(const std::string& name) {
  if (name == kHFExportMarker || name == "config.json" || name == "model.safetensors" ||
      name == "model.safetensors.index.json")
    return true;
  for (const auto& copied : copied_file_names())
    if (name == copied) return true;
  return name.rfind("model-", 0) == 0 && ends_with(name, ".safetensors");
}

std::string random_id() {
  std::random_device rd;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%08x%08x", rd(), rd());
  return buf;
}

// What a destination holds.
struct Contents {
  enum Kind { absent, empty, earlier_export, foreign, symlink, not_folder } kind = absent;
  std::string example;  // foreign: a name no export writes (or "" when only the marker lacks)
  size_t entries = 0, foreign_entries = 0;
};

Contents contents_of(const fs::path& dir) {
  Contents c;
  std::error_code ec;
  const auto st = fs::symlink_status(dir, ec);
  if (ec || !fs::exists(st)) return c;
  if (fs::is_symlink(st)) return {Contents::symlink};
  if (!fs::is_directory(st)) return {Contents::not_folder};
  bool marker = false;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    ++c.entries;
    if (name == kHFExportMarker) marker = true;
    const bool regular = fs::is_regular_file(entry.symlink_status());
    if (regular && export_file_name(name)) continue;
    if (c.example.empty()) c.example = name;
    ++c.foreign_entries;
  }
  c.kind =
      c.entries == 0 ? Contents::empty : (marker && c.example.empty() ? Contents::earlier_export : Contents::foreign);
  return c;
}

// The destination as an absolute path whose parent is resolved (symlinks included), so that the
// temporary folder is a true sibling and comparisons with --init-from see through links.
fs::path resolve(const std::string& dir) {
  if (dir.empty()) throw HFError("the export folder is '': give a folder to write the Hugging Face files into");
  fs::path p = fs::absolute(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  if (p == p.root_path() || p.filename() == "..")
    throw HFError(dir + ": not a folder an export can be renamed onto; give a folder below it");
  std::error_code ec;
  const fs::path parent = fs::weakly_canonical(p.parent_path(), ec);
  return (ec ? p.parent_path() : parent) / p.filename();
}

bool same_folder(const fs::path& a, const std::string& b) {
  if (b.empty()) return false;
  std::error_code ec;
  if (fs::equivalent(a, b, ec) && !ec) return true;
  std::error_code ea, eb;
  const auto ca = fs::weakly_canonical(a, ea), cb = fs::weakly_canonical(b, eb);
  return !ea && !eb && ca == cb;
}

// One line for a destination whose contents may not be replaced; "" when it may.
std::string refusal(const std::string& user, const fs::path& dest, const std::string& init_from) {
  if (same_folder(dest, init_from))
    return user + ": is the --init-from folder " + init_from +
           " (an export would overwrite the pretrained files); give another folder";
  const Contents c = contents_of(dest);
  std::error_code ec;
  switch (c.kind) {
    case Contents::symlink:
      return user + ": is a symbolic link (to " + fs::read_symlink(dest, ec).string() +
             "); give a folder path, not a link (an export is renamed into place)";
    case Contents::not_folder: return user + ": exists and is not a folder; give a new or empty folder";
    case Contents::foreign:
      if (c.example.empty())
        return user + ": holds a Hugging Face folder that is not an export of ours (no " + kHFExportMarker +
               "), which an export would destroy; give a new or empty folder, or move its files away";
      return user + ": holds files an export does not write ('" + c.example + "'" +
             (c.foreign_entries > 1 ? " and " + std::to_string(c.foreign_entries - 1) + " more" : "") +
             "), which it would destroy; give a new or empty folder, or move them away";
    default: return "";
  }
}

// The first existing ancestor of `p` (p itself included).
fs::path existing_ancestor(fs::path p) {
  std::error_code ec;
  while (!p.empty() && !fs::exists(fs::symlink_status(p, ec)) && p != p.root_path()) p = p.parent_path();
  return p;
}

// Creates the parent folders and probes that a folder can be made in the parent.
void check_parent(const std::string& user, const fs::path& dest) {
  const fs::path parent = dest.parent_path();
  const fs::path base = existing_ancestor(parent);
  std::error_code ec;
  if (!base.empty() && !fs::is_directory(base, ec))
    throw HFError(user + ": lies under " + base.string() + ", which is not a folder; give a folder path");
  fs::create_directories(parent, ec);
  if (ec) throw HFError(user + ": its parent folder " + parent.string() + " cannot be created: " + ec.message());
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const fs::path probe = parent / ("." + dest.filename().string() + ".fsdp-export-probe-" + host + "-" +
                                   std::to_string(::getpid()) + "-" + random_id());
  if (::mkdir(probe.c_str(), 0755) != 0)
    throw HFError(user + ": cannot write in its parent folder " + parent.string() + ": " + std::strerror(errno) +
                  "; give a writable folder");
  ::rmdir(probe.c_str());
  if (fs::is_directory(dest, ec) && ::access(dest.c_str(), W_OK) != 0)
    throw HFError(user + ": is read-only (" + std::strerror(errno) +
                  "), so an earlier export in it cannot be replaced; give a writable folder");
}

// The checkpoint layer's helper (its commit protocol), as an HFExportError.
void fsync_path(const fs::path& path, bool directory) {
  if (auto why = fsdp::checkpoint::detail::fsync_path(path, directory)) throw HFExportError(*why);
}

void write_synced(const fs::path& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) throw HFExportError("cannot write " + path.string() + ": " + std::strerror(errno));
  size_t done = 0;
  int err = 0;
  while (done < text.size() && err == 0) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) err = n < 0 ? errno : ENOSPC;
    done += n > 0 ? static_cast<size_t>(n) : 0;
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) throw HFExportError("cannot write " + path.string() + ": " + std::strerror(err));
}

// An earlier export's files (only names an export writes), then its folder if that left it empty.
void remove_export(const fs::path& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (export_file_name(name) && fs::is_regular_file(entry.symlink_status())) fs::remove(entry.path(), ec);
  }
  fs::remove(dir, ec);  // rmdir: fails, leaving it, if anything else appeared there
}

}  // namespace

const std::vector<std::string>& copied_file_names() {
  static const std::vector<std::string> names = {"generation_config.json", "tokenizer.model", "tokenizer.json",
                                                 "tokenizer_config.json", "special_tokens_map.json"};
  return names;
}

bool check_regular_file(const fs::path& path) {
  std::error_code ec;
  const auto st = fs::status(path, ec);  // follows symlinks; never opens the file
  if (!fs::exists(st)) return false;
  if (!fs::is_regular_file(st))
    throw HFError(path.string() + ": is " + kind_of(st.type()) +
                  ", not a regular file; a model folder holds regular files (or symlinks to them): replace it");
  return true;
}

std::string interrupted_export_note(const fs::path& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  const std::string name = "." + p.filename().string();
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(p.parent_path(), ec)) {
    const std::string other = entry.path().filename().string();
    const bool old = other.rfind(name + kOldTag, 0) == 0, tmp = other.rfind(name + kTmpTag, 0) == 0;
    if (!old && !tmp) continue;
    return std::string(" (an export to ") + p.string() + " was interrupted: " + entry.path().string() + " holds " +
           (old ? "the export it was replacing" : "an export it was writing or replacing") + "; rename it to " +
           p.string() + " if that is missing, or remove it)";
  }
  return "";
}

void check_export_destination(const std::string& dest, const std::string& init_from) {
  const fs::path path = resolve(dest);
  const std::string why = refusal(dest, path, init_from);
  if (!why.empty()) throw HFError(why);
  check_parent(dest, path);
  if (init_from.empty()) return;
  for (const auto& name : copied_file_names()) check_regular_file(fs::path(init_from) / name);
}

ExportFolder::ExportFolder(const std::string& dest, const std::string& init_from)
    : user_dest_(dest), dest_(resolve(dest)), id_(random_id()) {
  check_export_destination(dest, init_from);
  tmp_ = dest_.parent_path() / ("." + dest_.filename().string() + kTmpTag + id_);
  if (::mkdir(tmp_.c_str(), 0755) != 0)
    throw HFExportError(user_dest_ + ": cannot create the export's temporary folder " + tmp_.string() + ": " +
                        std::strerror(errno));
}

ExportFolder::~ExportFolder() {
  if (!done_) abandon();
}

void ExportFolder::file_written(int n) {
  const HFExportFaults faults = hf_export_faults();
  files_ += n;
  if (faults.abort_after_files >= 0 && files_ >= faults.abort_after_files) std::abort();
  const int limit = faults.fail_after_files;
  if (limit >= 0 && files_ >= limit)
    throw HFExportError("cannot write " + tmp_.string() + ": " + std::strerror(ENOSPC) +
                        " (HFExportFaults::fail_after_files, injected by a test)");
}

std::string ExportFolder::abandon() {
  if (done_) return "";
  done_ = true;
  std::error_code ec;
  fs::remove_all(tmp_, ec);  // ours alone: created by mkdir under a fresh random name
  const std::string left = fs::exists(dest_, ec) ? user_dest_ + " is as it was" : "nothing is at " + user_dest_;
  if (fs::exists(tmp_, ec)) return "; its temporary folder " + tmp_.string() + " could not be removed; " + left;
  return "; removed its temporary folder " + tmp_.string() + ", " + left;
}

std::vector<std::string> ExportFolder::commit(const std::string& dtype_name) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(tmp_)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  const nlohmann::json marker = {{"format", "fsdp-hf-export"}, {"version", 1}, {"dtype", dtype_name}, {"files", names}};
  write_synced(tmp_ / kHFExportMarker, marker.dump() + "\n");
  for (const auto& name : names) fsync_path(tmp_ / name, false);
  fsync_path(tmp_, true);
  // The destination again, just before replacing it: it may have changed since the start.
  const std::string why = refusal(user_dest_, dest_, "");
  if (!why.empty()) throw HFError(why);
  const bool replace = contents_of(dest_).kind != Contents::absent;
  std::error_code ec;
  if (!replace) {
    fs::rename(tmp_, dest_, ec);
    if (ec) throw HFExportError("cannot rename " + tmp_.string() + " to " + user_dest_ + ": " + ec.message());
  } else if (!hf_export_faults().no_rename_exchange &&
             ::renameat2(AT_FDCWD, tmp_.c_str(), AT_FDCWD, dest_.c_str(), RENAME_EXCHANGE) == 0) {
    // Swapped atomically: the destination is the new export, tmp_ the old one (removed below).
    // A crash now leaves the new export in place and the old one under the temporary name.
    done_ = true;
    remove_export(tmp_);
  } else {
    // No RENAME_EXCHANGE on this file system: the old folder goes to a backup name first. A crash
    // between the two renames leaves no destination, the old export at the backup name and the
    // new one complete at the temporary name (interrupted_export_note names them in messages);
    // a crash after them leaves the backup, which the next export does not touch.
    const fs::path old = dest_.parent_path() / ("." + dest_.filename().string() + kOldTag + id_);
    fs::rename(dest_, old, ec);
    if (ec) throw HFExportError("cannot rename " + user_dest_ + " aside to replace it: " + ec.message());
    fs::rename(tmp_, dest_, ec);
    if (ec) {
      std::error_code back;
      fs::rename(old, dest_, back);
      throw HFExportError("cannot rename " + tmp_.string() + " to " + user_dest_ + ": " + ec.message());
    }
    done_ = true;
    remove_export(old);
  }
  done_ = true;
  fsync_path(dest_.parent_path(), true);
  std::vector<std::string> written;
  for (const auto& name : names) written.push_back((fs::path(user_dest_) / name).string());
  return written;
}

}  // namespace detail

}  // namespace fsdp::models
