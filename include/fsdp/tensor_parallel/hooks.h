#pragma once
// The input/output transforms that parallel styles attach to a module, run by fsdp::call.
//
// [Note: TP communication through fsdp::call]
// PyTorch's parallel styles insert their communication with forward pre-hooks and forward hooks.
// LibTorch modules have neither, and torch::nn::LinearImpl::forward is not virtual, so a style
// cannot wrap the module itself. The project already has one entry point that runs code around a
// module's forward: fsdp::call(module, args...) (fsdp/sharding/call.h), which sharded units are
// entered through. parallelize_module registers the style's transforms here, keyed by module, and
// fsdp::call runs them: the input transforms on the tensor arguments before FSDP's pre-forward
// (PyTorch registers TP hooks first, at parallelize time), the output transforms on the output
// tensors after forward and before FSDP's post-forward (so a reshard comes after the output
// collective). A module with TP styles must therefore be called as `fsdp::call(q, x)`, not
// `q(x)`: calling it directly computes with the local shard and skips the collectives (for an
// unparallelised module fsdp::call is exactly forward, so one model source serves every layout).
// The transforms are autograd functions (comm_functions.h), so backward runs their conjugates;
// under activation checkpointing the recompute runs them again, on every rank alike.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <vector>

namespace fsdp::tp::detail {

struct ModuleHooks {
  // Tensor arguments in, tensor arguments out (same count and order). Empty: none.
  std::function<std::vector<at::Tensor>(std::vector<at::Tensor>)> input;
  // Output tensors, transformed in place. Empty: none.
  std::function<void(std::vector<at::Tensor>&)> output;
  // Whatever the style must keep alive as long as the module (e.g. gradient hooks' nodes).
  std::shared_ptr<void> keep_alive;
};

// Appends `hooks` to `module`'s (several styles may apply to one module; they run in order).
void add_module_hooks(const std::shared_ptr<torch::nn::Module>& module, ModuleHooks hooks);
// `module`'s hooks, or null (cheap when no module has any).
std::shared_ptr<const std::vector<ModuleHooks>> find_module_hooks(const torch::nn::Module* module);

std::vector<at::Tensor> run_input_hooks(const std::vector<ModuleHooks>& hooks, std::vector<at::Tensor> args);
void run_output_hooks(const std::vector<ModuleHooks>& hooks, std::vector<at::Tensor>& outputs);

}  // namespace fsdp::tp::detail
