#include "models/gpt.h"

#include <cmath>
#include <stdexcept>

#include "fsdp/sharding/call.h"

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
  need(n_embd % n_head == 0, "n_head (" + std::to_string(n_head) + ") must divide n_embd (" + std::to_string(n_embd) + ")");
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& c) : n_head(c.n_head) {
  c_attn = register_module("c_attn", torch::nn::Linear(c.n_embd, 3 * c.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(c.n_embd, c.n_embd));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head;
  auto qkv = c_attn(x).split(C, /*dim=*/2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_head, hd}).transpose(1, 2); };
  auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
  auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
  auto causal = torch::ones({T, T}, x.options().dtype(torch::kBool)).tril();
  att = F::softmax(att.masked_fill(causal.logical_not(), -INFINITY), F::SoftmaxFuncOptions(-1));
  auto y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
  return c_proj(y);
}

MLPImpl::MLPImpl(const GPTConfig& c) {
  c_fc = register_module("c_fc", torch::nn::Linear(c.n_embd, 4 * c.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * c.n_embd, c.n_embd));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) { return c_proj(torch::gelu(c_fc(x), "tanh")); }

BlockImpl::BlockImpl(const GPTConfig& c) {
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  attn = register_module("attn", CausalSelfAttention(c));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  mlp = register_module("mlp", MLP(c));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
  auto y = x + attn(ln_1(x));
  return y + mlp(ln_2(y));
}

HeadImpl::HeadImpl(int64_t n_embd, int64_t vocab_size, const torch::Tensor& tied_weight) {
  weight = register_parameter("weight", tied_weight.defined() ? tied_weight : torch::empty({vocab_size, n_embd}));
}

torch::Tensor HeadImpl::forward(const torch::Tensor& x) { return F::linear(x, weight); }

GPTImpl::GPTImpl(const GPTConfig& c) : config(c) {
  c.validate();
  wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(c.block_size, c.n_embd));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layer; ++i) {
    blocks.emplace_back(c);
    h->push_back(blocks.back());
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.n_embd})));
  lm_head = register_module("lm_head", Head(c.n_embd, c.vocab_size, c.tie_weights ? wte->weight : torch::Tensor()));
  reset_parameters();
}

void GPTImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (auto& m : modules(/*include_self=*/false)) {
    if (auto* linear = m->as<torch::nn::Linear>()) {
      linear->weight.normal_(0.0, 0.02);
      if (linear->bias.defined()) linear->bias.zero_();
    } else if (auto* emb = m->as<torch::nn::Embedding>()) {
      emb->weight.normal_(0.0, 0.02);
    } else if (auto* head = m->as<Head>()) {
      if (!config.tie_weights) head->weight.normal_(0.0, 0.02);
    } else if (auto* ln = m->as<torch::nn::LayerNorm>()) {
      ln->weight.fill_(1.0);
      ln->bias.zero_();
    }
  }
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  const int64_t T = idx.size(1);
  if (T > config.block_size) {
    throw std::invalid_argument("GPT: sequence length " + std::to_string(T) + " exceeds block_size " +
                                std::to_string(config.block_size));
  }
  auto pos = torch::arange(T, idx.options().dtype(torch::kLong));
  auto x = wte(idx) + wpe(pos);
  for (auto& block : blocks) x = fsdp::call(block, x);
  return lm_head(ln_f(x));
}

torch::Tensor gpt_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  return F::cross_entropy(logits.view({-1, logits.size(-1)}), targets.reshape(-1));
}

}  // namespace fsdp::models
