#pragma once
// A Llama-family decoder (Llama 2/3, Mistral without a sliding window, Qwen2) in plain LibTorch,
// with Hugging Face's module tree, so its parameter names are transformers' own and a checkpoint
// maps one to one: model.embed_tokens.weight, model.layers.N.self_attn.{q,k,v,o}_proj.weight
// (+ .bias), model.layers.N.mlp.{gate,up,down}_proj.weight, model.layers.N.{input,
// post_attention}_layernorm.weight, model.norm.weight, lm_head.weight (absent when
// tie_word_embeddings: the head then multiplies by model.embed_tokens.weight).
//
// The numerics follow transformers' LlamaForCausalLM step for step (RMSNorm in float32, rotary
// embeddings by rotate_half with llama3 frequency scaling, grouped-query attention by repeating
// KV heads, or on LibTorch 2.5+ by the fused kernel reading each KV head for its query heads as
// transformers' sdpa path does, SwiGLU), so logits match within float32 rounding
// (tests/models/test_llama_hf.cpp).
//
// Example (the GPT's recipe, models/gpt.h):
//   auto c = LlamaConfig::from_file(dir + "/config.json");
//   c.device = torch::kMeta;
//   Llama model(c);
//   for (auto& layer : model->layers()) fsdp::fully_shard(layer);
//   fsdp::fully_shard(model);
//   fsdp::to_empty(*model, torch::kCPU);
//   load_hf_weights(*model, dir);          // or model->reset_parameters() for a run from scratch
//   auto logits = fsdp::call(model, tokens);
// With tied embeddings keep model.embed_tokens in the root's group (as above): the head reads its
// weight during the root's forward.
#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/sharding/call.h"
#include "models/gpt.h"
#include "models/llama/llama_config.h"

namespace fsdp::models {

// x / sqrt(mean(x^2) + eps) * weight, computed in float32 as transformers does.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int64_t dim, double eps, torch::Device device);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
  double eps;
};
TORCH_MODULE(RMSNorm);

// The rotary inverse frequencies (transformers' _compute_default_rope_parameters and
// _compute_llama3_parameters, float32). Not a parameter or buffer: derived from the config, so
// checkpoints and exports leave it out (transformers' inv_freq is not persistent either).
torch::Tensor rope_inv_freq(const LlamaConfig& c);
// cos and sin [T, head_dim] for positions 0..T-1 (transformers' LlamaRotaryEmbedding).
std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& inv_freq, int64_t T);

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& c);
  // x [B, T, hidden], cos/sin [T, head_dim]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  RMSNorm q_norm{nullptr}, k_norm{nullptr};  // config.qk_norm only (Qwen3): per head, before the rotation
  int64_t head_dim, heads, kv_heads;
  bool fused = false;  // config.fused_attention && this LibTorch has the fused op
};
TORCH_MODULE(LlamaAttention);

// down(silu(gate(x)) * up(x))
struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const LlamaConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

// The unit fully_shard wraps: pre-norm attention and MLP, each with its residual.
struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& c);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// The decoder stack of the Llama family and of the mixture-of-experts decoders (models/moe/moe.h),
// parameterised by the decoder layer: transformers' LlamaModel / MixtralModel / Qwen3MoeModel (the
// "model." prefix of every name but lm_head) and the steps from token ids to logits.
template <typename Layer>
struct DecoderModelImpl : torch::nn::Module {
  // Registers embed_tokens, layers (layer i built by make_layer(i)) and norm, in that order.
  template <typename MakeLayer>
  DecoderModelImpl(const LlamaConfig& c, MakeLayer make_layer);
  // idx [B, T] -> the final hidden states [B, T, hidden]: the embeddings, rotary cos/sin for
  // positions 0..T-1 (from inv_freq, in the activations' dtype), each layer, then norm. `who` names
  // the model in the refusal of a T over c.max_position_embeddings.
  torch::Tensor encode(const torch::Tensor& idx, const torch::Tensor& inv_freq, const LlamaConfig& c,
                       const std::string& who);
  // Hidden states -> logits through lm_head, or with lm_head null (tied) through the embedding's
  // weight, unsharded for the root's forward (keep embed_tokens in the root's group).
  torch::Tensor head(const torch::Tensor& h, Linear& lm_head);

  Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers_list{nullptr};  // registered as "layers"
  std::vector<Layer> layers;                   // the same modules, typed
  RMSNorm norm{nullptr};
};

