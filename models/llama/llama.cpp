#include "models/llama/llama.h"

#include <cmath>
#include <numbers>
#include <stdexcept>

#include "fsdp/compat/attention.h"
#include "fsdp/compat/gqa_attention.h"
#include "fsdp/sharding/call.h"
#include "fsdp/sharding/materialize.h"

namespace fsdp::models {

namespace F = torch::nn::functional;

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_, torch::Device device) : eps(eps_) {
  weight = register_parameter("weight", torch::empty({dim}, torch::TensorOptions().device(device)));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // In float32 whatever the activations' dtype, as transformers' LlamaRMSNorm.
  auto h = x.to(torch::kFloat);
  h = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * h.to(x.scalar_type());
}

torch::Tensor rope_inv_freq(const LlamaConfig& c) {
  // Every step in float32 with the same operation order as transformers, so the frequencies (and
  // with them the logits) agree to the last bit rather than to float32 rounding of a different path.
  const int64_t dim = c.resolved_head_dim();
  auto exponents = torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / static_cast<double>(dim);
  auto inv_freq = 1.0 / torch::pow(c.rope_theta, exponents);
  if (c.rope_type != "llama3") return inv_freq;
  const double factor = c.rope_factor, low = c.rope_low_freq_factor, high = c.rope_high_freq_factor;
  const double old_len = static_cast<double>(c.rope_original_max_position_embeddings);
  const double low_freq_wavelen = old_len / low, high_freq_wavelen = old_len / high;
  auto wavelen = 2 * std::numbers::pi / inv_freq;
  // Long wavelengths (low frequencies) slowed by `factor`, short ones kept, those between blended.
  auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  auto smooth = (old_len / wavelen - low) / (high - low);
  auto smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  auto medium = (wavelen < high_freq_wavelen).logical_not() * (wavelen > low_freq_wavelen).logical_not();
  return torch::where(medium, smoothed, scaled);
}

std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& inv_freq, int64_t T) {
  auto positions = torch::arange(T, inv_freq.options().dtype(torch::kLong)).to(torch::kFloat);
  auto freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, head_dim / 2]
  auto emb = torch::cat({freqs, freqs}, -1);                    // [T, head_dim]
  return {emb.cos(), emb.sin()};
}

namespace {

// transformers' rotate_half: [x1, x2] -> [-x2, x1] over the last dimension's halves.
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

// [B, kv, T, d] -> [B, kv * n_rep, T, d], each KV head repeated n_rep times in place (repeat_kv).
torch::Tensor repeat_kv(const torch::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t B = x.size(0), kv = x.size(1), T = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({B, kv, n_rep, T, d}).reshape({B, kv * n_rep, T, d});
}

}  // namespace

LlamaAttentionImpl::LlamaAttentionImpl(const LlamaConfig& c)
    : head_dim(c.resolved_head_dim()),
      heads(c.num_attention_heads),
      kv_heads(c.num_key_value_heads),
      fused(c.fused_attention && fsdp::compat::kHasFusedAttention) {
  const int64_t H = c.hidden_size, d = head_dim;
  q_proj = register_module("q_proj", Linear(H, heads * d, c.qkv_bias(), c.device));
  k_proj = register_module("k_proj", Linear(H, kv_heads * d, c.qkv_bias(), c.device));
  v_proj = register_module("v_proj", Linear(H, kv_heads * d, c.qkv_bias(), c.device));
  o_proj = register_module("o_proj", Linear(heads * d, H, c.o_bias(), c.device));
  if (c.qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(d, c.rms_norm_eps, c.device));
    k_norm = register_module("k_norm", RMSNorm(d, c.rms_norm_eps, c.device));
  }
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  // Head counts from the projections' widths: under tensor parallelism each rank holds a slice
  // of the heads (and of the KV heads, in the same proportion).
  const int64_t B = x.size(0), T = x.size(1), d = head_dim;
  auto heads_of = [&](const torch::Tensor& t) { return t.view({B, T, t.size(2) / d, d}).transpose(1, 2); };
  auto q = heads_of(fsdp::call(q_proj, x));
  auto k = heads_of(fsdp::call(k_proj, x));
  if (q_norm) {  // over head_dim, as transformers' Qwen3 before its transpose
    q = fsdp::call(q_norm, q);
    k = fsdp::call(k_norm, k);
  }
  q = apply_rope(q, cos, sin);
  k = apply_rope(k, cos, sin);
  auto v = heads_of(fsdp::call(v_proj, x));
  const int64_t n_rep = q.size(1) / k.size(1);
  torch::Tensor y;
  if (fused && fsdp::compat::kHasGqaFusedAttention) {
    // The kernel maps each query head to its KV head: no repeated copy of k and v, and their
    // gradients are summed over the group inside the kernel (transformers' sdpa path without a mask).
    y = fsdp::compat::fused_causal_gqa_attention(q, k, v);
  } else if (fused) {
    y = fsdp::compat::fused_causal_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep));
  } else {
    k = repeat_kv(k, n_rep);
    v = repeat_kv(v, n_rep);
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
    auto causal = torch::ones({T, T}, x.options().dtype(torch::kBool)).tril();
    att = F::softmax(att.masked_fill(causal.logical_not(), -INFINITY), F::SoftmaxFuncOptions(-1).dtype(torch::kFloat))
              .to(q.scalar_type());
    y = torch::matmul(att, v);
  }
  return fsdp::call(o_proj, y.transpose(1, 2).contiguous().view({B, T, q.size(1) * d}));
}

