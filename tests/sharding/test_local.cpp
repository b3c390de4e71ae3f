// fully_shard in one process (a world of one): bad use gets a clear error that names the problem
// and the fix, never a crash; parameters are named shards; freed means freed.
#include <gtest/gtest.h>

#include "fsdp/comm/backend.h"
#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "multiprocess.h"

using fsdp::models::GPT;

namespace {

fsdp::models::GPTConfig tiny() {
  fsdp::models::GPTConfig c;
  c.vocab_size = 13;
  c.block_size = 5;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 8;
  return c;
}

template <typename E = std::exception, typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_ERROR_MENTIONS(expr, needle)                                 \
  do {                                                                      \
    const std::string msg_ = error_of([&] { expr; });                       \
    EXPECT_NE(msg_.find(needle), std::string::npos) << "message: " << msg_; \
  } while (0)

at::Tensor tokens() { return torch::randint(13, {2, 5}, at::kLong); }

void train_step(GPT& model) {
  auto logits = fsdp::call(model, tokens());
  logits.sum().backward();
}

}  // namespace

TEST(FullyShardErrors, ShardingTwice) {
  GPT model(tiny());
  fsdp::fully_shard(model->blocks[0]);
  EXPECT_ERROR_MENTIONS(fsdp::fully_shard(model->blocks[0]), "already sharded");
}

TEST(FullyShardErrors, TiedAcrossGroups) {
  auto c = tiny();
  c.tie_weights = true;
  GPT model(c);
  fsdp::fully_shard(model->lm_head);  // holds the tied weight
  EXPECT_ERROR_MENTIONS(fsdp::fully_shard(model), "tied");
}

TEST(FullyShardErrors, TiedWithinOneGroupWorks) {
  auto c = tiny();
  c.tie_weights = true;
  GPT model(c);
  fsdp::fully_shard(model);
  train_step(model);
  EXPECT_TRUE(model->lm_head->weight.is_same(model->wte->weight));
  int shards_with_grad = 0;
  for (const auto& p : model->parameters()) shards_with_grad += p.grad().defined();
  EXPECT_EQ(shards_with_grad, static_cast<int>(model->parameters().size()));
}

TEST(FullyShardErrors, ShapeChangedAfterSharding) {
  GPT model(tiny());
  fsdp::fully_shard(model);
  model->ln_f->weight.set_data(torch::ones({9}));
  EXPECT_ERROR_MENTIONS(train_step(model), "shapes are fixed after fully_shard");
  GPT other(tiny());
  fsdp::fully_shard(other);
  other->wpe->parameters()[0].set_data(torch::zeros({3}));  // the shard itself
  EXPECT_ERROR_MENTIONS(train_step(other), "changed shape");
}

