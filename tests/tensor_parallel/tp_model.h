#pragma once
// A small transformer for the tensor-parallel tests: separate q/k/v/o projections (heads split
// across the tp ranks), a GELU MLP, LayerNorms, token + position embeddings and a linear head,
// built from models::Linear/Embedding/LayerNorm (so it can be built on meta). Every module a plan
// may parallelise is entered through fsdp::call.
#include <torch/torch.h>

#include <map>
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
  void reset_parameters();                           // fsdp::init by name: same values for any layout
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

}  // namespace fsdp::testing
