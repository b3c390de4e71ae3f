#pragma once
// What the benchmark programs share: the median of repetitions, this process's peak RSS, and
// starting a worker copy of the program with extra environment variables (directly or under
// fsdprun), with the key-value result files the workers write.
#include <spawn.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

extern char** environ;

namespace fsdp_bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// This process's CPU time so far, all threads, in seconds (CLOCK_PROCESS_CPUTIME_ID).
inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Minor page faults of this process so far (getrusage's ru_minflt).
inline uint64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_minflt);
}

// getrusage's ru_maxrss: the peak resident set of this process, in bytes.
inline double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

// Runs args[0] (a path) with this process's environment plus `extra_env` ("NAME=value"); returns
// its exit status (128 + signal when killed, 127 when it could not start).
inline int spawn_and_wait(const std::vector<std::string>& args, const std::vector<std::string>& extra_env) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  for (const auto& kv : extra_env) env_strings.push_back(kv);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()) != 0) return 127;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// This process's resident set now (/proc/self/statm), in bytes.
inline double resident_bytes() {
  std::ifstream in("/proc/self/statm");
  double pages_total = 0, pages_resident = 0;
  in >> pages_total >> pages_resident;
  return pages_resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// The kernel's high-water mark of this process's resident set (VmHWM), in bytes.
inline double vm_hwm_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
  }
  return 0;
}

// A worker's result file: "key value key value ..." on any number of lines.
inline std::map<std::string, double> read_results(const std::string& path) {
  std::ifstream in(path);
  std::map<std::string, double> r;
  std::string line, k;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    double v;
    while (ls >> k >> v) r[k] = v;
  }
  return r;
}

// The driver side of a benchmark whose configurations run as fresh worker copies of the program:
// this program's path, fsdprun next to it, and a temporary folder for the result files.
class WorkerLauncher {
 public:
  // `program` names the benchmark in the one-line errors (exit 2) when this program's path,
  // fsdprun next to it or a temporary folder cannot be had.
  explicit WorkerLauncher(const std::string& program) : program_(program) {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    if (n <= 0) fail("cannot find this program's path");
    buf[n] = '\0';
    self_ = buf;
    fsdprun_ = self_.substr(0, self_.rfind('/')) + "/fsdprun";
    if (access(fsdprun_.c_str(), X_OK) != 0) fail("fsdprun not found next to " + program + ": " + fsdprun_);
    std::string tmpl = "/tmp/fsdp-" + program + "-XXXXXX";
    if (!mkdtemp(tmpl.data())) fail("cannot create a temporary folder");
    dir_ = tmpl;
  }

  const std::string& self() const { return self_; }
  // A new result path in the temporary folder (a worker of rank r writes `path + "." + r` or `path`).
  std::string result_path(const std::string& name) { return dir_ + "/" + name + std::to_string(counter_++); }

  // Runs this program with `args`: directly when `ranks` is 0, else under fsdprun with `ranks`
  // local workers (any free port). Returns the exit status (see spawn_and_wait).
  int run(int ranks, const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {}) const {
    std::vector<std::string> cmd;
    if (ranks > 0) cmd = {fsdprun_, "--nproc-per-node", std::to_string(ranks), "--master-port", "0", "--"};
    cmd.push_back(self_);
    cmd.insert(cmd.end(), args.begin(), args.end());
    return spawn_and_wait(cmd, extra_env);
  }

  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "%s: %s\n", program_.c_str(), why.c_str());
    std::exit(2);
  }

 private:
  std::string program_, self_, fsdprun_, dir_;
  int counter_ = 0;
};

}  // namespace fsdp_bench
