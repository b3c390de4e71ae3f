// train_gpt's checkpoint policy: see checkpoints.h.
#include "checkpoints.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/comm/comm.h"
#include "models/llama/hf.h"

namespace train_gpt {

namespace fs = std::filesystem;
namespace ckpt = fsdp::checkpoint;

namespace {

// The step of a folder named step_NNNNNN (digits only), if it is one.
std::optional<int64_t> step_of(const std::string& path) {
  const std::string name = fs::path(path).filename().string();
  const std::string prefix = "step_";
  if (name.size() <= prefix.size() || name.size() > prefix.size() + 18 || name.compare(0, prefix.size(), prefix) != 0)
    return std::nullopt;
  for (size_t i = prefix.size(); i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
  return std::stoll(name.substr(prefix.size()));
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "host";
  return host;
}

// Rank 0's message (empty: all is well) to every rank, as int64 character codes.
std::string broadcast_text(fsdp::comm::Comm& world, int rank, const std::string& text) {
  constexpr int64_t kMax = 1024;
  at::Tensor buf = at::zeros({kMax + 1}, at::kLong);
  if (rank == 0) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(text.size()), kMax);
    buf[0] = n;
    auto* p = buf.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) p[i + 1] = static_cast<unsigned char>(text[i]);
  }
  world.broadcast(buf, 0);
  const auto* p = buf.data_ptr<int64_t>();
  std::string out;
  for (int64_t i = 0; i < p[0]; ++i) out.push_back(static_cast<char>(p[i + 1]));
  return out;
}

}  // namespace

void check_checkpoint_dir(const Options& o) {
  if (o.checkpoint_dir.empty()) return;
  const std::string& dir = o.checkpoint_dir;
  auto fail = [&](const std::string& why) {
    throw std::invalid_argument("--checkpoint-dir " + dir + ": " + why +
                                " (give a writable directory, or --checkpoint-dir '' for no checkpoints)");
  };
  std::error_code ec;
  fs::create_directories(dir, ec);
  std::error_code is_dir_ec;
  if (!fs::is_directory(dir, is_dir_ec)) {
    fail(fs::exists(dir, is_dir_ec) ? "exists and is not a directory" : "cannot be created: " + ec.message());
  }
  // Every rank probes with a name of its own (ranks may share the directory).
  const fs::path probe = fs::path(dir) / (".write-probe-" + host_name() + "-" + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(std::string("cannot write in it: ") + std::strerror(errno));
  const bool wrote = ::write(fd, "x", 1) == 1;
  const int err = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!wrote) fail(std::string("cannot write in it: ") + std::strerror(err));
}

void check_export_dir(const Options& o) {
  if (o.export_hf.empty()) return;
  try {
    fsdp::models::check_hf_export_dir(o.export_hf, o.init_from);
  } catch (const fsdp::models::HFError& e) {
    throw std::invalid_argument(std::string("--export-hf ") + e.what());
  }
}

ckpt::DirectoryLock lock_checkpoint_dir(const Options& o, int rank, fsdp::comm::Comm* world) {
  ckpt::DirectoryLock lock;
  if (o.checkpoint_dir.empty()) return lock;
  std::string error;
  if (rank == 0) {
    try {
      lock = ckpt::DirectoryLock::try_acquire(o.checkpoint_dir);
      if (!lock.held()) {
        error = "--checkpoint-dir " + o.checkpoint_dir + " is in use by another run (" +
                (lock.holder().empty() ? std::string("holder unknown") : lock.holder()) + "; lock file " + lock.path() +
                "): wait for it to end, or give this run another --checkpoint-dir";
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  if (world != nullptr) error = broadcast_text(*world, rank, error);
  if (!error.empty()) throw std::runtime_error(error);
  return lock;
}

ResumeChoice choose_resume(const Options& o) {
  ResumeChoice choice;
  if (!o.resume_from.empty()) {
    try {
      ckpt::describe(o.resume_from);  // reads its index: committed and readable
    } catch (const std::exception& e) {
      throw std::invalid_argument("--resume-from " + o.resume_from + ": " + e.what());
    }
    choice.dir = o.resume_from;
    return choice;
  }
  if (!o.resume) return choice;
  const auto all = ckpt::scan_checkpoints(o.checkpoint_dir);
  size_t chosen = all.size();
  for (size_t i = all.size(); i-- > 0;) {
    const auto& c = all[i];
    if (c.status == ckpt::CheckpointStatus::committed) {
      chosen = i;
      break;
    }
    if (c.status == ckpt::CheckpointStatus::damaged) {
      std::string earlier;
      for (size_t j = i; j-- > 0;) {
        if (all[j].status == ckpt::CheckpointStatus::committed) {
          earlier = all[j].path;
          break;
        }
      }
      throw ckpt::CheckpointError("checkpoint " + c.path + " is damaged: " + c.problem +
                                  "; its data files are kept. Resume from a named "
                                  "checkpoint with --resume-from PATH" +
                                  (earlier.empty() ? "" : " (e.g. --resume-from " + earlier + ")") + ", or move " +
                                  c.path + " aside");
    }
    if (c.problem.rfind("no index.json and no checkpoint files", 0) != 0)
      choice.warnings.push_back("skipping " + c.path + ": " + c.problem);
  }
  if (chosen == all.size()) return choice;
  choice.dir = all[chosen].path;
  for (size_t j = 0; j < chosen; ++j) {
    if (all[j].status == ckpt::CheckpointStatus::damaged)
      choice.warnings.push_back("older checkpoint " + all[j].path + " is damaged (" + all[j].problem +
                                "); left as it is");
  }
  return choice;
}

void check_save_targets(const Options& o, int64_t start_step) {
  if (o.checkpoint_dir.empty()) return;
  for (const auto& c : ckpt::scan_checkpoints(o.checkpoint_dir)) {
    if (c.status != ckpt::CheckpointStatus::damaged) continue;
    const auto step = step_of(c.path);
    if (!step || *step <= start_step || *step > o.steps) continue;
    const bool scheduled = *step == o.steps || (o.checkpoint_every > 0 && *step % o.checkpoint_every == 0);
    if (!scheduled) continue;
    throw ckpt::CheckpointError("checkpoint " + c.path + " is damaged (" + c.problem +
                                ") and this run would save into it at step " + std::to_string(*step) +
                                ": move it aside first (its data files are kept), or use another "
                                "--checkpoint-dir");
  }
}

std::vector<std::string> apply_retention(const Options& o, const std::string& just_written) {
  std::vector<std::string> removed;
  if (o.keep_checkpoints <= 0 || o.checkpoint_dir.empty()) return removed;
  const std::string written_name = fs::path(just_written).filename().string();
  std::vector<std::pair<int64_t, std::string>> committed;  // every committed step_* folder, this one too
  for (const auto& c : ckpt::scan_checkpoints(o.checkpoint_dir)) {
    const auto step = step_of(c.path);
    if (step && c.status == ckpt::CheckpointStatus::committed) committed.emplace_back(*step, c.path);
  }
  std::sort(committed.begin(), committed.end());
  const int64_t excess = static_cast<int64_t>(committed.size()) - o.keep_checkpoints;
  for (int64_t i = 0; i < excess; ++i) {
    const std::string& path = committed[static_cast<size_t>(i)].second;
    if (fs::path(path).filename().string() == written_name) continue;
    std::error_code ec;
    fs::remove(fs::path(path) / "index.json", ec);  // un-commit first: a crash half way leaves it uncommitted
    if (ec) continue;
    fs::remove_all(path, ec);
    removed.push_back(path);
  }
  return removed;
}

}  // namespace train_gpt
