#include "worker_group.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "signals.h"

namespace fsdprun {
namespace {

using Clock = std::chrono::steady_clock;

// A worker printing without newlines must not grow fsdprun's memory without bound.
constexpr size_t kMaxLine = 64 * 1024;

void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = write(fd, data.data() + done, data.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN) {
        pollfd p{fd, POLLOUT, 0};
        poll(&p, 1, 100);
        continue;
      }
      return;  // EPIPE and the like: nobody reads our output any more; keep managing workers
    }
    done += static_cast<size_t>(n);
  }
}

// A worker's log file (--log-dir), created or truncated; -1 (and a note) when it cannot be opened:
// the output still reaches the console and the tail kept for failures.
int open_log(const std::string& path) {
  if (path.empty()) return -1;
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0)
    write_all(STDERR_FILENO, "fsdprun: cannot write the log file " + path + ": " + std::strerror(errno) + "\n");
  return fd;
}

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(path.c_str(), X_OK) == 0;
}

}  // namespace

std::string WorkerExit::describe() const {
  if (signal != 0) return "killed by signal " + std::to_string(signal) + " (" + signal_name(signal) + ")";
  return "exit code " + std::to_string(exit_code);
}

std::string resolve_executable(const std::string& program) {
  if (program.empty()) return {};
  if (program.find('/') != std::string::npos) return is_executable_file(program) ? program : std::string();
  const char* path_env = std::getenv("PATH");
  std::string path = path_env ? path_env : "/usr/local/bin:/usr/bin:/bin";
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    std::string dir = path.substr(start, end - start);
    std::string candidate = (dir.empty() ? std::string(".") : dir) + "/" + program;
    if (is_executable_file(candidate)) return candidate;
    start = end + 1;
  }
  return {};
}

WorkerGroup::~WorkerGroup() {
  if (!stopped_) kill_groups(SIGKILL);
  for (auto& w : workers_) {
    if (!w.exited && w.pid > 0) waitpid(w.pid, nullptr, 0);
    for (Stream* s : {&w.out, &w.err}) {
      if (s->fd >= 0) close(s->fd);
      if (s->file_fd >= 0) close(s->file_fd);
    }
  }
}

void WorkerGroup::start(const std::vector<WorkerSpec>& specs) {
  workers_.reserve(specs.size());
  for (const auto& spec : specs) {
    // Everything the child needs is built here: between fork and exec a multi-threaded process may
    // only make async-signal-safe calls (no allocation).
    std::vector<char*> argv, envp;
    for (const auto& a : spec.argv) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    for (const auto& e : spec.env) envp.push_back(const_cast<char*>(e.c_str()));
    envp.push_back(nullptr);
    int out[2], err[2], status_pipe[2];
    if (pipe2(out, O_CLOEXEC) != 0) throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    if (pipe2(err, O_CLOEXEC) != 0) {
      close(out[0]);
      close(out[1]);
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    }
    if (pipe2(status_pipe, O_CLOEXEC) != 0) {
      for (int fd : {out[0], out[1], err[0], err[1]}) close(fd);
      throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
    }
    const pid_t parent = getpid();
    sigset_t empty;
    sigemptyset(&empty);
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);

    pid_t pid = fork();
    if (pid < 0) {
      int e = errno;
      for (int fd : {out[0], out[1], err[0], err[1], status_pipe[0], status_pipe[1]}) close(fd);
      throw std::runtime_error(std::string("fork: ") + std::strerror(e));
    }
    if (pid == 0) {
      // Child: async-signal-safe calls only.
      setpgid(0, 0);
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(1);  // fsdprun died before prctl took effect
      sigaction(SIGPIPE, &dfl, nullptr);  // fsdprun ignores it; the worker must not inherit that
      sigprocmask(SIG_SETMASK, &empty, nullptr);
      dup2(out[1], STDOUT_FILENO);
      dup2(err[1], STDERR_FILENO);
      // The store's sockets and the other workers' pipes must not leak into the worker.
      if (close_range(3, ~0U, CLOSE_RANGE_CLOEXEC) != 0) {
        for (int fd = 3; fd < 4096; ++fd) {
          if (fd != status_pipe[1]) close(fd);
        }
      }
      execve(spec.exe.c_str(), argv.data(), envp.data());
      int e = errno;
      ssize_t ignored = write(status_pipe[1], &e, sizeof(e));
      (void)ignored;
      _exit(127);
    }
    setpgid(pid, pid);  // also from the parent, so a kill(-pgid) right after start cannot miss
    close(out[1]);
    close(err[1]);
    close(status_pipe[1]);
    int exec_errno = 0;
    ssize_t n;
    do {
      n = read(status_pipe[0], &exec_errno, sizeof(exec_errno));
    } while (n < 0 && errno == EINTR);
    close(status_pipe[0]);
    if (n == static_cast<ssize_t>(sizeof(exec_errno))) {
      write_all(STDERR_FILENO, "fsdprun: cannot execute " + spec.exe + " for rank " + std::to_string(spec.global_rank) +
                                   ": " + std::strerror(exec_errno) + "\n");
    }
    Worker w;
    w.spec = spec;
    w.pid = pid;
    w.out = Stream{out[0], STDOUT_FILENO, spec.console_out, open_log(spec.stdout_log), {}};
    w.err = Stream{err[0], STDERR_FILENO, spec.console_err, open_log(spec.stderr_log), {}};
    for (int fd : {out[0], err[0]}) fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    workers_.push_back(std::move(w));
  }
}

