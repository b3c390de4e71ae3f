// DirectoryLock: flock on <root>/.fsdp-checkpoint.lock. See include/fsdp/checkpoint/lock.h.
#include "fsdp/checkpoint/lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>

#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::checkpoint {

namespace fs = std::filesystem;

namespace {

std::string read_record(int fd) {
  std::string text;
  char buf[512];
  ssize_t n;
  off_t at = 0;
  while (text.size() < 4096 && (n = ::pread(fd, buf, sizeof buf, at)) > 0) {
    text.append(buf, static_cast<size_t>(n));
    at += n;
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  for (auto& c : text)
    if (c == '\n' || c == '\r') c = ' ';  // the record goes into a one-line message
  return text;
}

std::string holder_record() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");
  char when[64] = {};
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return "pid " + std::to_string(::getpid()) + " on host " + host + " since " + when + "\n";
}

}  // namespace

DirectoryLock DirectoryLock::try_acquire(const std::string& root) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec && !fs::is_directory(root))
    throw CheckpointError("checkpoint: cannot create the checkpoint directory '" + root + "': " + ec.message());
  DirectoryLock lock;
  lock.path_ = (fs::path(root) / kFileName).string();
  const int fd = ::open(lock.path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw CheckpointError("checkpoint: cannot create the lock file '" + lock.path_ + "': " + std::strerror(errno));
  int rc;
  do rc = ::flock(fd, LOCK_EX | LOCK_NB);
  while (rc != 0 && errno == EINTR);
  if (rc != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      lock.holder_ = read_record(fd);
      ::close(fd);
      return lock;
    }
    ::close(fd);
    throw CheckpointError("checkpoint: cannot lock '" + lock.path_ + "': " + std::strerror(err));
  }
  // Ours: replace the record (a dead holder's may still be there).
  const std::string record = holder_record();
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, record.data(), record.size(), 0) != static_cast<ssize_t>(record.size())) {
    const int err = errno;
    ::close(fd);
    throw CheckpointError("checkpoint: cannot write the lock file '" + lock.path_ + "': " + std::strerror(err));
  }
  lock.fd_ = fd;
  return lock;
}

DirectoryLock::DirectoryLock(DirectoryLock&& other) noexcept
    : fd_(other.fd_), path_(std::move(other.path_)), holder_(std::move(other.holder_)) {
  other.fd_ = -1;
}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = other.fd_;
    path_ = std::move(other.path_);
    holder_ = std::move(other.holder_);
    other.fd_ = -1;
  }
  return *this;
}

DirectoryLock::~DirectoryLock() { release(); }

void DirectoryLock::release() {
  if (fd_ < 0) return;
  // The record stays (it is only text); closing the descriptor drops the lock.
  ::close(fd_);
  fd_ = -1;
}

}  // namespace fsdp::checkpoint
