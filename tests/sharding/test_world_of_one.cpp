// fully_shard in a world of one (FSDP's own cost near zero). With nothing to gather,
// each unsharded parameter is its shard's memory, not a copy: unshard allocates and copies nothing,
// forward reads what the optimizer wrote, and training equals plain LibTorch bit for bit. Where
// the unsharded parameter needs another dtype (mixed precision), it is still a copy.
#include <ATen/record_function.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "fsdp/debug/buffer_pool.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "op_counts.h"

using fsdp::models::GPT;

namespace {

fsdp::models::GPTConfig small() {
  fsdp::models::GPTConfig c;
  c.vocab_size = 17;
  c.block_size = 6;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

at::Tensor batch(int step) {
  auto gen = at::detail::createCPUGenerator(100 + step);
  return at::randint(17, {3, 7}, gen, at::kLong);
}

// (unsharded field, shard) of a block's c_attn weight.
std::pair<at::Tensor, at::Tensor> attn_weight(GPT& model) {
  auto& lin = model->blocks[0]->attn->c_attn;
  return {lin->weight, lin->named_parameters(false)["weight"]};
}

}  // namespace

TEST(WorldOfOne, UnshardedParametersAreTheShardsMemory) {
  GPT model(small());
  auto unit = fsdp::fully_shard(model->blocks[0]);
  fsdp::fully_shard(model);
  auto [field, shard] = attn_weight(model);
  ASSERT_FALSE(field.is_same(shard));  // two tensors: the module's field and the registered shard
  EXPECT_EQ(field.numel(), 0);         // resharded: no memory
  fsdp::reset_buffer_memory_peak();
  unit.unshard();
  EXPECT_EQ(field.sizes(), shard.sizes());
  EXPECT_EQ(field.data_ptr(), shard.data_ptr()) << "the unsharded parameter is a copy of the shard";
  // An in-place update of the shard (what the optimizer does) is what forward reads.
  {
    torch::NoGradGuard no_grad;
    shard.add_(1.0);
  }
  EXPECT_TRUE(field.equal(shard));
  const at::Tensor values = shard.detach().clone();
  unit.reshard();
  EXPECT_EQ(field.numel(), 0);
  EXPECT_TRUE(shard.equal(values));  // resharding frees the alias, never the shard
  EXPECT_EQ(fsdp::buffer_memory_stats().peak, 0u) << "a world of one allocated FSDP buffers";
}

TEST(WorldOfOne, TrainsExactlyAsPlainLibTorch) {
  auto c = small();
  GPT plain(c), sharded(c);
  {
    torch::NoGradGuard no_grad;
    auto src = plain->named_parameters();
    for (auto& p : sharded->named_parameters()) p.value().copy_(src[p.key()]);
  }
  for (auto& b : sharded->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(sharded);
  torch::optim::AdamW opt_plain(plain->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt_sharded(sharded->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int s = 0; s < 4; ++s) {
    auto data = batch(s);
    auto input = data.narrow(1, 0, 6), target = data.narrow(1, 1, 6);
    opt_plain.zero_grad();
    opt_sharded.zero_grad();
    auto lp = fsdp::models::gpt_loss(plain->forward(input), target);
    auto ls = fsdp::models::gpt_loss(fsdp::call(sharded, input), target);
    lp.backward();
    ls.backward();
    opt_plain.step();
    opt_sharded.step();
    EXPECT_EQ(lp.item<double>(), ls.item<double>()) << "step " << s;
  }
  auto want = plain->named_parameters();
  for (auto& p : sharded->named_parameters()) EXPECT_TRUE(p.value().equal(want[p.key()])) << p.key();
}

TEST(WorldOfOne, MixedPrecisionStillCopies) {
  GPT model(small());
  fsdp::FullyShardOptions opts;
  opts.mp_policy.param_dtype = at::kBFloat16;
  auto unit = fsdp::fully_shard(model->blocks[0], opts);
  fsdp::fully_shard(model, opts);
  unit.unshard();
  auto [field, shard] = attn_weight(model);
  EXPECT_EQ(field.scalar_type(), at::kBFloat16);
  EXPECT_NE(field.data_ptr(), shard.data_ptr());
  EXPECT_TRUE(field.equal(shard.to(at::kBFloat16)));
  unit.reshard();
  EXPECT_EQ(field.numel(), 0);
}

namespace {

using fsdp::testing::TopLevelOps;

// A training step of plain LibTorch and of the same GPT through fully_shard (per block and the
// root, `options`) in a world of one, from the same values on the same tokens, three steps each;
// returns the top-level operators of step 2 that the sharded side issued more (or fewer) than
// plain, and sets `equal_losses`.
std::map<std::string, int64_t> extra_ops(const fsdp::FullyShardOptions& options, int64_t n_layer, bool& equal_losses) {
  auto c = small();
  c.n_layer = n_layer;
  GPT plain(c), sharded(c);
  {
    torch::NoGradGuard no_grad;
    auto src = plain->named_parameters();
    for (auto& p : sharded->named_parameters()) p.value().copy_(src[p.key()]);
  }
  for (auto& b : sharded->blocks) fsdp::fully_shard(b, options);
  fsdp::fully_shard(sharded, options);
  torch::optim::AdamW opt_plain(plain->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt_sharded(sharded->parameters(), torch::optim::AdamWOptions(1e-2));
  auto step = [](GPT& model, torch::optim::Optimizer& opt, const at::Tensor& data, bool through_fsdp) {
    opt.zero_grad();
    auto input = data.narrow(1, 0, 6), target = data.narrow(1, 1, 6);
    auto loss = fsdp::models::gpt_loss(through_fsdp ? fsdp::call(model, input) : model->forward(input), target);
    loss.backward();
    opt.step();
    return loss.item<double>();
  };
  std::map<std::string, int64_t> ops[2];
  equal_losses = true;
  for (int s = 0; s < 3; ++s) {
    const auto data = batch(s);
    double loss[2];
    for (int side = 0; side < 2; ++side) {
      std::optional<TopLevelOps> counter;
      if (s == 1) counter.emplace();
      loss[side] = side == 0 ? step(plain, opt_plain, data, false) : step(sharded, opt_sharded, data, true);
      if (counter) ops[side] = counter->ops();
    }
    equal_losses = equal_losses && loss[0] == loss[1];
  }
  std::map<std::string, int64_t> extra = ops[1];
  for (const auto& [name, count] : ops[0]) extra[name] -= count;
  return extra;
}

// The operators in `extra` other than the post-backward node's view and evaluation, at most one
// each per unit; "" if none.
std::string beyond_hooks(const std::map<std::string, int64_t>& extra, int64_t units) {
  std::string unexpected;
  for (const auto& [name, count] : extra) {
    if (count == 0) continue;
    const bool hook = name == "aten::view_as" || name.find("fsdp::PostBackward") != std::string::npos;
    if (!hook || count < 0 || count > units)
      unexpected += " " + name + (count > 0 ? " +" : " ") + std::to_string(count);
  }
  return unexpected;
}

}  // namespace

// The world of one's fast path: the shards are the parameters, so a training step through
// fully_shard issues exactly plain LibTorch's operators plus, per unit, the post-backward node's
// identity view (FSDP2's RegisterPostBackwardFunction) and that node's evaluation; no copy, cat,
// allocation or collective. Counted on the second step. Fails if unshard starts gathering or
// copying, if post_backward starts building a reduce-scatter input or copying gradients, or if
// the losses drift from plain LibTorch's.
TEST(WorldOfOne, AStepIssuesPlainLibTorchsOperatorsAndNoCopy) {
  bool equal_losses = false;
  const auto extra = extra_ops({}, /*n_layer=*/3, equal_losses);
  EXPECT_TRUE(equal_losses) << "a world of one trained differently from plain LibTorch";
  const std::string unexpected = beyond_hooks(extra, /*units=*/4);
  EXPECT_TRUE(unexpected.empty()) << "a world-of-one step through fully_shard issued, beyond plain LibTorch's "
                                     "operators and one post-backward view per unit:"
                                  << unexpected;
  EXPECT_GT(extra.count("aten::view_as") ? extra.at("aten::view_as") : 0, 0)
      << "no post-backward node: the counter missed FSDP's hooks";
}

// The same count sees a unit that does copy: with a bf16 compute dtype a world of one casts each
// shard at every unshard (MixedPrecisionStillCopies), so the check above would catch a fast path
// that started copying.
TEST(WorldOfOne, TheOperatorCountSeesCopies) {
  fsdp::FullyShardOptions options;
  options.mp_policy.param_dtype = at::kBFloat16;
  bool equal_losses = true;
  const auto extra = extra_ops(options, /*n_layer=*/3, equal_losses);
  EXPECT_FALSE(beyond_hooks(extra, /*units=*/4).empty()) << "casting units issued no operator the count saw";
}
