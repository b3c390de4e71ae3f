#include "multiprocess.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <optional>

#include "fsdp/dist/runtime.h"

namespace fsdp::testing {

namespace {
std::map<std::string, RankWorker>& workers() {
  static std::map<std::string, RankWorker> w;
  return w;
}
}  // namespace

bool register_rank_worker(const std::string& name, RankWorker fn) {
  workers()[name] = std::move(fn);
  return true;
}

bool RanksResult::all_ok() const {
  for (const auto& r : ranks) {
    if (!r.ok()) return false;
  }
  return !ranks.empty();
}

std::string RanksResult::report() const {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    const auto& r = ranks[i];
    out += "---- rank " + std::to_string(i) + ": " +
           (r.timed_out     ? std::string("TIMED OUT")
            : r.term_signal ? "killed by signal " + std::to_string(r.term_signal)
                            : "exit code " + std::to_string(r.exit_code)) +
           "\n" + r.output + "\n";
  }
  return out;
}

RanksResult run_ranks(int world, const std::string& name, const RanksOptions& options) {
  if (workers().count(name) == 0) throw std::invalid_argument("no rank worker named " + name);
  const int port = pick_free_port();
  std::vector<Child> children;
  children.reserve(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    ProcessSpec spec;
    spec.argv = {self_exe()};
    spec.timeout = options.timeout;
    spec.env_set = {{"FSDP_TEST_WORKER", name},
                    {"FSDP_TEST_INIT", options.init_runtime ? "1" : "0"},
                    {"RANK", std::to_string(r)},
                    {"WORLD_SIZE", std::to_string(world)},
                    {"LOCAL_RANK", std::to_string(r)},
                    {"LOCAL_WORLD_SIZE", std::to_string(world)},
                    {"MASTER_ADDR", "127.0.0.1"},
                    {"MASTER_PORT", std::to_string(port)},
                    {"OMP_NUM_THREADS", "1"},
                    // A rank that waits for a dead peer gives up well before the test's timeout.
                    {"FSDP_COLLECTIVE_TIMEOUT_S", "60"}};
    spec.env_unset = {"TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"};
    for (const auto& [k, v] : options.env) spec.env_set[k] = v;
    children.emplace_back(spec);
  }
  // Fail fast: once a rank fails, the others would only wait for it until their collective
  // timeout, so they get a short grace period to report their own error, then are killed.
  std::optional<std::chrono::steady_clock::time_point> kill_at;
  while (true) {
    bool all_done = true;
    for (auto& c : children) {
      if (!c.try_wait()) {
        all_done = false;
        continue;
      }
      if (!c.result().ok() && !kill_at) kill_at = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    }
    if (all_done) break;
    if (kill_at && std::chrono::steady_clock::now() >= *kill_at) {
      for (auto& c : children) c.send_signal(SIGKILL);
    }
    usleep(10000);
  }
  RanksResult result;
  for (auto& c : children) result.ranks.push_back(c.result());
  return result;
}

int maybe_run_worker() {
  const char* name = std::getenv("FSDP_TEST_WORKER");
  if (name == nullptr) return -1;
  auto it = workers().find(name);
  if (it == workers().end()) {
    std::cerr << "unknown rank worker " << name << "\n";
    return 2;
  }
  try {
    const char* init = std::getenv("FSDP_TEST_INIT");
    if (init == nullptr || std::string(init) == "1") fsdp::dist::init_distributed();
    it->second();
    if (fsdp::dist::is_initialized()) fsdp::dist::destroy_distributed();
  } catch (const std::exception& e) {
    std::cerr << "rank worker " << name << " failed: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace fsdp::testing