void WorkerGroup::forward(Worker& w, Stream& s, bool eof) {
  const std::string prefix = "[rank" + std::to_string(w.spec.global_rank) + "]: ";
  std::string lines, raw;
  auto keep = [&](std::string line) {  // line without its newline
    if (w.tail.size() < kTailLines) {
      w.tail.push_back(prefix + line);
    } else {
      w.tail[w.tail_next] = prefix + line;
    }
    w.tail_next = (w.tail_next + 1) % kTailLines;
  };
  size_t begin = 0;
  while (true) {
    size_t nl = s.partial.find('\n', begin);
    if (nl == std::string::npos) break;
    lines += prefix;
    lines.append(s.partial, begin, nl + 1 - begin);
    raw.append(s.partial, begin, nl + 1 - begin);
    keep(s.partial.substr(begin, nl - begin));
    begin = nl + 1;
  }
  s.partial.erase(0, begin);
  // At EOF (or when a line gets too long) the rest goes out as a line of its own.
  if (!s.partial.empty() && (eof || s.partial.size() >= kMaxLine)) {
    lines += prefix + s.partial + "\n";
    raw += s.partial + "\n";
    keep(s.partial);
    s.partial.clear();
  }
  if (!lines.empty() && s.console) write_all(s.target, lines);
  if (!raw.empty() && s.file_fd >= 0) write_all(s.file_fd, raw);
}

std::vector<std::string> WorkerGroup::last_lines(int global_rank) const {
  std::vector<std::string> out;
  for (const auto& w : workers_) {
    if (w.spec.global_rank != global_rank) continue;
    const size_t n = w.tail.size();
    const size_t first = n < kTailLines ? 0 : w.tail_next;
    for (size_t i = 0; i < n; ++i) out.push_back(w.tail[(first + i) % n]);
  }
  return out;
}