// transformers' LlamaModel.
struct LlamaModelImpl : DecoderModelImpl<LlamaDecoderLayer> {
  explicit LlamaModelImpl(const LlamaConfig& c);
};
TORCH_MODULE(LlamaModel);

// Weights as transformers initialises a decoder: N(0, initializer_range), zero biases (names
// ending in "bias"), unit norms (names holding "norm."), drawn row by row from streams keyed by
// (init_seed, name, row) (fsdp::init), on whatever module.named_parameters() holds now: full
// tensors, or this rank's shards.
void reset_decoder_parameters(torch::nn::Module& module, const LlamaConfig& c);

struct LlamaImpl : torch::nn::Module {
  explicit LlamaImpl(const LlamaConfig& c);
  // idx: [B, T] int64 token ids -> logits [B, T, vocab] (float32 for float32 parameters)
  torch::Tensor forward(const torch::Tensor& idx);
  // The final hidden states [B, T, hidden] (after model.norm).
  torch::Tensor encode(const torch::Tensor& idx);
  // Weights as transformers initialises them: N(0, initializer_range), zero biases, unit norms,
  // drawn row by row from streams keyed by (init_seed, name, row) (fsdp::init), so a sharded
  // model gets exactly the unsharded model's values.
  void reset_parameters();
  // The decoder layers (the units to fully_shard one by one).
  std::vector<LlamaDecoderLayer>& layers() { return model->layers; }
  // The head's weight: lm_head.weight, or model.embed_tokens.weight when tied.
  const torch::Tensor& head_weight() const;

  LlamaConfig config;
  LlamaModel model{nullptr};
  Linear lm_head{nullptr};  // null when tie_word_embeddings
  torch::Tensor inv_freq;   // rope_inv_freq(config), CPU float32
};
TORCH_MODULE(Llama);

template <typename Layer>
template <typename MakeLayer>
DecoderModelImpl<Layer>::DecoderModelImpl(const LlamaConfig& c, MakeLayer make_layer) {
  embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.hidden_size, c.device));
  layers_list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    layers.push_back(make_layer(i));
    layers_list->push_back(layers.back());
  }
  norm = register_module("norm", RMSNorm(c.hidden_size, c.rms_norm_eps, c.device));
}

template <typename Layer>
torch::Tensor DecoderModelImpl<Layer>::encode(const torch::Tensor& idx, const torch::Tensor& inv_freq,
                                              const LlamaConfig& c, const std::string& who) {
  const int64_t T = idx.size(1);
  if (T > c.max_position_embeddings)
    throw std::invalid_argument(who + ": sequence length " + std::to_string(T) + " exceeds max_position_embeddings " +
                                std::to_string(c.max_position_embeddings));
  auto x = fsdp::call(embed_tokens, idx);
  auto [cos, sin] = rope_cos_sin(inv_freq.to(idx.device()), T);
  cos = cos.to(x.scalar_type());
  sin = sin.to(x.scalar_type());
  for (auto& layer : layers) x = fsdp::call(layer, x, cos, sin);
  return fsdp::call(norm, x);
}

template <typename Layer>
torch::Tensor DecoderModelImpl<Layer>::head(const torch::Tensor& h, Linear& lm_head) {
  return lm_head ? fsdp::call(lm_head, h) : torch::linear(h, embed_tokens->weight);
}

}  // namespace fsdp::models
