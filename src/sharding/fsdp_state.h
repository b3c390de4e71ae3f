#pragma once
// FSDPState: one per fully_shard call (FSDP2's FSDPState): the hooks around forward and backward,
// root lazy initialisation and the prefetch order.
//
// Timeline of one training step for a unit U (not the root):
//   fsdp::call(U, x)  pre_forward   unshard U (wait), prefetch the next unit's all-gather, wrap
//                                   x in the post-backward node, which runs after U's backward
//                     forward       the module's own code
//                     post_forward  reshard U (reshard_after_forward), hook U's outputs
//   backward          pre_backward  (hook on U's output) unshard U, prefetch the previous unit
//                     U's backward  autograd, gradients land on the unsharded parameters
//                     post_backward (that node) reduce-scatter U's gradients, reshard
//   end of backward   final callback (root, queued by the first pre_backward): post_backward
//                     for units whose hook never ran (e.g. the root, whose input is token ids),
//                     wait for the reductions, reshard what is left, reset for the next step.
//
// Under activation checkpointing (fsdp/activation/activation_checkpointing.h) a unit's forward may run twice:
// first without autograd (no backward hooks are registered then), then again inside backward
// (in_recompute()): pre_forward then only waits for the gather (prefetched by the unit after it)
// and hooks the inputs; post_forward keeps the parameters and hooks the outputs, so pre_backward,
// the backward prefetch and post_backward run as without checkpointing.
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/debug/buffer_pool.h"
#include "fsdp/sharding/policies.h"
#include "fsdp_param_group.h"

namespace fsdp::detail {

class FSDPState;

// Shared by the root and every state below it, set at the root's lazy init.
struct RootContext {
  std::vector<FSDPState*> states;                  // the root first, then its descendants in module order
  std::vector<FSDPState*> forward_order;           // this step, in pre-forward order
  std::vector<FSDPState*> previous_forward_order;  // last step's: drives forward prefetch
  // This step, in post-forward order (a unit's forward ends after those nested in it: the root is
  // last): drives backward prefetch, as FSDP2's post_forward_order does. The unit before a unit
  // here runs next in backward; so the root's pre-backward prefetches the last block.
  std::vector<FSDPState*> post_forward_order;
  std::vector<FSDPParamGroup*> pending_reduces;  // reduce-scatters in flight, oldest first
  bool final_callback_queued = false;
  bool is_last_backward = true;
};

class FSDPState {
 public:
  enum class Training { Idle, Forward, PreBackward, PostBackward };

  FSDPState(std::vector<std::shared_ptr<torch::nn::Module>> modules, std::unique_ptr<FSDPParamGroup> group,
            std::optional<bool> reshard_after_forward, MixedPrecisionPolicy mp_policy = {});
  ~FSDPState();

  const std::vector<torch::nn::Module*>& modules() const { return modules_; }
  FSDPParamGroup* group() const { return group_.get(); }
  bool is_root() const { return is_root_.value_or(false); }
  const std::shared_ptr<RootContext>& context() const { return ctx_; }

  std::vector<at::Tensor> pre_forward(std::vector<at::Tensor> args);
  void post_forward(std::vector<at::Tensor>& outputs);
  void abort_forward() noexcept;
  void pre_backward();
  void post_backward();

  // FSDPModule settings
  void set_reshard_after_forward(bool reshard);
  std::vector<FSDPState*> explicit_forward_prefetch;
  std::vector<FSDPState*> explicit_backward_prefetch;
  bool has_explicit_forward_prefetch = false;
  bool has_explicit_backward_prefetch = false;
  // FSDP2's set_post_optim_event: on a GPU the root's next all-gather waits on this event
  // (recorded by the user after the optimizer step) instead of the current stream. Used once.
  std::shared_ptr<c10::Event> post_optim_event;
  // Every state in this one's module subtree (itself first), found through the module registry.
  std::vector<FSDPState*> subtree_states() const;

 private:
  void lazy_init_as_root();
  std::vector<at::Tensor> pre_recompute(std::vector<at::Tensor> args);
  void cast_forward_inputs(std::vector<at::Tensor>& args) const;
  void root_pre_forward();
  void final_callback();
  void queue_reduce(FSDPParamGroup* group);
  FSDPState* neighbour(const std::vector<FSDPState*>& order, int step) const;
  bool is_last_in(const std::vector<FSDPState*>& order) const;
  // The pool's cache goes back to the kernel (trim_min_bytes permitting) when the option `when`
  // is on: as forward ends (&BufferPoolOptions::trim_after_forward: at the last unit's pre-forward
  // and at the root's post-forward) and as backward ends (&BufferPoolOptions::trim_after_backward:
  // in the root's final callback).
  static void trim_pool(bool BufferPoolOptions::*when);

  std::vector<torch::nn::Module*> modules_;
  std::string label_;  // the name in profiler ranges (set at the root's lazy init)
  std::vector<std::weak_ptr<torch::nn::Module>> module_refs_;
  std::unique_ptr<FSDPParamGroup> group_;
  std::optional<bool> reshard_after_forward_option_;
  std::optional<bool> is_root_;
  std::shared_ptr<RootContext> ctx_;
  MixedPrecisionPolicy mp_policy_;
  Training training_ = Training::Idle;
  size_t forward_calls_ = 0;  // list form: post-forward once every module of the list ran
};

}  // namespace fsdp::detail
