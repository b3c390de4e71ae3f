#include "models/gpt.h"

#include <cmath>
#include <stdexcept>

#include "fsdp/compat/attention.h"
#include "fsdp/sharding/call.h"
#include "fsdp/sharding/materialize.h"

namespace fsdp::models {

namespace F = torch::nn::functional;

void GPTConfig::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw std::invalid_argument("GPTConfig: " + what);
  };
  need(vocab_size > 0, "vocab_size must be positive");
  need(block_size > 0, "block_size must be positive");
  need(n_layer >= 0, "n_layer must not be negative");
  need(n_head > 0 && n_embd > 0, "n_head and n_embd must be positive");
  need(dropout >= 0.0 && dropout < 1.0, "dropout must be in [0, 1), got " + std::to_string(dropout));
  need(n_embd % n_head == 0,
       "n_head (" + std::to_string(n_head) + ") must divide n_embd (" + std::to_string(n_embd) + ")");
}

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias, torch::Device device) {
  weight = register_parameter("weight", torch::empty({out, in}, torch::TensorOptions().device(device)));
  if (with_bias) bias = register_parameter("bias", torch::empty({out}, torch::TensorOptions().device(device)));
}

// at::linear (what Python's F.linear calls): the bias is added inside the matrix multiply
// (addmm) for inputs of any rank. LibTorch's C++ F::linear does that only for 2-D inputs; for
// [B, T, C] it multiplies, then adds the bias in a second pass (and back again in backward).
torch::Tensor LinearImpl::forward(const torch::Tensor& x) { return torch::linear(x, weight, bias); }

EmbeddingImpl::EmbeddingImpl(int64_t num, int64_t dim, torch::Device device) {
  weight = register_parameter("weight", torch::empty({num, dim}, torch::TensorOptions().device(device)));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& idx) { return F::embedding(idx, weight); }

LayerNormImpl::LayerNormImpl(int64_t dim, torch::Device device) {
  weight = register_parameter("weight", torch::empty({dim}, torch::TensorOptions().device(device)));
  bias = register_parameter("bias", torch::empty({dim}, torch::TensorOptions().device(device)));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  return torch::layer_norm(x, {weight.size(0)}, weight, bias, 1e-5);
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& c)
    : n_head(c.n_head), fused(c.fused_attention && fsdp::compat::kHasFusedAttention) {
  c_attn = register_module("c_attn", Linear(c.n_embd, 3 * c.n_embd, true, c.device));
  c_proj = register_module("c_proj", Linear(c.n_embd, c.n_embd, true, c.device));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  // The linears go through fsdp::call (exactly forward unless tensor parallelism styled them:
  // models/gpt_tp.h). Under TP c_attn gives this rank's [q | k | v] heads only: the local width
  // Cl = its output / 3 (C without TP) and the local head count Cl / head_dim.
  const int64_t B = x.size(0), T = x.size(1), hd = x.size(2) / n_head;
  auto qkv_all = fsdp::call(c_attn, x);
  const int64_t C = qkv_all.size(2) / 3, heads_here = C / hd;
  auto qkv = qkv_all.split(C, /*dim=*/2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, heads_here, hd}).transpose(1, 2); };
  auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  if (fused)
    return fsdp::call(c_proj,
                      fsdp::compat::fused_causal_attention(q, k, v).transpose(1, 2).contiguous().view({B, T, C}));
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  auto causal = torch::ones({T, T}, x.options().dtype(torch::kBool)).tril();
  att = F::softmax(att.masked_fill(causal.logical_not(), -INFINITY), F::SoftmaxFuncOptions(-1));
  auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
  return fsdp::call(c_proj, y);
}

MLPImpl::MLPImpl(const GPTConfig& c) {
  c_fc = register_module("c_fc", Linear(c.n_embd, 4 * c.n_embd, true, c.device));
  c_proj = register_module("c_proj", Linear(4 * c.n_embd, c.n_embd, true, c.device));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  return fsdp::call(c_proj, torch::gelu(fsdp::call(c_fc, x), "tanh"));
}

BlockImpl::BlockImpl(const GPTConfig& c) : dropout(c.dropout) {
  ln_1 = register_module("ln_1", LayerNorm(c.n_embd, c.device));
  attn = register_module("attn", CausalSelfAttention(c));
  ln_2 = register_module("ln_2", LayerNorm(c.n_embd, c.device));
  mlp = register_module("mlp", MLP(c));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  auto drop = [&](const torch::Tensor& t) {
    return dropout > 0.0 ? F::dropout(t, F::DropoutFuncOptions().p(dropout).training(is_training())) : t;
  };
  auto y = x + drop(attn(ln_1(x)));
  return y + drop(mlp(ln_2(y)));
}

HeadImpl::HeadImpl(int64_t n_embd, int64_t vocab_size, torch::Device device, const torch::Tensor& tied_weight) {
  weight = register_parameter(
      "weight",
      tied_weight.defined() ? tied_weight : torch::empty({vocab_size, n_embd}, torch::TensorOptions().device(device)));
}

torch::Tensor HeadImpl::forward(const torch::Tensor& x) { return F::linear(x, weight); }

GPTImpl::GPTImpl(const GPTConfig& c) : config(c) {
  c.validate();
  wte = register_module("wte", Embedding(c.vocab_size, c.n_embd, c.device));
  wpe = register_module("wpe", Embedding(c.block_size, c.n_embd, c.device));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    blocks.emplace_back(c);
    h->push_back(blocks.back());
  }
  ln_f = register_module("ln_f", LayerNorm(c.n_embd, c.device));
  lm_head =
      register_module("lm_head", Head(c.n_embd, c.vocab_size, c.device, c.tie_weights ? wte->weight : torch::Tensor()));
  if (c.device.type() != torch::kMeta) reset_parameters();
}

void GPTImpl::reset_parameters() {
  // By name, on whatever parameters() holds now: full tensors, or this rank's shards.
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    const at::Tensor& p = item.value();
    const uint64_t seed = fsdp::init::param_seed(config.init_seed, name);
    const bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    const bool is_norm = name.find("ln_") != std::string::npos;
    if (is_bias)
      fsdp::init::constant_(p, 0.0);
    else if (is_norm)
      fsdp::init::constant_(p, 1.0);
    else
      fsdp::init::normal_(p, 0.0, 0.02, seed);
  }
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  // Through fsdp::call, so ln_f and lm_head may be sharded as groups of their own.
  return fsdp::call(lm_head, encode(idx));
}

torch::Tensor GPTImpl::next_token_logits(const torch::Tensor& idx) { return forward(idx).select(1, -1); }

torch::Tensor GPTImpl::encode(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  if (T > config.block_size) {
    throw std::invalid_argument("GPT: sequence length " + std::to_string(T) + " exceeds block_size " +
                                std::to_string(config.block_size));
  }
  auto pos = torch::arange(T, idx.options().dtype(torch::kLong));
  // Through fsdp::call, so the embeddings may be sharded as a group of their own.
  auto x = fsdp::call(wte, idx) + fsdp::call(wpe, pos);
  for (auto& block : blocks) x = fsdp::call(block, x);
  return fsdp::call(ln_f, x);
}

torch::Tensor gpt_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return F::cross_entropy(logits.view({-1, logits.size(-1)}), targets.reshape(-1));
}

}  // namespace fsdp::models
