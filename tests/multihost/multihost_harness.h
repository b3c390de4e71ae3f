#pragma once
// What the multi-host suites share: fsdprun on each test host (netns_hosts.h) and waiting for all.
#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "netns_hosts.h"
#include "train_gpt_harness.h"

namespace multihost_test {

using namespace train_gpt_test;
using fsdp::testing::NetnsHosts;

inline constexpr int kPort = 29500;  // each host has its own network stack: never taken

#define SKIP_WITHOUT_NETNS()                                                     \
  do {                                                                           \
    if (auto why = NetnsHosts::unavailable(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

// fsdprun's command line for node k of hosts.size() nodes; node 0 is the master.
inline std::vector<std::string> node_argv(const NetnsHosts& hosts, int k, int nproc,
                                          const std::vector<std::string>& launcher,
                                          const std::vector<std::string>& program) {
  std::vector<std::string> argv = {kFsdprun,
                                   "--nnodes",
                                   std::to_string(hosts.size()),
                                   "--node-rank",
                                   std::to_string(k),
                                   "--nproc-per-node",
                                   std::to_string(nproc),
                                   "--master-addr",
                                   hosts.addr(0),
                                   "--master-port",
                                   std::to_string(kPort),
                                   "--rdzv-timeout-s",
                                   "60"};
  argv.insert(argv.end(), launcher.begin(), launcher.end());
  argv.push_back("--");
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

inline ProcessSpec node_spec(const NetnsHosts& hosts, int k, int nproc, const std::vector<std::string>& launcher,
                             const std::vector<std::string>& program, std::chrono::milliseconds timeout = 180s) {
  ProcessSpec inner = spec_of({}, timeout);  // the trainer suites' environment (one thread, no CUDA, scrubbed)
  ProcessSpec s = hosts.spec(k, node_argv(hosts, k, nproc, launcher, program), timeout);
  s.env_unset = inner.env_unset;
  for (const auto& [key, v] : inner.env_set) s.env_set[key] = v;
  return s;
}

// Starts fsdprun on every host at once and waits for all of them.
inline std::vector<ProcessResult> run_on_hosts(const NetnsHosts& hosts, int nproc,
                                               const std::vector<std::string>& launcher,
                                               const std::vector<std::string>& program,
                                               std::chrono::milliseconds timeout = 180s) {
  std::vector<Child> nodes;
  for (int k = 0; k < hosts.size(); ++k) nodes.emplace_back(node_spec(hosts, k, nproc, launcher, program, timeout));
  std::vector<ProcessResult> out;
  for (auto& n : nodes) out.push_back(n.wait());
  return out;
}

// Polls `children` (collecting their output) until `done` or the limit; false on timeout.
inline bool wait_until(std::vector<Child*> children, const std::function<bool()>& done, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    for (auto* c : children) c->try_wait();
    if (done()) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

inline bool all_ok(const std::vector<ProcessResult>& rs) {
  for (const auto& r : rs) {
    if (!r.ok()) return false;
  }
  return true;
}

inline std::string report(const std::vector<ProcessResult>& rs) {
  std::string s;
  for (size_t k = 0; k < rs.size(); ++k) {
    s += "---- host " + std::to_string(k) + " (exit " + std::to_string(rs[k].exit_code) + ", signal " +
         std::to_string(rs[k].term_signal) + (rs[k].timed_out ? ", timed out" : "") + ")\n" + rs[k].output;
  }
  return s;
}

}  // namespace multihost_test
