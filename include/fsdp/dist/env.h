#pragma once
// torchrun's environment contract, parsed and validated in one place.
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

namespace fsdp::dist {

// Thrown for a wrong environment or set-up; the message names the problem and the fix.
class DistError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct LaunchEnv {
  bool from_launcher = false;  // false: no variables at all, a single process (world size 1)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // torchrun / fsdprun host the store in the agent: every rank is a client under
  // PrefixStore("/worker/attempt_<restart_count>").
  bool use_agent_store = false;
  int restart_count = 0;

  std::string store_prefix() const;  // "" unless use_agent_store
};

// Parses the variables of `env` (a map, so tests need not touch the real
// environment). Throws DistError for missing, non-numeric or contradictory values.
LaunchEnv parse_launch_env(const std::map<std::string, std::string>& env);
LaunchEnv read_launch_env();  // from the process environment

}  // namespace fsdp::dist
