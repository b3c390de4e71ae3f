// fully_shard in a world of one (FSDP's own cost near zero). With nothing to gather,
// each unsharded parameter is its shard's memory, not a copy: unshard allocates and copies nothing,
// forward reads what the optimizer wrote, and training equals plain LibTorch bit for bit. Where
// the unsharded parameter needs another dtype (mixed precision), it is still a copy.
#include <gtest/gtest.h>

#include "fsdp/debug/buffer_pool.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"

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