LlamaMLPImpl::LlamaMLPImpl(const LlamaConfig& c) {
  gate_proj = register_module("gate_proj", Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, c.device));
  up_proj = register_module("up_proj", Linear(c.hidden_size, c.intermediate_size, c.mlp_bias, c.device));
  down_proj = register_module("down_proj", Linear(c.intermediate_size, c.hidden_size, c.mlp_bias, c.device));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  return fsdp::call(down_proj, F::silu(fsdp::call(gate_proj, x)) * fsdp::call(up_proj, x));
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const LlamaConfig& c) {
  self_attn = register_module("self_attn", LlamaAttention(c));
  mlp = register_module("mlp", LlamaMLP(c));
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, c.device));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps, c.device));
}

torch::Tensor LlamaDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos,
                                             const torch::Tensor& sin) {
  // Through fsdp::call, so that a tensor-parallel plan's hooks run (llama_tp.h: the norms under
  // sequence parallelism, the attention and the MLP gathering their input).
  auto h = x + fsdp::call(self_attn, fsdp::call(input_layernorm, x), cos, sin);
  return h + fsdp::call(mlp, fsdp::call(post_attention_layernorm, h));
}

LlamaModelImpl::LlamaModelImpl(const LlamaConfig& c)
    : DecoderModelImpl(c, [&c](int64_t) { return LlamaDecoderLayer(c); }) {}

void reset_decoder_parameters(torch::nn::Module& module, const LlamaConfig& c) {
  for (const auto& item : module.named_parameters()) {
    const std::string& name = item.key();
    const at::Tensor& p = item.value();
    const bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    const bool is_norm = name.find("norm.") != std::string::npos;  // *_layernorm.weight, model.norm.weight
    if (is_bias)
      fsdp::init::constant_(p, 0.0);
    else if (is_norm)
      fsdp::init::constant_(p, 1.0);
    else
      fsdp::init::normal_(p, 0.0, c.initializer_range, fsdp::init::param_seed(c.init_seed, name));
  }
}

LlamaImpl::LlamaImpl(const LlamaConfig& c) : config(c) {
  c.validate();
  model = register_module("model", LlamaModel(c));
  if (!c.tie_word_embeddings)
    lm_head = register_module("lm_head", Linear(c.hidden_size, c.vocab_size, false, c.device));
  inv_freq = rope_inv_freq(c);
  if (c.device.type() != torch::kMeta) reset_parameters();
}

const torch::Tensor& LlamaImpl::head_weight() const { return lm_head ? lm_head->weight : model->embed_tokens->weight; }

void LlamaImpl::reset_parameters() { reset_decoder_parameters(*this, config); }

torch::Tensor LlamaImpl::encode(const torch::Tensor& idx) { return model->encode(idx, inv_freq, config, "Llama"); }

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx) { return model->head(encode(idx), lm_head); }

}  // namespace fsdp::models
