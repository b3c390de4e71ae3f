#pragma once
// Start child processes with a hard timeout, for tests that run real processes.
// A hang must fail the test, never block CI: on timeout the whole process group is killed.
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace fsdp::testing {

struct ProcessResult {
  int exit_code = -1;      // valid when exited
  int term_signal = 0;     // non-zero when killed by a signal
  bool timed_out = false;  // we killed it after the timeout
  std::string output;      // stdout and stderr, interleaved
  bool ok() const { return !timed_out && term_signal == 0 && exit_code == 0; }
};

struct ProcessSpec {
  std::vector<std::string> argv;               // argv[0] is the program path
  std::map<std::string, std::string> env_set;  // added to (or overriding) the inherited environment
  std::vector<std::string> env_unset;          // removed from the inherited environment
  std::chrono::milliseconds timeout{60000};
};

// A started child (own process group, so the whole tree can be killed).
class Child {
 public:
  explicit Child(const ProcessSpec& spec);
  Child(Child&&) noexcept;
  Child& operator=(Child&&) = delete;
  Child(const Child&) = delete;
  ~Child();  // kills the group if still running
  int pid() const { return pid_; }
  void send_signal(int sig);  // to the child's process group
  // Waits until exit or the spec's timeout (measured from start), collecting output.
  ProcessResult wait();
  // Non-blocking: collects available output; true once the child has exited (or timed out and
  // was killed), with `result()` final.
  bool try_wait();
  const ProcessResult& result() const { return result_; }

 private:
  int pid_ = -1;
  int out_fd_ = -1;
  std::chrono::steady_clock::time_point deadline_;
  bool reaped_ = false;
  bool eof_ = false;
  ProcessResult result_;
  void read_available(int timeout_ms);
  void finalize(int status);
};

ProcessResult run_process(const ProcessSpec& spec);

// Path of the running executable (/proc/self/exe resolved).
std::string self_exe();

// Returns a TCP port that was free a moment ago on 127.0.0.1 (bind to port 0, read, close).
int pick_free_port();

// True when a process with this pid still exists (and is not a zombie).
bool process_alive(int pid);

}  // namespace fsdp::testing
