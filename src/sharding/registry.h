#pragma once
// Process-wide lookups: which FSDPState a module belongs to, and which FSDPParam a tensor is.
// Keyed by raw pointers, validated through weak references, so a destroyed model's entries can
// never be mistaken for a new model that reuses its addresses.
#include <torch/nn/module.h>

#include <memory>
#include <vector>

namespace fsdp::detail {

class FSDPState;
class FSDPParam;
class Reducer;

void register_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                    const std::shared_ptr<FSDPState>& state);
std::shared_ptr<FSDPState> lookup_state(const torch::nn::Module* module);
// Drops the states of destroyed modules (their parameters' memory with them).
void purge_dead_states();

void register_param(FSDPParam* param, FSDPState* owner);
void unregister_params_of(const FSDPState* owner);
// The shard tensor of `param` was replaced (meta-device materialisation): move its entry.
void rekey_shard(const c10::TensorImpl* old_shard, FSDPParam* param);
// The parameter whose shard (what parameters() returns) this tensor is, if any.
FSDPParam* param_of_shard(const at::Tensor& tensor);
// The state owning the parameter whose unsharded tensor this is, if any.
FSDPState* owner_of_unsharded(const at::Tensor& tensor);
FSDPParam* param_of_unsharded(const at::Tensor& tensor);

// fsdp::replicate: the Reducer of a replicated module (kept alive as long as the module).
void register_replicated(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<Reducer>& reducer);
std::shared_ptr<Reducer> lookup_replicated(const torch::nn::Module* module);
bool is_replicated(const torch::nn::Module* module);

}  // namespace fsdp::detail
