#pragma once
// Activation checkpointing for LibTorch (torch.utils.checkpoint, checkpoint_wrapper and
// apply_activation_checkpointing in C++), composed with fully_shard.
//
// A checkpointed function runs its forward without autograd, keeping only its inputs; during
// backward it runs again with autograd (the recompute) and its backward follows at once. Memory:
// one unit's activations at a time instead of every unit's; cost: one more forward.
//
// Example:
//   using namespace fsdp::activation;
//   auto y = checkpoint([&](const at::Tensor& x) { return block->mlp(x); }, x);   // one call
//   apply_activation_checkpointing(*model, every_kth<BlockImpl>(1));   // every block
//   apply_activation_checkpointing(*model, every_kth<BlockImpl>(2));   // blocks 2, 4, ...
//   auto wrapped = checkpoint_wrapper(block);  wrapped(x);             // plain calls too
// then fully_shard as usual; fsdp::call(block, x) runs checkpointed.
//
// Why a namespace of its own (fsdp::activation::checkpoint): fsdp::checkpoint is
// already the namespace of sharded *model* checkpoints (save/load), so a function of that name
// could not live beside it; "activation" says which kind of checkpoint this is.
//
// With fully_shard (apply checkpointing to a unit before or after fully_shard, in any order): the
// forward unshards and reshards as usual; in backward the unit after it prefetches its parameters,
// the recompute uses them in param_dtype, its backward follows, then its gradients are
// reduce-scattered once and it reshards, as without checkpointing (every reshard_after_forward
// setting, HSDP, mixed precision, gradient accumulation, CPU offload; prefetch order unchanged).
//
// Rules (PyTorch's reentrant checkpoint has the same ones):
//  - RNG: by default the recompute draws the same random numbers as the forward (dropout): the
//    CPU generator's state, and each input device's CUDA generator's, are saved before the forward
//    and restored around the recompute; the generators continue afterwards as if nothing was
//    recomputed. A checkpointed module (checkpoint_wrapper, apply_activation_checkpointing) also
//    saves its parameters' and buffers' devices' generators (PyTorch's saves the inputs' only), so
//    a block whose inputs live elsewhere replays its dropout too; a plain checkpoint(fn, ...) call
//    cannot see what fn uses: there, the inputs' devices only, as in PyTorch.
//    CheckpointOptions::preserve_rng_state = false skips this (dropout then differs).
//  - Side effects run twice: anything the function does besides computing its outputs (a counter,
//    a log line, batch-norm running statistics) happens again in the recompute. Guard it with
//    fsdp::activation::is_recomputing() to do it once.
//  - The outputs must be a tensor, a std::tuple of tensors (other members pass through) or a
//    std::vector<at::Tensor>; integer outputs get no gradient. Inputs are saved by reference:
//    modifying one in place before backward is caught by autograd's version check.
//  - Double backward (backward with create_graph = true through a checkpointed function) and
//    torch::autograd::grad / backward with `inputs` throw std::runtime_error: the recompute's
//    graph exists only inside this backward.
//  - A function none of whose outputs needs a gradient when recomputed (it uses no input or
//    parameter requiring grad) throws during backward: checkpointing it saves nothing.
//  - With autograd off (torch::NoGradGuard, evaluation) the function simply runs once.
//  - The function (and what it captures by reference) must live until backward.
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/detail/activation.h"
#include "fsdp/sharding/call.h"

namespace fsdp::activation {

// Example:
//   fsdp::activation::CheckpointOptions o;
//   o.preserve_rng_state = false;   // no dropout inside: skip saving the generators
//   fsdp::activation::checkpoint(o, fn, x);
struct CheckpointOptions {
  bool preserve_rng_state = true;
};

// True while a checkpointed function is being recomputed (during backward), on this thread.
bool is_recomputing();

// fn(args...) checkpointed. Tensor arguments may or may not require grad; other arguments are
// copied (the recompute calls fn again with the copies).
template <typename Fn, typename... Args>
auto checkpoint(const CheckpointOptions& options, Fn fn, Args&&... args) {
  auto wrapper = [&options](const fsdp::detail::TensorFn& f, const std::vector<at::Tensor>& inputs) {
    return detail::checkpoint_tensors(f, inputs, options);
  };
  return fsdp::detail::call_through(wrapper, std::move(fn), std::forward<Args>(args)...);
}
template <typename Fn, typename... Args,
          typename = std::enable_if_t<!std::is_same_v<std::decay_t<Fn>, CheckpointOptions>>>
auto checkpoint(Fn fn, Args&&... args) {
  return checkpoint(CheckpointOptions{}, std::move(fn), std::forward<Args>(args)...);
}

// Marks `module` so that every fsdp::call(module, ...) is checkpointed (sharded or not).
// Returns false if it was already marked.
bool mark_checkpointed(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options = {});
bool is_checkpointed(const torch::nn::Module& module);

// checkpoint_wrapper(block): a handle whose calls, wrapped(x), are checkpointed (and go through
// fsdp::call, so a sharded block runs its FSDP hooks); fsdp::call(block, x) is checkpointed too.
// Parameter names do not change (no wrapper module is inserted), so checkpoints and state dicts
// are the same with and without activation checkpointing. (LibTorch's block->forward(x) cannot be
// intercepted: call the handle or fsdp::call.)
template <typename M>
class CheckpointWrapper {
 public:
  explicit CheckpointWrapper(M module) : module_(std::move(module)) {}
  template <typename... Args>
  auto operator()(Args&&... args) {
    return fsdp::call(module_, std::forward<Args>(args)...);
  }
  auto* operator->() const { return module_.get(); }
  auto* get() const { return module_.get(); }
  M& module() { return module_; }

 private:
  M module_;
};

template <typename M>
CheckpointWrapper<M> checkpoint_wrapper(M module, const CheckpointOptions& options = {}) {
  mark_checkpointed(detail::shared_module(module), options);
  return CheckpointWrapper<M>(std::move(module));
}

// Which submodules to checkpoint: (name relative to the model, module) -> yes/no, asked once per
// submodule in module order (model.named_modules(), the model itself excluded).
using CheckpointPredicate = std::function<bool(const std::string& name, torch::nn::Module& module)>;

// Marks every submodule the predicate selects (apply before or after fully_shard); returns how
// many. Throws std::invalid_argument if the predicate selects none (a typo in a policy would
// otherwise silently train without checkpointing).
size_t apply_activation_checkpointing(torch::nn::Module& model, const CheckpointPredicate& predicate,
                                      const CheckpointOptions& options = {});

// Every k-th module of type Impl (the k-th, 2k-th, ...: torchtitan's "every k blocks").
template <typename Impl>
CheckpointPredicate every_kth(int k) {
  if (k < 1) throw std::invalid_argument("fsdp::activation::every_kth: k must be at least 1, got " + std::to_string(k));
  auto count = std::make_shared<int>(0);
  return [k, count](const std::string&, torch::nn::Module& m) {
    if (dynamic_cast<Impl*>(&m) == nullptr) return false;
    return ++*count % k == 0;
  };
}

// Removes the marks (checkpoint_wrapper's and apply_activation_checkpointing's) from the model's
// modules, itself included.
void remove_activation_checkpointing(torch::nn::Module& model);

}  // namespace fsdp::activation
