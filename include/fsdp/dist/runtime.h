#pragma once
// The distributed runtime: one per process, initialised from the torchrun environment contract.
//
// Example:
//   fsdp::dist::init_distributed();             // reads RANK, WORLD_SIZE, MASTER_ADDR, ...
//   auto world = fsdp::dist::world_comm();      // Comm over all ranks
//
// Under fsdprun/torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the launcher hosts the store and
// every rank is a client under "/worker/attempt_<restart>"; otherwise rank 0 hosts it. With no
// environment at all the process is a world of one that still works (local collectives).
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/comm/comm.h"
#include "fsdp/compat/c10d.h"
#include "fsdp/dist/env.h"

namespace fsdp::dist {

struct InitOptions {
  // "cpu" -> Gloo; "cuda" -> NCCL (only in a CUDA build of LibTorch).
  std::string device_type = "cpu";
  // Overrides the backend the device type implies. Gloo with device_type "cuda": collectives on
  // CUDA tensors through Gloo, for several ranks sharing one GPU (NCCL refuses that).
  // Example: init_distributed({.device_type = "cuda", .backend = fsdp::comm::BackendKind::Gloo});
  std::optional<comm::BackendKind> backend;
  // Every collective, the store connection and group creation fail after this long.
  // Default: FSDP_COLLECTIVE_TIMEOUT_S, else 5 minutes.
  std::chrono::milliseconds timeout = comm::default_collective_timeout();
};

// Throws DistError (wrong environment, unreachable store, port in use, already initialised).
void init_distributed(const InitOptions& options = {});
bool is_initialized();
// Drops the world group and the store; init_distributed may be called again afterwards.
void destroy_distributed();

const LaunchEnv& launch_env();
const InitOptions& init_options();
int rank();
int world_size();
int local_rank();
int local_world_size();

// The group of all ranks.
std::shared_ptr<comm::Comm> world_comm();
// The rendezvous store (a HashStore for a world of one).
compat::StorePtr store();

// A new group over `global_ranks` (ascending, unique). Called by the members only, all with the
// same arguments; `tag` must be unique per group (it prefixes the group's store keys).
std::shared_ptr<comm::Comm> new_group(std::vector<int> global_ranks, const std::string& tag);
// A new Gloo group with connections of its own, even over all ranks (new_group would return the
// world group): for CPU traffic that runs beside the training's collectives, such as a background
// checkpoint save. Same calling rules as new_group.
std::shared_ptr<comm::Comm> new_cpu_group(std::vector<int> global_ranks, const std::string& tag);

}  // namespace fsdp::dist
