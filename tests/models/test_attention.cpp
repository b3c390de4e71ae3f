// The GPT's attention: LibTorch's fused scaled_dot_product_attention (2.x) and the written-out
// matmul / mask / softmax / matmul (1.13, or fused_attention = false) give the same outputs and
// gradients within fp32 rounding, and both match an independent float64 reference (a loop over
// query positions, each attending to the keys up to it: no mask, a hand-written softmax).
// The Llama's grouped-query attention: the fused op given the KV heads as they are (enable_gqa,
// 2.5+) against the written-out attention over repeated KV heads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>

#include "fsdp/compat/attention.h"
#include "fsdp/compat/c10d.h"  // FSDP_TORCH_AT_LEAST
#include "fsdp/compat/gqa_attention.h"
#include "models/gpt.h"
#include "models/llama/llama.h"

namespace {

using fsdp::models::CausalSelfAttention;
using fsdp::models::GPT;
using fsdp::models::GPTConfig;

GPTConfig small_config(bool fused) {
  GPTConfig c;
  c.vocab_size = 64;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.init_seed = 7;
  c.fused_attention = fused;
  return c;
}

// softmax(q k^T / sqrt(d)) v with query t seeing keys 0..t, in float64, one query row at a time.
torch::Tensor reference_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t T = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  std::vector<torch::Tensor> rows;
  for (int64_t t = 0; t < T; ++t) {
    auto kt = k.narrow(2, 0, t + 1), vt = v.narrow(2, 0, t + 1);
    auto s = torch::matmul(q.narrow(2, t, 1), kt.transpose(-2, -1)) * scale;  // [B, H, 1, t+1]
    auto e = (s - std::get<0>(s.max(-1, true)).detach()).exp();
    rows.push_back(torch::matmul(e / e.sum(-1, true), vt));
  }
  return torch::cat(rows, 2);
}

// The attention module's forward, recomputed in float64 from its own weights with the reference.
torch::Tensor reference_forward(CausalSelfAttention& attn, const torch::Tensor& x64) {
  const int64_t B = x64.size(0), T = x64.size(1), C = x64.size(2), H = attn->n_head;
  auto w = [](const torch::Tensor& p) { return p.detach().to(torch::kDouble).requires_grad_(true); };
  auto qkv = torch::nn::functional::linear(x64, w(attn->c_attn->weight), w(attn->c_attn->bias)).split(C, 2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, C / H}).transpose(1, 2); };
  auto y = reference_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2])).transpose(1, 2).reshape({B, T, C});
  return torch::nn::functional::linear(y, w(attn->c_proj->weight), w(attn->c_proj->bias));
}

void expect_close(const torch::Tensor& got, const torch::Tensor& want, double atol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max().item<double>();
  const double scale = want.abs().max().item<double>();
  EXPECT_LE(err, atol + 1e-5 * scale) << what << ": max abs difference " << err << " (values up to " << scale << ")";
}

// One attention module against the float64 reference: output, d/dx, and d/dW of both projections.
void check_module_against_reference(bool fused) {
  torch::manual_seed(3);
  GPTConfig c = small_config(fused);
  CausalSelfAttention attn(c);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : attn->parameters()) p.normal_(0.0, 0.3);  // larger than GPT's 0.02: a peaked softmax
  }
  ASSERT_EQ(attn->fused, fused && fsdp::compat::kHasFusedAttention);
  auto x = torch::randn({3, 11, c.n_embd}).requires_grad_(true);
  auto upstream = torch::randn({3, 11, c.n_embd});
  auto y = attn(x);
  (y * upstream).sum().backward();

  auto x64 = x.detach().to(torch::kDouble).requires_grad_(true);
  auto y64 = reference_forward(attn, x64);
  (y64 * upstream.to(torch::kDouble)).sum().backward();
  expect_close(y, y64, 1e-5, "output");
  expect_close(x.grad(), x64.grad(), 1e-5, "grad of the input");
  // The reference's weight gradients: recompute with leaves we keep.
  auto wa = attn->c_attn->weight.detach().to(torch::kDouble).requires_grad_(true);
  auto wp = attn->c_proj->weight.detach().to(torch::kDouble).requires_grad_(true);
  const int64_t B = 3, T = 11, C = c.n_embd, H = c.n_head;
  auto qkv =
      torch::nn::functional::linear(x64.detach(), wa, attn->c_attn->bias.detach().to(torch::kDouble)).split(C, 2);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, H, C / H}).transpose(1, 2); };
  auto att = reference_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2])).transpose(1, 2).reshape({B, T, C});
  auto out = torch::nn::functional::linear(att, wp, attn->c_proj->bias.detach().to(torch::kDouble));
  (out * upstream.to(torch::kDouble)).sum().backward();
  expect_close(attn->c_attn->weight.grad(), wa.grad(), 1e-5, "grad of c_attn.weight");
  expect_close(attn->c_proj->weight.grad(), wp.grad(), 1e-5, "grad of c_proj.weight");
}

