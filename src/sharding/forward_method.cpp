// fsdp::call_method's no-grad reshard (see fsdp/sharding/forward_method.h).
#include "fsdp/sharding/forward_method.h"

#include "fsdp/sharding/fully_shard.h"

namespace fsdp::detail {

void reshard_subtree(torch::nn::Module& module) {
  auto unit = fsdp_module(module);
  if (!unit) return;  // not a unit: its sharded children resharded themselves after their calls
  unit->reshard();
  for (const auto& child : module.modules(/*include_self=*/false))
    if (auto unit = fsdp_module(*child)) unit->reshard();
}

}  // namespace fsdp::detail
