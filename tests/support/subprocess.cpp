#include "subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>

extern char** environ;

namespace fsdp::testing {

Child::Child(const ProcessSpec& spec) {
  if (spec.argv.empty()) throw std::invalid_argument("ProcessSpec.argv is empty");
  // Build the environment before fork (no allocation between fork and exec).
  std::map<std::string, std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (const auto& k : spec.env_unset) env.erase(k);
  for (const auto& [k, v] : spec.env_set) env[k] = v;
  std::vector<std::string> env_strings;
  for (const auto& [k, v] : env) env_strings.push_back(k + "=" + v);
  std::vector<char*> envp, argv;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> args = spec.argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
  deadline_ = std::chrono::steady_clock::now() + spec.timeout;
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    setpgid(0, 0);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  setpgid(pid_, pid_);  // also from the parent, to avoid the race with kill below
  close(fds[1]);
  out_fd_ = fds[0];
}

Child::Child(Child&& o) noexcept : pid_(o.pid_), out_fd_(o.out_fd_), deadline_(o.deadline_), reaped_(o.reaped_) {
  o.pid_ = -1;
  o.out_fd_ = -1;
  o.reaped_ = true;
}

Child::~Child() {
  if (pid_ > 0 && !reaped_) {
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (out_fd_ >= 0) close(out_fd_);
}

void Child::send_signal(int sig) {
  if (pid_ > 0 && !reaped_) kill(-pid_, sig);
}

void Child::read_available(int timeout_ms) {
  if (eof_) return;
  char buf[4096];
  pollfd p{out_fd_, POLLIN, 0};
  if (poll(&p, 1, timeout_ms) <= 0) return;
  ssize_t n = read(out_fd_, buf, sizeof(buf));
  if (n > 0)
    result_.output.append(buf, static_cast<size_t>(n));
  else if (n == 0)
    eof_ = true;
}

void Child::finalize(int status) {
  reaped_ = true;
  // Drain what is left in the pipe (grandchildren may still hold it open: bounded).
  auto drain_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(500);
  while (!eof_ && std::chrono::steady_clock::now() < drain_until) read_available(50);
  // Anything left in the child's group (orphaned grandchildren) is killed: tests never leak.
  kill(-pid_, SIGKILL);
  if (WIFEXITED(status)) result_.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result_.term_signal = WTERMSIG(status);
}

bool Child::try_wait() {
  if (reaped_) return true;
  read_available(0);
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) {
    finalize(status);
    return true;
  }
  if (std::chrono::steady_clock::now() >= deadline_) {
    result_.timed_out = true;
    kill(-pid_, SIGKILL);
    waitpid(pid_, &status, 0);
    finalize(status);
    return true;
  }
  return false;
}

ProcessResult Child::wait() {
  while (!try_wait()) read_available(20);
  return result_;
}

ProcessResult run_process(const ProcessSpec& spec) {
  Child c(spec);
  return c.wait();
}

std::string self_exe() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("cannot resolve /proc/self/exe");
  buf[n] = '\0';
  return buf;
}

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    throw std::runtime_error("pick_free_port: bind failed");
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  int port = ntohs(addr.sin_port);
  close(fd);
  return port;
}

bool process_alive(int pid) {
  if (kill(pid, 0) != 0) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content;
  std::getline(stat, content);
  auto close_paren = content.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= content.size()) return false;
  return content[close_paren + 2] != 'Z';
}

}  // namespace fsdp::testing