TEST(Attention, DetectionFollowsTheLibTorchVersion) {
  // scaled_dot_product_attention arrived in 2.0; the feature test must find it there and only there.
  EXPECT_EQ(fsdp::compat::kHasFusedAttention, FSDP_TORCH_AT_LEAST(2, 0));
  if (!fsdp::compat::kHasFusedAttention) {
    auto t = torch::zeros({1, 1, 2, 2});
    EXPECT_THROW(fsdp::compat::fused_causal_attention(t, t, t), std::logic_error);
  }
}

TEST(Attention, GqaDetectionFollowsTheLibTorchVersion) {
  // enable_gqa arrived in 2.5; 2.0-2.4 have the fused op without it.
  EXPECT_EQ(fsdp::compat::kHasGqaFusedAttention, FSDP_TORCH_AT_LEAST(2, 5));
  if (!fsdp::compat::kHasGqaFusedAttention) {
    auto t = torch::zeros({1, 2, 2, 2});
    EXPECT_THROW(fsdp::compat::fused_causal_gqa_attention(t, t.narrow(1, 0, 1), t.narrow(1, 0, 1)), std::logic_error);
  }
}

// The Llama's attention with 6 query heads over 2 KV heads (each KV head serves 3 consecutive
// query heads, transformers' repeat_kv order): fused (on 2.5+ without repeating the KV heads)
// against written-out, same weights: output, d/dx and every projection's gradient (k_proj's and
// v_proj's sum over their 3 query heads). A kernel that paired query and KV heads in another
// order would fail every check.
TEST(Attention, LlamaGroupedQueryFusedMatchesWrittenOut) {
  fsdp::models::LlamaConfig c;
  c.hidden_size = 48;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;
  c.fused_attention = true;
  fsdp::models::LlamaAttention fused(c);
  c.fused_attention = false;
  fsdp::models::LlamaAttention written(c);
  EXPECT_EQ(fused->fused, fsdp::compat::kHasFusedAttention);
  EXPECT_FALSE(written->fused);
  torch::manual_seed(5);
  {
    torch::NoGradGuard no_grad;
    auto pw = written->named_parameters();
    for (auto& item : fused->named_parameters()) {
      item.value().normal_(0.0, 0.3);  // a peaked softmax, as in check_module_against_reference
      pw[item.key()].copy_(item.value());
    }
  }
  const int64_t B = 3, T = 11;
  auto [cos, sin] = fsdp::models::rope_cos_sin(fsdp::models::rope_inv_freq(c), T);
  auto x = torch::randn({B, T, c.hidden_size});
  auto upstream = torch::randn({B, T, c.hidden_size});
  auto xf = x.clone().requires_grad_(true), xw = x.clone().requires_grad_(true);
  auto yf = fused(xf, cos, sin), yw = written(xw, cos, sin);
  (yf * upstream).sum().backward();
  (yw * upstream).sum().backward();
  expect_close(yf, yw, 1e-5, "output");
  expect_close(xf.grad(), xw.grad(), 1e-5, "grad of the input");
  auto pw = written->named_parameters();
  for (const auto& item : fused->named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined() && pw[item.key()].grad().defined()) << item.key();
    expect_close(item.value().grad(), pw[item.key()].grad(), 1e-5, "grad of " + item.key());
  }
}

TEST(Attention, WrittenOutMatchesAFloat64Reference) { check_module_against_reference(/*fused=*/false); }

TEST(Attention, FusedMatchesAFloat64Reference) {
  if (!fsdp::compat::kHasFusedAttention)
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " has no scaled_dot_product_attention";
  check_module_against_reference(/*fused=*/true);
}

// A whole GPT (same init seed) with fused_attention on and off: logits, loss and every gradient.
// On 1.13 "on" falls back to the written-out path, so there the two must be bit-identical.
TEST(Attention, FusedAndWrittenOutGptGiveTheSameLossAndGradients) {
  GPT fused(small_config(true)), written(small_config(false));
  EXPECT_EQ(fused->blocks[0]->attn->fused, fsdp::compat::kHasFusedAttention);
  EXPECT_FALSE(written->blocks[0]->attn->fused);
  torch::manual_seed(11);
  auto data = torch::randint(64, {4, 17}, torch::kLong);
  auto idx = data.narrow(1, 0, 16), targets = data.narrow(1, 1, 16);
  auto lf = fsdp::models::gpt_loss(fused(idx), targets);
  auto lw = fsdp::models::gpt_loss(written(idx), targets);
  lf.backward();
  lw.backward();
  EXPECT_NEAR(lf.item<double>(), lw.item<double>(), 1e-6);
  auto pf = fused->named_parameters(), pw = written->named_parameters();
  ASSERT_EQ(pf.size(), pw.size());
  for (const auto& item : pf) {
    const auto& gf = item.value().grad();
    const auto& gw = pw[item.key()].grad();
    ASSERT_TRUE(gf.defined() && gw.defined()) << item.key();
    if (fsdp::compat::kHasFusedAttention) {
      expect_close(gf, gw, 1e-6, item.key());
    } else {
      EXPECT_TRUE(torch::equal(gf, gw)) << item.key() << ": 1.13 must take the written-out path either way";
    }
  }
}

}  // namespace
