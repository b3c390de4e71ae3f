#pragma once
// A small transformer for the tensor-parallel tests: separate q/k/v/o projections (heads split
// across the tp ranks), a GELU MLP, LayerNorms, token + position embeddings and a linear head,
// built from models::Linear/Embedding/LayerNorm (so it can be built on meta). Every module a plan
// may parallelise is entered through fsdp::call.
#include <torch/torch.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace fsdp::testing {

struct TPModelConfig {
  int64_t vocab = 32, seq = 8, dim = 16, heads = 4, layers = 2, hidden = 32;
  torch::Device device = torch::kCPU;
  uint64_t seed = 7;
};

struct TPAttentionImpl : torch::nn::Module {
  explicit TPAttentionImpl(const TPModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  models::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr};
  int64_t head_dim;
};
TORCH_MODULE(TPAttention);

struct TPMLPImpl : torch::nn::Module {
  explicit TPMLPImpl(const TPModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  models::Linear fc{nullptr}, proj{nullptr};
};
TORCH_MODULE(TPMLP);

struct TPBlockImpl : torch::nn::Module {
  explicit TPBlockImpl(const TPModelConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  models::LayerNorm ln1{nullptr}, ln2{nullptr};
  TPAttention attn{nullptr};
  TPMLP mlp{nullptr};
};
TORCH_MODULE(TPBlock);

struct TPEmbedImpl : torch::nn::Module {
  explicit TPEmbedImpl(const TPModelConfig& c);
  torch::Tensor forward(const torch::Tensor& idx);
  models::Embedding wte{nullptr}, wpe{nullptr};
};
TORCH_MODULE(TPEmbed);

struct TPModelImpl : torch::nn::Module {
  explicit TPModelImpl(const TPModelConfig& c);
  torch::Tensor forward(const torch::Tensor& idx);  // [B, T] -> logits [B, T, vocab (or vocab / tp)]
  void reset_parameters();                          // fsdp::init by name: same values for any layout
  TPModelConfig config;
  TPEmbed embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  std::vector<TPBlock> typed_blocks;
  models::LayerNorm ln_f{nullptr};
  models::Linear head{nullptr};
};
TORCH_MODULE(TPModel);

// The Megatron-style plan: q/k/v and fc column-wise, o and proj row-wise, embedding row-wise
// (vocabulary), head column-wise (Replicate output, or vocabulary-sharded for loss_parallel).
// Sequence parallel: norms SequenceParallel, the attention/MLP inputs gathered, their outputs and
// the embedding's reduce-scattered along the sequence.
tp::ParallelizePlan tp_plan(bool sequence_parallel, bool loss_parallel);

// What the TP suites train and compare with (test_tensor_parallel, test_tp_checkpoint, the mesh
// suite's from_groups runs).
// The global batch of step `step`: [batch, seq + 1] token ids from seed seed_base + step, the
// same on every rank.
at::Tensor global_batch(const TPModelConfig& c, int step, int64_t batch, uint64_t seed_base);
// AdamW with eps 1e-3: see tests/sharding/parity.cpp (the key bias's true gradient is zero, and
// Adam with a tiny eps turns its rounding noise into full-size steps).
torch::optim::AdamW make_optimizer(torch::nn::Module& m);
// One AdamW step on this data-parallel rank's rows of `batch` ([B, seq + 1]; rank r of dp_size
// takes rows [r B / dp_size, (r + 1) B / dp_size)): cross-entropy of fsdp::call(model, x) (the
// plain forward for an unsharded model), global gradient clipping at 0.5. Returns the local loss.
at::Tensor train_step(TPModel& model, torch::optim::Optimizer& opt, const at::Tensor& batch, int64_t dp_rank = 0,
                      int64_t dp_size = 1);
double rel_diff(double got, double want);  // |got - want| / max(1, |want|)
// Every parameter of `model`, detached and cloned, by name.
std::map<std::string, at::Tensor> snapshot(TPModel& model);
// The TP placement of a parameter, through fully_shard's ShardInfo when it is FSDP-sharded.
std::optional<tp::TPPlacement> tp_placement_of(const at::Tensor& param);
// What this rank should hold of `full`: its TP slice (each block's, concatenated, for a strided
// placement), then, under fully_shard, its rows of that.
at::Tensor expected_local(const at::Tensor& param, const at::Tensor& full);
// Largest |local - expected slice of the full reference| over every parameter of `model`: shards
// of fully_shard (rows of the TP-local tensor), TP-local tensors, replicated ones. Throws naming
// the parameter when one differs by more than `tol` or has the wrong shape. gather (TP only, a
// collective over the tp ranks): also the all-gathered parameter against the whole reference.
double max_param_diff(TPModel& model, const std::map<std::string, at::Tensor>& reference, double tol,
                      bool gather = false);

}  // namespace fsdp::testing
