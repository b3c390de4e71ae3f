#pragma once
// The autograd pieces FSDP needs, which LibTorch offers without module hooks:
//  - post-backward: an identity autograd node applied to a unit's inputs; it runs once the unit's
//    own backward has produced the parameter gradients (FSDP2's RegisterPostBackwardFunction;
//    [Note: the post-backward node] in autograd_hooks.cpp);
//  - pre-backward: pre-hooks on the nodes that produced a unit's outputs (a tensor hook for an
//    output that is a leaf), run before that part of backward;
//  - the final callback: queued on the autograd engine, runs when the whole backward ends;
//  - gradient-accumulated hooks (fsdp::replicate): a post-hook on a leaf's AccumulateGrad node,
//    run once the leaf's .grad holds this backward's gradient (DDP's reducer hook).
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <vector>

namespace fsdp::detail {

class FSDPState;

// Returns `args` with every floating-point tensor that requires grad routed through the hook.
std::vector<at::Tensor> register_post_backward_hook(FSDPState* state, std::vector<at::Tensor> args);
void register_pre_backward_hooks(FSDPState* state, const std::vector<at::Tensor>& outputs);
// Must be called from inside a backward pass (e.g. from a hook).
void queue_final_callback(std::function<void()> callback);
// Returns an owner of the leaf's AccumulateGrad node, which the caller must keep alive: the leaf
// only holds it weakly, and a new node (without the hook) would replace it once it is gone.
// (Opaque because the node's pointer type differs: std::shared_ptr in 1.13, c10::intrusive_ptr in 2.x.)
std::shared_ptr<void> register_grad_accumulated_hook(const at::Tensor& leaf, std::function<void()> hook);

}  // namespace fsdp::detail