TEST(FullyShardErrors, ForwardThatBypassesShardingThrows) {
  GPT model(tiny());
  for (auto& b : model->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(model);
  train_step(model);
  // Resharded parameters have zero elements: direct forward fails on shapes, never reads freed memory.
  auto x = torch::randn({2, 5, 8});
  EXPECT_THROW(model->blocks[0]->forward(x), std::exception);
  EXPECT_THROW(model->forward(tokens()), std::exception);
  // Through fsdp::call it still works afterwards.
  train_step(model);
}

TEST(FullyShardErrors, OptimizerBuiltBeforeSharding) {
  GPT model(tiny());
  torch::optim::AdamW early(model->parameters());
  fsdp::fully_shard(model);
  EXPECT_ERROR_MENTIONS(fsdp::check_optimizer_params(early), "build it after sharding");
  torch::optim::AdamW late(model->parameters());
  EXPECT_NO_THROW(fsdp::check_optimizer_params(late));
}

struct TwoDevicesImpl : torch::nn::Module {
  TwoDevicesImpl() {
    a = register_parameter("a", torch::ones({4}));
    b = register_parameter("b", torch::ones({4}, torch::kMeta));
  }
  torch::Tensor a, b;
};
TORCH_MODULE(TwoDevices);

TEST(FullyShardErrors, ParametersOnDifferentDevices) {
  TwoDevices m;
  EXPECT_ERROR_MENTIONS(fsdp::fully_shard(m), "different devices");
  // Nothing was changed by the refused call.
  EXPECT_FALSE(fsdp::fsdp_module(*m).has_value());
  EXPECT_EQ(m->a.numel(), 4);
  EXPECT_TRUE(m->parameters()[0].is_same(m->a));
}

TEST(FullyShardErrors, PoliciesThatCannotApplyAreRefused) {
  GPT model(tiny());
  fsdp::FullyShardOptions o;
  o.mp_policy.param_dtype = at::kLong;
  EXPECT_ERROR_MENTIONS(fsdp::fully_shard(model, o),
                        "param_dtype is Long; mixed precision dtypes must be floating point");
  // Offloading to the CPU from a GPU mesh needs a CUDA build: the mesh itself is refused.
  EXPECT_ERROR_MENTIONS(fsdp::init_device_mesh({1}, {"shard"}, "cuda"), fsdp::comm::nccl_available() ? "" : "NCCL");
  // HSDP's mesh is (replicate, shard), in that order.
  fsdp::FullyShardOptions hsdp;
  hsdp.mesh = fsdp::init_device_mesh({1, 1}, {"shard", "replicate"});
  EXPECT_ERROR_MENTIONS(fsdp::fully_shard(model, hsdp), "dim 0 must be the replicate dimension");
  hsdp.reshard_after_forward = 2;
  hsdp.mesh = fsdp::init_device_mesh({1, 1}, {"replicate", "shard"});
  EXPECT_ERROR_MENTIONS(fsdp::fully_shard(model, hsdp), "does not divide the shard size 1");
}

TEST(FullyShard, ParametersAreShardsWithTheirNames) {
  GPT model(tiny());
  std::vector<std::string> before;
  for (const auto& p : model->named_parameters()) before.push_back(p.key());
  for (auto& b : model->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(model);
  std::vector<std::string> after;
  for (const auto& p : model->named_parameters()) {
    after.push_back(p.key());
    auto info = fsdp::shard_info(p.value());
    ASSERT_TRUE(info) << p.key();
    EXPECT_EQ(info->dim0_offset, 0);  // a world of one holds everything
  }
  EXPECT_EQ(before, after);
  // The unsharded parameters the modules use are freed between steps.
  EXPECT_EQ(model->blocks[0]->attn->c_attn->weight.numel(), 0);
}

// Freed means freed: while block i computes, only block i (and the next one's prefetch) hold
// unsharded parameters; the others are back to zero elements.
namespace {
struct ProbeBlockImpl;
std::vector<ProbeBlockImpl*> g_probe_blocks;
int64_t g_max_unsharded = 0;

struct ProbeBlockImpl : torch::nn::Module {
  ProbeBlockImpl() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
  torch::Tensor forward(const torch::Tensor& x) {
    int64_t unsharded = 0;
    for (auto* b : g_probe_blocks) unsharded += b->fc->weight.numel() > 0;
    g_max_unsharded = std::max(g_max_unsharded, unsharded);
    return torch::relu(fc(x)) + x;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ProbeBlock);

struct ProbeNetImpl : torch::nn::Module {
  ProbeNetImpl() {
    for (int i = 0; i < 6; ++i) blocks.push_back(register_module("b" + std::to_string(i), ProbeBlock()));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = fsdp::call(b, x);
    return x;
  }
  std::vector<ProbeBlock> blocks;
};
TORCH_MODULE(ProbeNet);
}  // namespace

TEST(FullyShardMemory, OnlyTheRunningUnitIsUnsharded) {
  ProbeNet net;
  g_probe_blocks.clear();
  for (auto& b : net->blocks) {
    g_probe_blocks.push_back(b.get());
    fsdp::fully_shard(b);
  }
  fsdp::fully_shard(net);
  for (int step = 0; step < 3; ++step) {  // step 0 records the order, later steps prefetch
    g_max_unsharded = 0;
    fsdp::call(net, torch::randn({4, 16}, torch::requires_grad())).sum().backward();
    EXPECT_GE(g_max_unsharded, 1);
    EXPECT_LE(g_max_unsharded, 2) << "step " << step;
    for (auto* b : g_probe_blocks) EXPECT_EQ(b->fc->weight.numel(), 0) << "a block stayed unsharded after backward";
  }
  g_probe_blocks.clear();
}

// Backward prefetch follows the post-forward order (FSDP2's): the root's forward ends last, so its
// pre-backward hook gathers the last block, whose backward comes next, while the root's own backward
// (the head and the loss) computes. A world of one "gathers" synchronously (the unsharded parameters
// alias the shards), so the prefetch shows as the last block unsharded before its backward starts.
TEST(FullyShardPrefetch, RootPreBackwardPrefetchesTheLastBlock) {
  GPT model(tiny());
  for (auto& b : model->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(model);
  auto& last = model->blocks.back()->attn->c_attn->weight;
  for (int step = 0; step < 2; ++step) {
    auto logits = fsdp::call(model, tokens());
    ASSERT_EQ(last.numel(), 0) << "the last block was not resharded after forward";
    const auto before = fsdp::comm::process_comm_stats().snapshot();
    int64_t seen_unsharded = -1;
    uint64_t gathers = 0;
    // Runs after FSDP's own pre-backward hook on the same tensor (hooks run in registration order).
    logits.register_hook([&](const at::Tensor&) {
      seen_unsharded = last.numel();
      gathers = (fsdp::comm::process_comm_stats().snapshot() - before)[fsdp::comm::OpKind::AllGather].calls;
    });
    logits.sum().backward();
    EXPECT_GT(seen_unsharded, 0) << "step " << step << ": the root's pre-backward did not prefetch the last block";
    EXPECT_EQ(gathers, 1u) << "step " << step;
  }
}

// set_reshard_after_backward(false): parameters stay gathered after backward, so the next forward
// needs no all-gather.
TEST(FullyShardSettings, ReshardAfterBackwardFalseKeepsParameters) {
  GPT model(tiny());
  for (auto& b : model->blocks) fsdp::fully_shard(b);
  auto root = fsdp::fully_shard(model);
  root.set_reshard_after_backward(false);  // recurse: every unit
  train_step(model);
  EXPECT_GT(model->blocks[0]->attn->c_attn->weight.numel(), 0);
  EXPECT_GT(model->wte->weight.numel(), 0);
  auto before = fsdp::comm::process_comm_stats().snapshot();
  train_step(model);
  auto delta = fsdp::comm::process_comm_stats().snapshot() - before;
  // Forward gathered nothing; only the blocks' backward re-gathers remain (they still reshard after
  // forward), against 1 + 2 + 2 all-gathers in a default step.
  EXPECT_EQ(delta[fsdp::comm::OpKind::AllGather].calls, 2u);
  root.set_reshard_after_backward(true);
  train_step(model);
  EXPECT_EQ(model->blocks[0]->attn->c_attn->weight.numel(), 0);
  root.reshard();
  EXPECT_EQ(model->wte->weight.numel(), 0);
}

TEST(FullyShard, IgnoredParamsStayWhole) {
  GPT model(tiny());
  fsdp::FullyShardOptions o;
  o.ignored_params = {model->ln_f->weight};
  fsdp::fully_shard(model, o);
  train_step(model);
  EXPECT_FALSE(fsdp::shard_info(model->ln_f->weight).has_value());
  EXPECT_EQ(model->ln_f->weight.numel(), 8);  // never freed
  EXPECT_TRUE(model->ln_f->weight.grad().defined());
  EXPECT_TRUE(fsdp::shard_info(model->named_parameters()["ln_f.bias"]).has_value());  // the shard
  EXPECT_TRUE(model->named_parameters()["ln_f.weight"].is_same(model->ln_f->weight));
}

// replicate in a world of one: the ordinary parameters, gradients as without it (the all-reduce
// of one rank is the identity), no-sync accumulation, and a tied model's shared weight once.
TEST(Replicate, WorldOfOneMatchesPlainTraining) {
  auto c = tiny();
  c.tie_weights = true;
  torch::manual_seed(3);
  GPT plain(c);
  torch::manual_seed(3);
  GPT ddp(c);
  auto handle = fsdp::replicate(ddp, fsdp::ReplicateOptions{std::nullopt, /*bucket_cap_bytes=*/256});
  EXPECT_GT(handle.num_buckets(), 1u);
  EXPECT_TRUE(fsdp::replicate_module(*ddp->blocks[0]).has_value());
  EXPECT_FALSE(fsdp::shard_info(ddp->parameters()[0]).has_value());
  auto x = tokens();
  for (int micro = 0; micro < 2; ++micro) {
    handle.set_requires_gradient_sync(micro == 1);
    fsdp::models::gpt_loss(plain->forward(x), x).backward();
    fsdp::models::gpt_loss(fsdp::call(ddp, x), x).backward();
  }
  auto a = plain->named_parameters(), b = ddp->named_parameters();
  for (const auto& p : a) {
    ASSERT_TRUE(b[p.key()].grad().defined()) << p.key();
    EXPECT_TRUE(b[p.key()].grad().allclose(p.value().grad(), 1e-6, 1e-7)) << p.key();
  }
}
