#pragma once
// Test hosts on one machine: network namespaces joined by a bridge (scripts/netns-hosts.sh does the
// work; this is its RAII handle). Each host has its own network stack and address 10.77.0.(K+1) and
// shares the file system; nothing in them reaches any address outside them.
//
//   if (auto why = NetnsHosts::unavailable(); !why.empty()) GTEST_SKIP() << why;
//   NetnsHosts hosts(2);                          // fsdpmh-<pid>-<n>-h0, -h1
//   Child node1(hosts.spec(1, {kFsdprun, "--nnodes", "2", "--node-rank", "1", ...}, 120s));
//   hosts.kill_host(1);                           // every process of host 1 gets SIGKILL
//   // ~NetnsHosts: kills every process left in the hosts and removes them, even after a failure
//
// A test binary killed by its timeout cannot run the destructor: the next NetnsHosts first removes
// the sets whose test process is gone (`netns-hosts.sh gc`), and the names carry the pid.
#include <chrono>
#include <string>
#include <vector>

#include "subprocess.h"

namespace fsdp::testing {

class NetnsHosts {
 public:
  // "" when this machine can make test hosts, else the reason it cannot (not root, no iproute2,
  // namespaces not permitted), for GTEST_SKIP. Probes once per process.
  static std::string unavailable();

  explicit NetnsHosts(int n);  // throws std::runtime_error with the script's output
  ~NetnsHosts();
  NetnsHosts(const NetnsHosts&) = delete;
  NetnsHosts& operator=(const NetnsHosts&) = delete;

  int size() const { return n_; }
  std::string addr(int k) const;  // "10.77.0.(k+1)"
  // A process spec that runs argv inside host k (argv[0] an absolute path).
  ProcessSpec spec(int k, const std::vector<std::string>& argv, std::chrono::milliseconds timeout) const;
  void kill_host(int k);          // SIGKILL every process of host k (a host that dies)
  void set_link(int k, bool up);  // unplug / plug host k's link to the bridge
  const std::string& prefix() const { return prefix_; }

 private:
  ProcessResult script(const std::vector<std::string>& args,
                       std::chrono::milliseconds timeout = std::chrono::seconds(60)) const;
  std::string prefix_;
  int n_ = 0;
  bool up_ = false;
};

}  // namespace fsdp::testing
