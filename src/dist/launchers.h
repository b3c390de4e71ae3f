#pragma once
// Private to src/dist: the launchers other than torchrun (Open MPI, Slurm), the variables of
// launchers we do not read, and the helpers env.cpp shares with them. Tests include it by path.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/dist/env.h"

namespace fsdp::dist::detail {

using EnvMap = std::map<std::string, std::string>;

// The value of `key`, or nullopt when unset or empty (an empty variable counts as unset).
std::optional<std::string> lookup(const EnvMap& env, const std::string& key);

// `value` as an int >= min_value; otherwise DistError naming the variable, then `fix`.
int parse_int(const std::string& name, const std::string& value, int min_value, const std::string& fix);

// Slurm's host list as Slurm writes it, expanded in order: "node[01-04,07],gpu3" ->
// node01..node04, node07, gpu3. Brackets hold numbers and ranges; the lower bound's width is kept
// (zero padding); several bracket groups in one name multiply ("r[1-2]n[1-2]" -> r1n1 r1n2 r2n1
// r2n2). `what` names the variable in errors. Throws DistError on a malformed list.
std::vector<std::string> expand_nodelist(const std::string& list, const std::string& what = "SLURM_NODELIST");

// The tasks Slurm runs on node `node_id` of a step, from SLURM_STEP_TASKS_PER_NODE ("2(x3),1":
// two on each of the first three nodes, one on the fourth). Throws DistError when malformed or
// when node_id is beyond it.
int tasks_on_node(const std::string& tasks_per_node, int node_id);

// A port in 15000..30999 from a job's id (the same on every rank of that job; jobs with
// different ids rarely share one), for launchers that give no MASTER_PORT.
int port_from_job_id(const std::string& job_id);

// Open MPI's variables (OMPI_COMM_WORLD_*), or nullopt when there are none.
std::optional<LaunchEnv> from_openmpi(const EnvMap& env);
// Slurm's variables inside an srun step (SLURM_STEP_ID set), or nullopt outside one (an sbatch
// or salloc shell is not a rank of anything).
std::optional<LaunchEnv> from_slurm(const EnvMap& env);
// Throws DistError naming the variables of a launcher we do not read (PMI_RANK, PMIX_RANK,
// MV2_COMM_WORLD_RANK, ...) when any is set; for a process with no launcher we read.
void refuse_unknown_launcher(const EnvMap& env);

}  // namespace fsdp::dist::detail
