#include "fsdp/dist/env.h"

#include <vector>

#include "launchers.h"

extern char** environ;

namespace fsdp::dist {

std::string LaunchEnv::store_prefix() const {
  return use_agent_store ? "/worker/attempt_" + std::to_string(restart_count) : std::string();
}

namespace {

using detail::lookup;

const char* kHowToLaunch =
    "start the program with `fsdprun --nproc-per-node N -- program` (or torchrun, mpirun, srun), or set RANK, "
    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself";

int parse_int(const std::string& name, const std::string& value, int min_value) {
  return detail::parse_int(name, value, min_value, kHowToLaunch);
}

// torchrun's variables (also fsdprun's, and a PyTorchJob pod's): RANK and WORLD_SIZE given.
LaunchEnv from_torchrun(const std::map<std::string, std::string>& env) {
  LaunchEnv e;
  auto rank = lookup(env, "RANK");
  auto world = lookup(env, "WORLD_SIZE");
  if (!rank || !world) {
    throw DistError(std::string("fsdp: ") +
                    (rank ? "RANK is set but WORLD_SIZE is not" : "WORLD_SIZE is set but RANK is not") + "; " +
                    kHowToLaunch);
  }
  e.from_launcher = true;
  e.launcher = lookup(env, "TORCHELASTIC_RUN_ID") || lookup(env, "TORCHELASTIC_RESTART_COUNT") ? "torchrun" : "env";
  e.rank = parse_int("RANK", *rank, 0);
  e.world_size = parse_int("WORLD_SIZE", *world, 1);
  if (e.rank >= e.world_size) {
    throw DistError("fsdp: RANK=" + std::to_string(e.rank) + " is not below WORLD_SIZE=" +
                    std::to_string(e.world_size) + "; ranks are numbered 0..WORLD_SIZE-1");
  }
  auto local_rank = lookup(env, "LOCAL_RANK");
  auto local_world = lookup(env, "LOCAL_WORLD_SIZE");
  e.local_rank = local_rank ? parse_int("LOCAL_RANK", *local_rank, 0) : e.rank;
  e.local_world_size = local_world ? parse_int("LOCAL_WORLD_SIZE", *local_world, 1) : e.world_size;
  e.all_local = local_world && e.local_world_size == e.world_size;
  if (e.local_rank >= e.local_world_size) {
    throw DistError("fsdp: LOCAL_RANK=" + std::to_string(e.local_rank) +
                    " is not below LOCAL_WORLD_SIZE=" + std::to_string(e.local_world_size));
  }
  if (e.local_world_size > e.world_size) {
    throw DistError("fsdp: LOCAL_WORLD_SIZE=" + std::to_string(e.local_world_size) +
                    " exceeds WORLD_SIZE=" + std::to_string(e.world_size));
  }
  auto addr = lookup(env, "MASTER_ADDR");
  auto port = lookup(env, "MASTER_PORT");
  if (e.world_size > 1 && (!addr || !port)) {
    throw DistError(std::string("fsdp: WORLD_SIZE=") + std::to_string(e.world_size) + " but " +
                    (!addr ? "MASTER_ADDR" : "MASTER_PORT") +
                    " is not set; set it to the address/port of rank 0's store (e.g. MASTER_ADDR=127.0.0.1 "
                    "MASTER_PORT=29500), or " +
                    kHowToLaunch);
  }
  if (addr) e.master_addr = *addr;
  if (port) {
    e.master_port = parse_int("MASTER_PORT", *port, 0);
    if (e.master_port > 65535) throw DistError("fsdp: MASTER_PORT=" + *port + " is not a TCP port (1..65535)");
    if (e.master_port == 0 && e.world_size > 1) {
      throw DistError(
          "fsdp: MASTER_PORT=0 cannot be shared between ranks; pick a port, or use "
          "`fsdprun --master-port 0`, which picks one and passes the real port on");
    }
  }
  auto agent = lookup(env, "TORCHELASTIC_USE_AGENT_STORE");
  e.use_agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  if (auto rc = lookup(env, "TORCHELASTIC_RESTART_COUNT"))
    e.restart_count = parse_int("TORCHELASTIC_RESTART_COUNT", *rc, 0);
  return e;
}

}  // namespace

LaunchEnv parse_launch_env(const std::map<std::string, std::string>& env) {
  // Precedence when launchers nest: the innermost sets the most specific variables. fsdprun or
  // torchrun started by srun or mpirun gives its workers RANK (torchrun's win); mpirun inside an
  // sbatch script or salloc shell runs its ranks outside any srun step (Open MPI's win, and
  // Slurm's count only inside an srun step anyway).
  if (lookup(env, "RANK") || lookup(env, "WORLD_SIZE")) return from_torchrun(env);
  if (auto e = detail::from_openmpi(env)) return *e;
  if (auto e = detail::from_slurm(env)) return *e;
  detail::refuse_unknown_launcher(env);
  // No launcher at all: one process that still works (world size 1, no store, no network).
  return LaunchEnv{};
}

LaunchEnv read_launch_env() {
  std::map<std::string, std::string> env;
  for (char** p = environ; *p != nullptr; ++p) {
    std::string kv(*p);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return parse_launch_env(env);
}

std::string describe(const LaunchEnv& e) {
  static const std::map<std::string, std::string> read = {
      {"none", "no launcher variables"},
      {"torchrun", "RANK, WORLD_SIZE, ..."},
      {"env", "RANK, WORLD_SIZE, ... without torchrun's TORCHELASTIC_*"},
      {"openmpi", "OMPI_COMM_WORLD_*"},
      {"slurm", "SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID"}};
  const auto it = read.find(e.launcher);
  std::string s = "launcher " + e.launcher + " (" + (it == read.end() ? "?" : it->second) +
                  "): " + std::to_string(e.world_size) + (e.world_size == 1 ? " rank, " : " ranks, ") +
                  std::to_string(e.local_world_size) + " on this host, master " + e.master_addr + ":" +
                  std::to_string(e.master_port);
  if (!e.master_from.empty()) s += " (" + e.master_from + ")";
  if (e.use_agent_store) s += ", the launcher's store under " + e.store_prefix();
  return s;
}

}  // namespace fsdp::dist
