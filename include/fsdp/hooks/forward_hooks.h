#pragma once
// Module hooks: the one mechanism that runs code around a module's forward, for every capability.
//
// [Note: one hook mechanism for fsdp::call]
// PyTorch composes tensor parallel, FSDP and activation checkpointing through module hooks that
// know nothing of each other: forward pre-hooks and forward hooks run in registration order, and
// checkpoint_wrapper wraps the whole call. LibTorch modules have no hooks and
// torch::nn::LinearImpl::forward is not virtual, so the library has one entry point instead,
// fsdp::call(module, args...) (and fsdp::call_method for other entry points), and this registry:
//  - forward hooks (ForwardHooks): `pre` sees the call's tensor arguments and returns those to
//    use, `post` rewrites the output tensors in place, `abort` undoes `pre` when forward throws.
//    Tensor parallel registers its input/output collectives here, fully_shard its all-gather
//    (pre) and reshard (post). They run in HookOrder, ascending, in pre and post alike (TP's
//    output collective before FSDP's reshard), and in registration order within one order.
//  - call wrappers (CallWrapper): the whole call, hooks and forward, handed to the wrapper as a
//    function of its tensor arguments that it may run again later (activation checkpointing's
//    recompute during backward). The library's capabilities register them
//    (fsdp/detail/hooks.h: the plumbing, not an API); users reach them through
//    fsdp::activation::checkpoint_wrapper.
// A new capability (pipeline or context parallel, say) registers here; fsdp::call does not change.
// The layer depends on LibTorch only, so every layer above may register.
//
// Example:
//   auto linear = torch::nn::Linear(4, 4);
//   fsdp::hooks::ForwardHooks h;
//   h.order = fsdp::hooks::HookOrder::kUser;
//   h.pre = [](std::vector<at::Tensor> args) { args[0] = args[0] * 2; return args; };  // scale the input
//   fsdp::hooks::register_forward_hooks(linear.ptr(), std::move(h));
//   at::Tensor y = fsdp::call(linear, at::ones({1, 4}));  // linear(2 * x)
#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <vector>

namespace fsdp::hooks {

// Where a capability's hooks run among others on the same module (ascending).
enum class HookOrder : int {
  kUser = 0,              // before every capability of the library
  kTensorParallel = 100,  // parallelize_module: input/output layouts and collectives
  kSharding = 200,        // fully_shard / replicate: all-gather before forward, reshard after
};

struct ForwardHooks {
  HookOrder order = HookOrder::kUser;
  // Tensor arguments in, tensor arguments out (same count and order). Empty: none.
  std::function<std::vector<at::Tensor>(std::vector<at::Tensor>)> pre;
  // Output tensors, transformed in place (same count). Empty: none.
  std::function<void(std::vector<at::Tensor>&)> post;
  // Forward (or a later hook) threw after `pre` ran: leave the module in a state a retry can use.
  // Must not throw. Empty: nothing to undo.
  std::function<void()> abort;
  // Whatever the hooks must keep alive as long as the module (e.g. gradient hooks' nodes).
  std::shared_ptr<void> keep_alive;
};
using HookList = std::vector<ForwardHooks>;

// Adds `hooks` to `module`'s, kept while the module lives (a dead module's entry is dropped).
void register_forward_hooks(const std::shared_ptr<torch::nn::Module>& module, ForwardHooks hooks);
// Removes `module`'s hooks of `order` (all of them).
void remove_forward_hooks(const torch::nn::Module* module, HookOrder order);

}  // namespace fsdp::hooks
