#pragma once
// Tensor parallelism for LibTorch modules: PyTorch's parallel styles and parallelize_module.
//
//   auto mesh = fsdp::init_device_mesh({2, 2}, {"dp", "tp"});
//   namespace tp = fsdp::tp;
//   tp::parallelize_module(model.ptr(), mesh["tp"], {
//       {"blocks.*.attn.q", tp::ColwiseParallel{}},       // heads split across the tp ranks
//       {"blocks.*.attn.k", tp::ColwiseParallel{}},
//       {"blocks.*.attn.v", tp::ColwiseParallel{}},
//       {"blocks.*.attn.o", tp::RowwiseParallel{}},       // output all-reduced
//       {"blocks.*.mlp.fc", tp::ColwiseParallel{}},
//       {"blocks.*.mlp.proj", tp::RowwiseParallel{}},
//   });
//   for (auto& b : model->blocks) fsdp::fully_shard(b, {.mesh = mesh["dp"]});   // then FSDP over dp
//
// Modules with a style must be entered through fsdp::call (see [Note: TP communication through
// fsdp::call] in hooks.h), and attention must compute with its local heads (q's width / head dim).
//
// Styles (PyTorch's names and semantics; activations are plain local tensors whose layout across
// the tp ranks the style's layouts describe):
//   ColwiseParallel   Linear: weight rows (output features) and bias sharded, dim 0 (.fused = k:
//                     k blocks, e.g. a fused q|k|v, each sharded; see the struct). Embedding:
//                     the embedding dim (weight dim 1). input_layouts: Replicate (default; backward
//                     all-reduces the input gradient) or Shard(d) (sequence parallel: all-gathered
//                     along d, gradient reduce-scattered). output_layouts: Shard(-1) (default,
//                     local features) or Replicate (all-gathered).
//   RowwiseParallel   Linear: weight columns (input features) sharded (dim 1), bias replicated and
//                     added once. Embedding: the vocabulary (weight dim 0), ids outside the local
//                     range give zeros. input_layouts: Shard(-1) (Linear default) or Replicate
//                     (Embedding default; a Linear's input is then sliced). output_layouts:
//                     Replicate (default: all-reduced) or Shard(d) (sequence parallel:
//                     reduce-scattered along d).
//   SequenceParallel  any module with replicated parameters (LayerNorm, dropout) run on activations
//                     sharded along sequence_dim: nothing moves in forward; its parameters'
//                     gradients (partial: each rank saw part of the sequence) are all-reduced over
//                     the tp ranks in backward.
//   PrepareModuleInput / PrepareModuleOutput: convert the module's tensor inputs / outputs, in
//                     order, from one layout to another (Shard(d) -> Replicate: all-gather;
//                     Replicate -> Shard(d): local slice; Shard(a) -> Shard(b): one all-to-all,
//                     DTensor's redistribute; the gradient takes the conjugate path).
//
// Linear and Embedding are torch::nn::LinearImpl / EmbeddingImpl, or any module type registered
// with register_linear_type<T>() / register_embedding_type<T>() (T has `weight` and, for a
// Linear, `bias` fields and computes x W^T + b, resp. weight[ids]).
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <typeindex>
#include <utility>
#include <variant>
#include <vector>

#include "fsdp/detail/tensor_parallel.h"
#include "fsdp/mesh/device_mesh.h"
#include "fsdp/tensor_parallel/placement.h"

namespace fsdp::tp {

// Example: tp::ColwiseParallel style{.input_layouts = tp::Shard(1), .output_layouts = tp::Replicate()};
//          tp::ColwiseParallel qkv{.fused = 3};  // a fused [q | k | v] Linear: heads of each split
struct ColwiseParallel {
  std::optional<Layout> input_layouts = std::nullopt;   // default Replicate
  std::optional<Layout> output_layouts = std::nullopt;  // default Shard(-1)
  // Linear only: the output features are `fused` equal blocks (GPT-2's c_attn: 3, [q | k | v]),
  // each split over the tp ranks on its own (a strided placement, TPPlacement::blocks): rank r
  // holds the r-th slice of every block, concatenated, and computes [q_r | k_r | v_r]. The bias
  // follows the weight. The tp size must divide each block; output_layouts must stay Shard(-1).
  int64_t fused = 1;
};
// Example: tp::RowwiseParallel style{.output_layouts = tp::Shard(1)};  // sequence parallel
struct RowwiseParallel {
  std::optional<Layout> input_layouts;   // default Shard(-1) (Linear), Replicate (Embedding)
  std::optional<Layout> output_layouts;  // default Replicate
};
// Example: tp::SequenceParallel style{};  // a LayerNorm on activations sharded along dim 1
struct SequenceParallel {
  int64_t sequence_dim = 1;
};
// Example: tp::PrepareModuleInput style{.input_layouts = {tp::Shard(1)}, .desired_input_layouts = {tp::Replicate()}};
// Example: tp::PrepareModuleInput heads{.input_layouts = {tp::Shard(1)}, .desired_input_layouts = {tp::Shard(2)}};
struct PrepareModuleInput {
  std::vector<Layout> input_layouts;          // one per tensor argument, in order
  std::vector<Layout> desired_input_layouts;  // same count
};
// Example:
//   tp::PrepareModuleOutput style{.output_layouts = {tp::Replicate()},
//                                 .desired_output_layouts = {tp::Shard(1)}};
struct PrepareModuleOutput {
  std::vector<Layout> output_layouts;          // one per output tensor, in order
  std::vector<Layout> desired_output_layouts;  // same count
};

using ParallelStyle =
    std::variant<ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput>;
// Module names (as named_modules() gives them, relative to the module parallelized) to styles,
// applied in order. '*' matches within one name component ("blocks.*.attn.q"); "" is the module
// itself.
using ParallelizePlan = std::vector<std::pair<std::string, ParallelStyle>>;

// Applies `plan` to `module`'s submodules over the 1-D tp mesh: shards their parameters in place
// (real or meta) and registers the styles' communication. Call it before fully_shard and before
// building the optimizer. Every tp rank must make the same call. Validates the whole plan first
// (a refused call changes nothing): an entry matching no module, a module type a style does not
// support, a size the tp size does not divide, a module parallelized twice, a mesh that is not
// 1-D: std::invalid_argument naming the problem and the fix.
void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMesh& tp_mesh,
                        const ParallelizePlan& plan);
template <typename Holder, typename = decltype(std::declval<Holder&>().ptr())>
void parallelize_module(Holder& module, const DeviceMesh& tp_mesh, const ParallelizePlan& plan) {
  parallelize_module(std::static_pointer_cast<torch::nn::Module>(module.ptr()), tp_mesh, plan);
}

template <typename T>
void register_linear_type(const std::string& type_name) {
  detail::register_module_kind(typeid(T), {detail::ModuleKind::Linear, type_name,
                                           [](torch::nn::Module& m) { return dynamic_cast<T&>(m).weight; },
                                           [](torch::nn::Module& m) { return dynamic_cast<T&>(m).bias; }});
}
template <typename T>
void register_embedding_type(const std::string& type_name) {
  detail::register_module_kind(typeid(T), {detail::ModuleKind::Embedding, type_name,
                                           [](torch::nn::Module& m) { return dynamic_cast<T&>(m).weight; },
                                           [](torch::nn::Module&) { return at::Tensor(); }});
}

}  // namespace fsdp::tp
