#pragma once
// StateDictOptions' selection of model entries (ignore_frozen_params, submodules,
// keep_submodule_prefixes), applied to the "model.<fqn>" items of state_items.h.
#include <set>
#include <string>
#include <vector>

#include "fsdp/checkpoint/state_dict.h"
#include "state_items.h"

namespace fsdp::checkpoint::detail {

struct ModelSelection {
  std::vector<LocalItem> items;   // selected, keys renamed ("model." + the dict's name)
  std::set<std::string> ignored;  // dict names to drop silently on set (frozen parameters)
};

// Filters and renames model_items(model) for `options`; throws for an unknown submodule name.
ModelSelection select_model_items(std::vector<LocalItem> items, torch::nn::Module& model,
                                  const StateDictOptions& options);

}  // namespace fsdp::checkpoint::detail
