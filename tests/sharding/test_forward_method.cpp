// Forward methods (fsdp/sharding/forward_method.h, FSDP2's register_fsdp_forward_method): a
// sharded GPT's encode and next_token_logits, entered through fsdp::call_method at 2 ranks, give
// the unsharded model's results, leave every parameter resharded under no-grad, and with grad
// enabled their gradients are reduce-scattered like forward's.
#include <gtest/gtest.h>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
using fsdp::models::GPT;
using fsdp::models::GPTImpl;

namespace {

// The unsharded parameters the modules compute with: zero elements while resharded.
int64_t unsharded_elements(GPT& m) {
  int64_t n = m->wte->weight.numel() + m->wpe->weight.numel() + m->ln_f->weight.numel() + m->lm_head->weight.numel();
  for (auto& b : m->blocks)
    n += b->attn->c_attn->weight.numel() + b->mlp->c_fc->weight.numel() + b->ln_1->weight.numel();
  return n;
}

void check_close(const at::Tensor& got, const at::Tensor& want, const char* what) {
  TORCH_CHECK(got.sizes() == want.sizes(), what, ": shape ", got.sizes(), " vs ", want.sizes());
  const double diff = (got - want).abs().max().item<double>();
  TORCH_CHECK(diff <= 1e-5, what, " differs from the unsharded model by ", diff);
}

}  // namespace

FSDP_RANK_WORKER(forward_methods_match_unsharded) {
  const auto c = uneven_config();
  auto reference = parity_model(c);
  auto model = parity_model(c);
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  const at::Tensor tokens = global_batch(c, 3, 0, 0).narrow(1, 0, c.block_size);  // the same on every rank

  {
    torch::NoGradGuard no_grad;
    const at::Tensor h = fsdp::call_method(model, &GPTImpl::encode, tokens);
    check_close(h, reference->encode(tokens), "encode");
    TORCH_CHECK(unsharded_elements(model) == 0, "parameters left unsharded after encode: ", unsharded_elements(model));
    auto next_logits = fsdp::register_fsdp_forward_method(model, &GPTImpl::next_token_logits);
    for (int i = 0; i < 2; ++i) {  // twice: the registered callable is reusable
      check_close(next_logits(tokens), reference->next_token_logits(tokens), "next_token_logits");
      TORCH_CHECK(unsharded_elements(model) == 0, "parameters left unsharded after next_token_logits");
    }
    // forward through fsdp::call still works between methods.
    check_close(fsdp::call(model, tokens), reference->forward(tokens), "forward");
    fsdp::fsdp_module(*model)->reshard();  // a plain forward keeps the root gathered (for backward)
  }

  // With grad: the method's backward reduce-scatters gradients; every rank saw the same tokens, so
  // each shard's gradient is its rows of the unsharded model's gradient.
  fsdp::call_method(model, &GPTImpl::encode, tokens).pow(2).mean().backward();
  reference->encode(tokens).pow(2).mean().backward();
  auto ref_params = reference->named_parameters();
  int with_grad = 0;
  for (const auto& p : model->named_parameters()) {
    const at::Tensor& want_full = ref_params[p.key()].grad();
    if (!want_full.defined()) {
      TORCH_CHECK(!p.value().grad().defined() || p.value().grad().abs().max().item<double>() == 0, p.key());
      continue;
    }
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " not sharded");
    if (info->local_rows == 0) continue;
    TORCH_CHECK(p.value().grad().defined(), p.key(), " got no gradient through encode");
    check_close(p.value().grad(), want_full.narrow(0, info->dim0_offset, info->local_rows), p.key().c_str());
    ++with_grad;
  }
  TORCH_CHECK(with_grad > 5, "only ", with_grad, " parameters had gradients");
  TORCH_CHECK(unsharded_elements(model) == 0, "parameters left unsharded after backward");
}

TEST(ForwardMethod, ExtraMethodsGiveTheUnshardedResultAndReshard) {
  RanksOptions o;
  o.timeout = std::chrono::seconds(180);
  EXPECT_RANKS_PASS(2, "forward_methods_match_unsharded", o);
}
