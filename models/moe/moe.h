#pragma once
// Mixture-of-experts decoders (MixtralForCausalLM, Qwen3MoeForCausalLM) in plain LibTorch, with the
// Hugging Face Hub's module tree and parameter names, one tensor per expert:
//   Mixtral    model.layers.N.block_sparse_moe.gate.weight [E, hidden],
//              model.layers.N.block_sparse_moe.experts.E.{w1,w3}.weight [I, hidden], .w2.weight [hidden, I]
//   Qwen3-MoE  model.layers.N.mlp.gate.weight, model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
//              (a dense model.layers.N.mlp.{gate,up,down}_proj on mlp_only_layers and off
//              decoder_sparse_step), model.layers.N.self_attn.{q,k}_norm.weight [head_dim]
// and the Llama family's attention, RMSNorm, rotary embeddings and embeddings (models/llama/llama.h).
//
// The router as transformers 5.x computes it: softmax of the router logits in float32, top k,
// renormalised (Mixtral always, Qwen3 with norm_topk_prob), dropless (every token reaches its k
// experts). Each expert's tokens are grouped (group_tokens: a stable sort by expert), run through
// the expert in one matmul per projection, and combined back weighted (combine: index_add). The
// load-balancing loss is transformers' load_balancing_loss_func over every sparse layer's router
// logits; loss() adds router_aux_loss_coef times it, as transformers does with
// output_router_logits=True. Logits and loss match transformers' within float32 rounding
// (tests/models/test_moe_hf.cpp).
//
// Expert parallelism: c.set_expert_parallel(mesh) before building (moe_config.h); docs/moe.md.
//
// Example (sharded as the Llama family is):
//   auto c = read_moe_config(dir);                 // models/moe/hf_moe.h
//   c.base.device = torch::kMeta;
//   MoECausalLM model(c);
//   for (auto& layer : model->layers()) fsdp::fully_shard(layer);   // experts: ordinary parameters
//   fsdp::fully_shard(model);
//   fsdp::to_empty(*model, torch::kCPU);
//   load_moe_weights(*model, dir);
//   auto logits = fsdp::call(model, tokens);
//   auto loss = model->loss(logits.narrow(1, 0, T - 1), tokens.narrow(1, 1, T - 1));  // LM + aux
#include <torch/torch.h>

#include <vector>

#include "models/llama/llama.h"
#include "models/moe/moe_config.h"

namespace fsdp::models {

// Tokens grouped by the expert they go to: the shape expert parallelism's dispatch and combine
// (fsdp::ep) exchange between ranks.
struct Grouped {
  at::Tensor tokens;                    // [N, D], N = T * k: expert 0's rows first, then expert 1's, ...
  at::Tensor counts;                    // [E] int64: rows per expert
  at::Tensor token_index;               // [N] int64: the token (row of hidden) each row copies
  at::Tensor slot;                      // [N] int64: its choice in the flattened [T, k] top-k (t * k + j)
  std::vector<int64_t> splits() const;  // counts as integers
};
// hidden [T, D], topk_idx [T, k] int64 expert indices in 0..num_experts-1.
Grouped group_tokens(const at::Tensor& hidden, const at::Tensor& topk_idx, int64_t num_experts);
// expert_out [N, D] in group_tokens' order, topk_weight [T, k] -> [T, D]: each token the sum of
// its experts' outputs times their weights (in expert order, as transformers adds them).
at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& topk_weight, const Grouped& grouped);

// The router's decision for T tokens.
struct Routing {
  at::Tensor logits;   // [T, E] in the activations' dtype
  at::Tensor weights;  // [T, k]: float32 (Mixtral) or the logits' dtype (Qwen3), as transformers
  at::Tensor indices;  // [T, k] int64
};
Routing route(const at::Tensor& logits, int64_t top_k, bool renormalise, bool weights_in_float32);

// transformers' load_balancing_loss_func (no attention mask): router logits of every sparse layer.
at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts, int64_t top_k);

