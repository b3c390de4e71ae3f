#pragma once
// The launcher's environment contract, parsed and validated in one place: torchrun's variables
// (also fsdprun's and Kubernetes' PyTorchJob's), Open MPI's (mpirun) and Slurm's (srun), in that
// order of precedence (docs/launching.md).
//
// Example:
//   auto env = fsdp::dist::read_launch_env();  // under `mpirun -np 2`: launcher "openmpi", world 2
//   std::printf("%s\n", fsdp::dist::describe(env).c_str());
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
  // Whose variables were read: "none", "torchrun" (torchrun or fsdprun: TORCHELASTIC_* set),
  // "env" (RANK/WORLD_SIZE without torchrun's, e.g. a PyTorchJob pod or set by hand), "openmpi",
  // "slurm".
  std::string launcher = "none";
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  // The launcher said every rank runs on this host (not merely defaulted): collectives may then
  // stay on the loopback interface.
  bool all_local = false;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Where master_addr:master_port came from when the launcher gave no MASTER_ADDR/MASTER_PORT
  // (e.g. "port from SLURM_JOB_ID"); "" when both were set.
  std::string master_from;
  // torchrun / fsdprun host the store in the agent: every rank is a client under
  // PrefixStore("/worker/attempt_<restart_count>").
  bool use_agent_store = false;
  int restart_count = 0;

  std::string store_prefix() const;  // "" unless use_agent_store
};

// Parses the variables of `env` (a map, so tests need not touch the real environment). Throws
// DistError for missing, non-numeric or contradictory values, for an incomplete set of a
// launcher's variables, and for a launcher whose variables we do not read (PMI_RANK, ...).
LaunchEnv parse_launch_env(const std::map<std::string, std::string>& env);
LaunchEnv read_launch_env();  // from the process environment

// One line: the launcher and the values taken, e.g. "launcher openmpi: rank 0 of 2, local 0 of 2,
// master 127.0.0.1:23456 (...)". init_distributed's rank 0 prints it.
std::string describe(const LaunchEnv& env);

}  // namespace fsdp::dist
