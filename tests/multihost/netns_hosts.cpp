#include "netns_hosts.h"

#include <unistd.h>

#include <atomic>
#include <stdexcept>

namespace fsdp::testing {
namespace {

const std::string kScript = NETNS_HOSTS_SCRIPT;

bool has_ip() {
  for (const char* dir : {"/usr/sbin", "/sbin", "/usr/bin", "/bin"}) {
    if (access((std::string(dir) + "/ip").c_str(), X_OK) == 0) return true;
  }
  return false;
}

std::string last_line(const std::string& s) {
  std::string t = s;
  while (!t.empty() && t.back() == '\n') t.pop_back();
  auto nl = t.rfind('\n');
  return nl == std::string::npos ? t : t.substr(nl + 1);
}

}  // namespace

ProcessResult NetnsHosts::script(const std::vector<std::string>& args, std::chrono::milliseconds timeout) const {
  ProcessSpec s;
  s.argv = {kScript};
  s.argv.insert(s.argv.end(), args.begin(), args.end());
  s.env_set["FSDP_NETNS_PREFIX"] = prefix_;
  s.timeout = timeout;
  return run_process(s);
}

std::string NetnsHosts::unavailable() {
  static const std::string reason = [] {
    if (geteuid() != 0) return std::string("needs root to make network namespaces (run the test as root)");
    if (!has_ip()) return std::string("needs iproute2's ip (apt-get install iproute2)");
    if (access(kScript.c_str(), X_OK) != 0) return "cannot execute " + kScript;
    try {
      NetnsHosts probe(1);
    } catch (const std::exception& e) {
      return std::string("cannot make network namespaces here: ") + e.what();
    }
    return std::string();
  }();
  return reason;
}

NetnsHosts::NetnsHosts(int n) : n_(n) {
  static std::atomic<int> counter{0};
  prefix_ = "fsdpmh-" + std::to_string(getpid()) + "-" + std::to_string(counter++);
  script({"gc"});  // sets left behind by test processes that were killed
  auto r = script({"up", std::to_string(n)});
  up_ = true;  // whatever `up` made is removed by the destructor
  if (!r.ok()) throw std::runtime_error("netns-hosts.sh up " + std::to_string(n) + " failed: " + last_line(r.output));
}

NetnsHosts::~NetnsHosts() {
  if (up_) script({"down"});
}

std::string NetnsHosts::addr(int k) const { return "10.77.0." + std::to_string(k + 1); }

ProcessSpec NetnsHosts::spec(int k, const std::vector<std::string>& argv, std::chrono::milliseconds timeout) const {
  ProcessSpec s;
  s.argv = {kScript, "exec", std::to_string(k), "--"};
  s.argv.insert(s.argv.end(), argv.begin(), argv.end());
  s.env_set["FSDP_NETNS_PREFIX"] = prefix_;
  s.timeout = timeout;
  return s;
}

void NetnsHosts::kill_host(int k) {
  auto r = script({"kill", std::to_string(k)});
  if (!r.ok()) throw std::runtime_error("netns-hosts.sh kill failed: " + last_line(r.output));
}

void NetnsHosts::set_link(int k, bool up) {
  auto r = script({"link", std::to_string(k), up ? "up" : "down"});
  if (!r.ok()) throw std::runtime_error("netns-hosts.sh link failed: " + last_line(r.output));
}

}  // namespace fsdp::testing
