// A worker program for the fsdprun tests; the first argument picks what it does.
//   env                     print the launcher's variables (NAME=value lines)
//   echo ARGS...            print each argument as arg=<value>
//   output                  a line on stdout, a line on stderr, then a partial line on stdout
//   exit R CODE DIR [ignore-term]
//                           every rank prints pid=<pid> and starts a grandchild (child_pid=<pid>);
//                           once all ranks got that far, rank R exits with CODE; the others sleep
//                           60 s (ignoring SIGTERM with ignore-term)
//   fail-once CODE DIR      prints attempt=<restart count>; on attempt 0 the last rank exits with
//                           CODE once all ranks printed, the others sleep; later attempts exit 0
//   always-fail CODE DIR    prints attempt=<restart count>; exits with CODE once all ranks printed
//   store                   joins the agent's store under /worker/attempt_<n> as torchrun's
//                           workers do (the FileStore named by FSDP_STORE_FILE when set, else the
//                           TCPStore at MASTER_ADDR:MASTER_PORT), waits for every rank's key,
//                           prints store=file|tcp, then OK rank=<R> ...
//   store-fail-once CODE    store, then on attempt 0 the last rank exits with CODE (others sleep)
//   sleep DIR               writes DIR/pid_<RANK>, prints pid=<pid>, sleeps 60 s
//   lines N CODE            prints "r<R> line <i>" for i = 1..N; the last rank exits with CODE,
//                           the others with 0
// DIR is a directory shared by all ranks for a file barrier: a failure must not come before the
// other ranks have printed what the test checks, however loaded the machine is.
// Output is flushed line by line: the worker's stdout is a pipe to fsdprun.
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fsdp/compat/store.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string env_or(const char* name, const char* fallback = "<unset>") {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string(fallback);
}

int env_int(const char* name) { return std::atoi(env_or(name, "0").c_str()); }

void say(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<long>(s * 1000))); }

// Each rank creates DIR/<tag>_<rank>; returns once every rank's file exists (at most 30 s).
void file_barrier(const std::string& dir, const std::string& tag) {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
  { std::ofstream(dir + "/" + tag + "_" + std::to_string(rank)) << "1\n"; }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (int r = 0; r < world && std::chrono::steady_clock::now() < deadline;) {
    if (access((dir + "/" + tag + "_" + std::to_string(r)).c_str(), F_OK) == 0) {
      ++r;
    } else {
      sleep_s(0.02);
    }
  }
}

int store_sync() {
  const int rank = env_int("RANK"), world = env_int("WORLD_SIZE");
  if (env_or("TORCHELASTIC_USE_AGENT_STORE") != "True") {
    say("FAIL TORCHELASTIC_USE_AGENT_STORE=" + env_or("TORCHELASTIC_USE_AGENT_STORE"));
    return 1;
  }
  const std::string file = env_or("FSDP_STORE_FILE", "");
  fsdp::compat::StorePtr base;
  if (!file.empty()) {
    base = fsdp::compat::file_store(file, std::chrono::seconds(30));
  } else {
    c10d::TCPStoreOptions opts = fsdp::compat::tcp_store_options();  // 2.x: libuv off unless USE_LIBUV=1
    opts.port = static_cast<std::uint16_t>(env_int("MASTER_PORT"));
    opts.isServer = false;  // the agent hosts the store: every rank is a client
    opts.waitWorkers = false;
    opts.timeout = std::chrono::seconds(30);
    base = c10::make_intrusive<c10d::TCPStore>(env_or("MASTER_ADDR"), opts);
  }
  auto store = c10::make_intrusive<c10d::PrefixStore>("/worker/attempt_" + env_or("TORCHELASTIC_RESTART_COUNT"), base);
  store->set("rank_" + std::to_string(rank), std::vector<uint8_t>{1});
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back("rank_" + std::to_string(r));
  store->wait(keys, std::chrono::seconds(30));
  say(std::string("store=") + (file.empty() ? "tcp" : "file"));
  say("OK rank=" + std::to_string(rank) + " world=" + std::to_string(world) + " port=" + env_or("MASTER_PORT") +
      " attempt=" + env_or("TORCHELASTIC_RESTART_COUNT"));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: launcher_probe MODE [args]\n");
    return 64;
  }
  const std::string mode = argv[1];
  const int rank = env_int("RANK");
  const int world = env_int("WORLD_SIZE");
  const int attempt = env_int("TORCHELASTIC_RESTART_COUNT");

  if (mode == "env") {
    for (const char* name : {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                             "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                             "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                             "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE"}) {
      say(std::string(name) + "=" + env_or(name));
    }
    return 0;
  }
  if (mode == "echo") {
    for (int i = 2; i < argc; ++i) say(std::string("arg=") + argv[i]);
    return 0;
  }
  if (mode == "output") {
    std::printf("out-line\n");
    std::fflush(stdout);
    std::fprintf(stderr, "err-line\n");
    std::printf("partial-no-newline");
    std::fflush(stdout);
    return 0;
  }
  if (mode == "exit" && argc >= 5) {
    const int fail_rank = std::atoi(argv[2]), code = std::atoi(argv[3]);
    const bool ignore_term = argc >= 6 && std::string(argv[5]) == "ignore-term";
    if (ignore_term && rank != fail_rank) signal(SIGTERM, SIG_IGN);  // inherited by the grandchild too
    say("pid=" + std::to_string(getpid()));
    pid_t child = fork();
    if (child == 0) {
      sleep_s(60);
      _exit(0);
    }
    say("child_pid=" + std::to_string(child));
    file_barrier(argv[4], "started");
    if (rank == fail_rank) return code;
    sleep_s(60);
    return 0;
  }
  if (mode == "fail-once" && argc >= 4) {
    say("attempt=" + std::to_string(attempt));
    if (attempt > 0) return 0;
    file_barrier(argv[3], "attempt0");
    if (rank == world - 1) return std::atoi(argv[2]);
    sleep_s(60);
    return 0;
  }
  if (mode == "always-fail" && argc >= 4) {
    say("attempt=" + std::to_string(attempt));
    file_barrier(argv[3], "attempt" + std::to_string(attempt));
    return std::atoi(argv[2]);
  }
  if (mode == "store") return store_sync();
  if (mode == "store-fail-once" && argc >= 3) {
    if (int rc = store_sync(); rc != 0) return rc;
    if (attempt > 0) return 0;
    if (rank == world - 1) return std::atoi(argv[2]);
    sleep_s(60);
    return 0;
  }
  if (mode == "sleep" && argc >= 3) {
    const std::string path = std::string(argv[2]) + "/pid_" + std::to_string(rank);
    {
      std::ofstream f(path + ".tmp");
      f << getpid() << "\n";
    }
    std::rename((path + ".tmp").c_str(), path.c_str());  // the test never reads a half-written file
    say("pid=" + std::to_string(getpid()));
    sleep_s(60);
    return 0;
  }
  if (mode == "lines" && argc >= 4) {
    const int n = std::atoi(argv[2]);
    for (int i = 1; i <= n; ++i) say("r" + std::to_string(rank) + " line " + std::to_string(i));
    return rank == world - 1 ? std::atoi(argv[3]) : 0;
  }
  std::fprintf(stderr, "launcher_probe: unknown mode or missing arguments: %s\n", mode.c_str());
  return 64;
}