bool WorkerGroup::read_stream(Worker& w, Stream& s) {
  if (s.fd < 0) return false;
  char buf[16384];
  // Bounded per call, so that a worker flooding its output cannot starve exit and signal checks.
  for (int chunk = 0; chunk < 16; ++chunk) {
    ssize_t n = read(s.fd, buf, sizeof(buf));
    if (n > 0) {
      s.partial.append(buf, static_cast<size_t>(n));
      forward(w, s, false);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return true;
    // EOF (or a read error): flush the last partial line and close.
    forward(w, s, true);
    close(s.fd);
    s.fd = -1;
    return false;
  }
  return true;
}

void WorkerGroup::reap() {
  for (auto& w : workers_) {
    if (w.exited) continue;
    int status = 0;
    pid_t r = waitpid(w.pid, &status, WNOHANG);
    if (r != w.pid) continue;
    w.exited = true;
    w.exit.global_rank = w.spec.global_rank;
    w.exit.pid = w.pid;
    w.exit.when = Clock::now();
    if (WIFEXITED(status)) w.exit.exit_code = WEXITSTATUS(status);
    if (WIFSIGNALED(status)) w.exit.signal = WTERMSIG(status);
    if (!w.exit.ok() && (!first_failure_ || w.exit.when < first_failure_->when)) first_failure_ = w.exit;
  }
}

int WorkerGroup::poll_streams(std::chrono::milliseconds timeout, int extra_fd) {
  std::vector<pollfd> fds;
  std::vector<std::pair<Worker*, Stream*>> owners;
  for (auto& w : workers_) {
    for (Stream* s : {&w.out, &w.err}) {
      if (s->fd < 0) continue;
      fds.push_back(pollfd{s->fd, POLLIN, 0});
      owners.emplace_back(&w, s);
    }
  }
  if (owners.empty() && extra_fd < 0) return 0;
  if (extra_fd >= 0) fds.push_back(pollfd{extra_fd, POLLIN, 0});
  int rc = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long>(0, timeout.count())));
  if (rc > 0) {
    for (size_t i = 0; i < owners.size(); ++i) {
      if (fds[i].revents != 0) read_stream(*owners[i].first, *owners[i].second);
    }
  }
  return static_cast<int>(owners.size());
}

void WorkerGroup::poll(std::chrono::milliseconds timeout, Signals& signals) {
  poll_streams(timeout, signals.fd());
  signals.drain();  // SIGCHLD only wakes us; termination signals are recorded for the caller
  reap();
}

bool WorkerGroup::all_exited() const {
  for (const auto& w : workers_) {
    if (!w.exited) return false;
  }
  return true;
}

std::vector<int> WorkerGroup::pids() const {
  std::vector<int> out;
  for (const auto& w : workers_) out.push_back(w.pid);
  return out;
}

void WorkerGroup::kill_groups(int sig) {
  for (auto& w : workers_) {
    if (w.pid <= 0) continue;
    // The whole group, which also reaches what a worker started (even after the worker exited).
    // A worker that moved itself to another group is still signalled directly.
    if (kill(-w.pid, sig) != 0 && !w.exited) kill(w.pid, sig);
  }
}

void WorkerGroup::drain_output(std::chrono::milliseconds limit) {
  // A process that escaped the group could hold a pipe open forever: bounded.
  const auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (poll_streams(std::chrono::milliseconds(20), /*extra_fd=*/-1) == 0) return;
  }
  for (auto& w : workers_) {
    for (Stream* s : {&w.out, &w.err}) {
      if (s->fd < 0) continue;
      forward(w, *s, true);
      close(s->fd);
      s->fd = -1;
    }
  }
}

void WorkerGroup::stop(int sig, std::chrono::milliseconds grace, Signals& signals) {
  const int signals_before = signals.termination_count();
  kill_groups(sig);
  const auto deadline = Clock::now() + grace;
  while (!all_exited() && Clock::now() < deadline) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    poll(std::min(left, std::chrono::milliseconds(100)), signals);
    if (signals.termination_count() > signals_before) break;  // asked again: no more patience
  }
  if (!all_exited()) {
    write_all(STDERR_FILENO,
              std::string("fsdprun: workers still running after ") +
                  (signals.termination_count() > signals_before ? "a second signal" : "the grace period") +
                  "; sending SIGKILL\n");
  }
  // Also clears whatever the exited workers left behind in their groups.
  kill_groups(SIGKILL);
  const auto reap_deadline = Clock::now() + std::chrono::seconds(10);
  while (!all_exited() && Clock::now() < reap_deadline) poll(std::chrono::milliseconds(20), signals);
  drain_output(std::chrono::milliseconds(1000));
  stopped_ = true;
}

}  // namespace fsdprun