// down(silu(gate(x)) * up(x)), registered under Mixtral's (w1, w3, w2) or Qwen3's names.
struct MoEExpertImpl : torch::nn::Module {
  MoEExpertImpl(const MoEConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate{nullptr}, up{nullptr}, down{nullptr};
};
TORCH_MODULE(MoEExpert);

// The experts this process holds, children named by their GLOBAL index ("first".."first+count-1").
struct MoEExpertsImpl : torch::nn::Module {
  explicit MoEExpertsImpl(const MoEConfig& c);
  int64_t first = 0;
  std::vector<MoEExpert> local;  // local[i] is expert first + i
};
TORCH_MODULE(MoEExperts);

// Router ("gate") and experts: Mixtral's block_sparse_moe, Qwen3's sparse mlp. Under expert
// parallelism (MoEConfig::set_expert_parallel) it holds its ep rank's experts, and forward is
// collective over the ep group: fsdp::ep::dispatch sends each token to its experts' ranks,
// run_experts runs the local ones, fsdp::ep::combine brings the outputs back (autograd through
// both). The router is dense (every rank holds it) and the routing and auxiliary loss are unchanged.
struct SparseMoeBlockImpl : torch::nn::Module {
  explicit SparseMoeBlockImpl(const MoEConfig& c);
  // x [B, T, D] -> [B, T, D]; keeps router_logits [B*T, E] for the auxiliary loss.
  torch::Tensor forward(const torch::Tensor& x);
  // Rows grouped by local expert (counts[i] rows for local expert i, in order: group_tokens' or
  // fsdp::ep::dispatch's) through the local experts, one matmul per projection each (every local
  // expert runs, on zero rows too, so each has a gradient).
  torch::Tensor run_experts(const at::Tensor& rows, const std::vector<int64_t>& counts);
  Linear gate{nullptr};
  MoEExperts experts{nullptr};
  std::shared_ptr<fsdp::comm::Comm> ep;  // MoEConfig::ep when of size > 1: tokens go through fsdp::ep
  int64_t num_experts, top_k;
  bool renormalise, weights_in_float32;
  torch::Tensor router_logits;  // from the last forward
};
TORCH_MODULE(SparseMoeBlock);

// Pre-norm attention and MLP (sparse, or dense on Qwen3's dense layers), each with its residual.
struct MoEDecoderLayerImpl : torch::nn::Module {
  MoEDecoderLayerImpl(const MoEConfig& c, int64_t index);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  LlamaAttention self_attn{nullptr};
  SparseMoeBlock moe{nullptr};  // "block_sparse_moe" (Mixtral) or "mlp" (Qwen3); null on a dense layer
  LlamaMLP mlp{nullptr};        // Qwen3's dense layers ("mlp")
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(MoEDecoderLayer);

// transformers' MixtralModel / Qwen3MoeModel: the Llama family's decoder stack (llama.h) on these layers.
struct MoEModelImpl : DecoderModelImpl<MoEDecoderLayer> {
  explicit MoEModelImpl(const MoEConfig& c);
};
TORCH_MODULE(MoEModel);

struct MoECausalLMImpl : torch::nn::Module {
  explicit MoECausalLMImpl(const MoEConfig& c);
  // idx [B, T] int64 -> logits [B, T, vocab].
  torch::Tensor forward(const torch::Tensor& idx);
  torch::Tensor encode(const torch::Tensor& idx);
  // The last forward's load-balancing loss (transformers' aux_loss), over its sparse layers.
  torch::Tensor aux_loss() const;
  // Mean cross-entropy of logits [B, T, V] against targets [B, T] plus router_aux_loss_coef x
  // aux_loss(): transformers' loss with output_router_logits=True (its logits and labels shifted).
  torch::Tensor loss(const torch::Tensor& logits, const torch::Tensor& targets) const;
  // N(0, initializer_range) weights, unit norms, zero biases, per (init_seed, name, row) as Llama.
  void reset_parameters();
  std::vector<MoEDecoderLayer>& layers() { return model->layers; }

  MoEConfig config;
  MoEModel model{nullptr};
  Linear lm_head{nullptr};  // null when tie_word_embeddings
  torch::Tensor inv_freq;
};
TORCH_MODULE(MoECausalLM);

}  // namespace fsdp::models
