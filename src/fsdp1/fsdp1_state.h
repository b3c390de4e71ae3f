#pragma once
// FullyShardedDataParallel's shared state (every copy of a wrapper points to one), and the
// bookkeeping summon_full_params and the wrapper's forward share.
#include <torch/nn/module.h>

#include <memory>
#include <optional>

#include "fsdp/fsdp1/fsdp1.h"

namespace fsdp::detail {

struct FSDP1State {
  std::shared_ptr<torch::nn::Module> root;
  FSDPOptions options;
  std::optional<FSDPModule> root_unit;        // sharding strategies
  std::optional<ReplicateModule> replicated;  // NO_SHARD
  int no_sync_depth = 0;
  StateDictType state_dict_type = StateDictType::FULL_STATE_DICT;  // FSDP1's default
  FullStateDictConfig full_config;
  bool comm_hook_registered = false;
};

// Forwards through a wrapper in progress on this thread (summon_full_params refuses to start).
int& fsdp1_forward_depth();
// Throws when a summon_full_params guard holds parameters of `root` (forward would reshard them
// under the guard's feet).
void check_not_summoned(torch::nn::Module& root);

}  // namespace fsdp::detail
