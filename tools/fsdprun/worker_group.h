#pragma once
// The local workers of one attempt: start, forward output, watch, stop.
//
// Each worker runs in its own process group (so stopping it also stops whatever it started) with
// PR_SET_PDEATHSIG=SIGKILL (so a SIGKILLed fsdprun cannot leave it behind). Its stdout and stderr
// are pipes that the poll loop reads; complete lines are written to fsdprun's stdout/stderr with
// a "[rank<R>]: " prefix, in one write() each, so lines of different workers never interleave.
#include <chrono>
#include <optional>
#include <string>
#include <vector>

namespace fsdprun {

class Signals;

struct WorkerSpec {
  int global_rank = 0;
  int local_rank = 0;
  std::string exe;                // resolved path that is executed
  std::vector<std::string> argv;  // argv[0] as the user wrote it
  std::vector<std::string> env;   // complete environment, "KEY=VALUE"
  // Output routing (--log-dir, --redirects, --tee, --local-ranks-filter): a stream goes to the
  // console with the rank prefix when its console flag is set, and, unprefixed, to its log file
  // when a path is given (created, truncated).
  bool console_out = true, console_err = true;
  std::string stdout_log, stderr_log;
};

struct WorkerExit {
  int global_rank = -1;
  int pid = -1;
  int exit_code = -1;  // valid when signal == 0
  int signal = 0;      // the signal that killed it, if any
  std::chrono::steady_clock::time_point when;
  bool ok() const { return signal == 0 && exit_code == 0; }
  std::string describe() const;  // "exit code 3" or "killed by signal 9 (SIGKILL)"
};

// Path that execve() can run: `program` itself when it contains a '/', else the first match in
// PATH. Empty when there is no such executable file.
std::string resolve_executable(const std::string& program);

class WorkerGroup {
 public:
  WorkerGroup() = default;
  WorkerGroup(const WorkerGroup&) = delete;
  WorkerGroup& operator=(const WorkerGroup&) = delete;
  ~WorkerGroup();  // SIGKILLs and reaps whatever stop() did not

  // Starts every worker. A worker whose exec fails exits with code 127 (reported on stderr).
  // Throws std::runtime_error when fork/pipe fail (workers already started are then killed by
  // the destructor).
  void start(const std::vector<WorkerSpec>& specs);

  // Waits up to `timeout` for worker output, a worker exit or a signal; forwards the output and
  // reaps the workers that exited. Returns early on any of these events.
  void poll(std::chrono::milliseconds timeout, Signals& signals);

  bool all_exited() const;
  // The earliest failure observed (a non-zero exit or death by signal), if any.
  const std::optional<WorkerExit>& first_failure() const { return first_failure_; }
  std::vector<int> pids() const;
  // The last lines (at most kTailLines, both streams, prefixed "[rank<R>]: ") a worker wrote,
  // whether or not they reached the console: what fsdprun prints for a failed worker.
  static constexpr size_t kTailLines = 20;
  std::vector<std::string> last_lines(int global_rank) const;

  // Sends `sig` to every worker's process group, waits up to `grace` for the workers to exit
  // (forwarding their output; a further termination signal to fsdprun cuts the wait short), then
  // SIGKILLs the groups. Returns with every worker reaped and its output flushed.
  void stop(int sig, std::chrono::milliseconds grace, Signals& signals);

 private:
  struct Stream {
    int fd = -1;     // read end of the worker's pipe, -1 once closed
    int target = 1;  // fsdprun's fd the lines go to
    bool console = true;
    int file_fd = -1;  // log file, -1 when none
    std::string partial;
  };
  struct Worker {
    WorkerSpec spec;
    int pid = -1;
    bool exited = false;
    WorkerExit exit;
    Stream out, err;
    std::vector<std::string> tail;  // ring of the last kTailLines lines
    size_t tail_next = 0;
  };

  void forward(Worker& w, Stream& s, bool eof);
  bool read_stream(Worker& w, Stream& s);  // false once the stream is closed
  void reap();
  void drain_output(std::chrono::milliseconds limit);
  // One poll over the open output pipes (and `extra_fd` if >= 0); reads what is ready. Returns
  // how many pipes were still open.
  int poll_streams(std::chrono::milliseconds timeout, int extra_fd);
  void kill_groups(int sig);

  std::vector<Worker> workers_;
  std::optional<WorkerExit> first_failure_;
  bool stopped_ = false;
};

}  // namespace fsdprun
