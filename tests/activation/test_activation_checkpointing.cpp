// Activation checkpointing in one process: gradients equal the plain run's, RNG replay (and that
// it matters), the documented limits as errors, and with fully_shard (a world of one) that a
// recomputing unit is the only one unsharded besides the prefetch.
#include <gtest/gtest.h>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "multiprocess.h"
#include "test_helpers.h"

using fsdp::models::GPT;

namespace {

struct Net {
  torch::nn::Linear a{8, 16}, b{16, 8};
  at::Tensor run(const at::Tensor& x, double p) {
    auto h = torch::gelu(a(x));
    if (p > 0) h = torch::dropout(h, p, /*train=*/true);
    return b(h).tanh();
  }
  void zero() {
    for (auto& p : a->parameters()) p.mutable_grad().reset();
    for (auto& p : b->parameters()) p.mutable_grad().reset();
  }
  std::vector<at::Tensor> grads() {
    std::vector<at::Tensor> g;
    for (auto& p : a->parameters()) g.push_back(p.grad().clone());
    for (auto& p : b->parameters()) g.push_back(p.grad().clone());
    return g;
  }
};

double max_diff(const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& y) {
  double d = 0;
  for (size_t i = 0; i < x.size(); ++i) d = std::max(d, (x[i] - y[i]).abs().max().item<double>());
  return d;
}

fsdp::models::GPTConfig tiny(double dropout = 0.0) {
  fsdp::models::GPTConfig c;
  c.vocab_size = 13;
  c.block_size = 6;
  c.n_layer = 4;
  c.n_head = 2;
  c.n_embd = 8;
  c.dropout = dropout;
  return c;
}

}  // namespace

TEST(ActivationCheckpoint, GradientsEqualThePlainRun) {
  torch::manual_seed(0);
  Net net;
  auto x = torch::randn({4, 8}, torch::requires_grad());
  net.run(x, 0).pow(2).sum().backward();
  auto want = net.grads();
  auto want_x = x.grad().clone();
  net.zero();
  x.mutable_grad().reset();
  auto y = fsdp::activation::checkpoint([&](const at::Tensor& in) { return net.run(in, 0); }, x);
  EXPECT_TRUE(y.requires_grad());
  y.pow(2).sum().backward();
  EXPECT_EQ(max_diff(net.grads(), want), 0.0);
  EXPECT_TRUE(x.grad().equal(want_x));
}

TEST(ActivationCheckpoint, InputsWithoutGradNonTensorArgumentsAndTuples) {
  torch::manual_seed(0);
  Net net;
  auto x = torch::randn({4, 8});  // needs no gradient: the parameters still get theirs
  auto fn = [&](const at::Tensor& in, int64_t scale, const at::Tensor& mask) {
    auto out = net.run(in, 0) * static_cast<double>(scale);
    return std::make_tuple(out, out.argmax(1), mask.sum());
  };
  auto mask = torch::ones({3});
  {
    auto [o, idx, m] = fn(x, 3, mask);
    o.sum().backward();
  }
  auto want = net.grads();
  net.zero();
  auto [o, idx, m] = fsdp::activation::checkpoint(fn, x, int64_t{3}, mask);
  EXPECT_EQ(idx.scalar_type(), at::kLong);
  EXPECT_FALSE(idx.requires_grad());
  o.sum().backward();
  EXPECT_EQ(max_diff(net.grads(), want), 0.0);
}

// Dropout inside: the recompute draws the forward's numbers, and the generator continues as if
// nothing had been recomputed.
TEST(ActivationCheckpoint, DropoutIsReplayed) {
  torch::manual_seed(0);
  Net net;
  auto x = torch::randn({4, 8}, torch::requires_grad());
  torch::manual_seed(7);
  net.run(x, 0.5).sum().backward();
  auto after_plain = torch::rand({3});
  auto want = net.grads();
  net.zero();
  torch::manual_seed(7);
  fsdp::activation::checkpoint([&](const at::Tensor& in) { return net.run(in, 0.5); }, x).sum().backward();
  auto after_ckpt = torch::rand({3});
  EXPECT_EQ(max_diff(net.grads(), want), 0.0);
  EXPECT_TRUE(after_ckpt.equal(after_plain));
}

// The replay matters: without it the recompute draws other masks and the gradients are wrong.
TEST(ActivationCheckpoint, WithoutRngPreservationDropoutGradientsDiffer) {
  torch::manual_seed(0);
  Net net;
  auto x = torch::randn({4, 8}, torch::requires_grad());
  torch::manual_seed(7);
  net.run(x, 0.5).sum().backward();
  auto want = net.grads();
  net.zero();
  torch::manual_seed(7);
  fsdp::activation::CheckpointOptions o;
  o.preserve_rng_state = false;
  fsdp::activation::checkpoint(
      o, [&](const at::Tensor& in) { return net.run(in, 0.5); }, x)
      .sum()
      .backward();
  EXPECT_GT(max_diff(net.grads(), want), 1e-3);
}

TEST(ActivationCheckpoint, DoubleBackwardIsAnError) {
  Net net;
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto y = fsdp::activation::checkpoint([&](const at::Tensor& in) { return net.run(in, 0); }, x).sum();
  EXPECT_ERROR_CONTAINS((torch::autograd::grad({y}, {x}, {}, /*retain_graph=*/true, /*create_graph=*/true)),
                        "not supported with torch::autograd::grad");
  auto z = fsdp::activation::checkpoint([&](const at::Tensor& in) { return net.run(in, 0); }, x).sum();
  EXPECT_ERROR_CONTAINS((z.backward({}, /*retain_graph=*/true, /*create_graph=*/true)), "double backward");
}

TEST(ActivationCheckpoint, OutputsNeedingNoGradientAreAnError) {
  auto x = torch::randn({4, 8});
  auto y = fsdp::activation::checkpoint([](const at::Tensor& in) { return in * 2; }, x);
  EXPECT_ERROR_CONTAINS(y.sum().backward(), "none of the checkpointed function's outputs needs a gradient");
}

// Documented rule: side effects run again in the recompute, unless guarded by is_recomputing().
TEST(ActivationCheckpoint, SideEffectsRunTwiceUnlessGuarded) {
  Net net;
  int calls = 0, guarded = 0;
  auto x = torch::randn({4, 8}, torch::requires_grad());
  auto y = fsdp::activation::checkpoint(
      [&](const at::Tensor& in) {
        ++calls;
        if (!fsdp::activation::is_recomputing()) ++guarded;
        return net.run(in, 0);
      },
      x);
  EXPECT_EQ(calls, 1);
  y.sum().backward();
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(guarded, 1);
  {
    torch::NoGradGuard no_grad;  // evaluation: runs once, nothing to recompute
    fsdp::activation::checkpoint(
        [&](const at::Tensor& in) {
          ++calls;
          return net.run(in, 0);
        },
        x);
  }
  EXPECT_EQ(calls, 3);
}

// A whole GPT: apply_activation_checkpointing (every block, every 2nd) and checkpoint_wrapper
// give the plain model's gradients; parameter names are unchanged.
TEST(ActivationCheckpoint, GptWithAndWithoutCheckpointingMatch) {
  for (double dropout : {0.0, 0.2}) {
    auto grads_of = [&](const std::function<void(GPT&)>& setup) {
      torch::manual_seed(1);
      GPT model(tiny(dropout));
      setup(model);
      auto idx = torch::randint(13, {3, 6}, at::kLong);
      torch::manual_seed(5);
      fsdp::call(model, idx).pow(2).mean().backward();
      std::vector<at::Tensor> g;
      for (auto& p : model->named_parameters()) g.push_back(p.value().grad().clone());
      return g;
    };
    auto want = grads_of([](GPT&) {});
    auto full = grads_of([](GPT& m) {
      EXPECT_EQ(
          fsdp::activation::apply_activation_checkpointing(*m, fsdp::activation::every_kth<fsdp::models::BlockImpl>(1)),
          4u);
    });
    auto every2 = grads_of([](GPT& m) {
      EXPECT_EQ(
          fsdp::activation::apply_activation_checkpointing(*m, fsdp::activation::every_kth<fsdp::models::BlockImpl>(2)),
          2u);
      EXPECT_FALSE(fsdp::activation::is_checkpointed(*m->blocks[0]));
      EXPECT_TRUE(fsdp::activation::is_checkpointed(*m->blocks[1]));
    });
    EXPECT_EQ(max_diff(full, want), 0.0) << "dropout " << dropout;
    EXPECT_EQ(max_diff(every2, want), 0.0) << "dropout " << dropout;
  }
}

TEST(ActivationCheckpoint, WrapperCheckpointsPlainCalls) {
  torch::manual_seed(1);
  GPT model(tiny());
  auto x = torch::randn({2, 6, 8}, torch::requires_grad());
  int recomputes = 0;
  auto probe = [&](const at::Tensor& t) {
    if (fsdp::activation::is_recomputing()) ++recomputes;
    return t;
  };
  auto wrapped = fsdp::activation::checkpoint_wrapper(model->blocks[0]);
  EXPECT_TRUE(fsdp::activation::is_checkpointed(*model->blocks[0]));
  auto y = wrapped(x);
  auto want = model->blocks[0]->forward(x);
  EXPECT_TRUE(y.equal(want));
  // The recompute happens: a checkpointed call inside another checkpointed function nests.
  fsdp::activation::checkpoint([&](const at::Tensor& t) { return wrapped(probe(t)); }, x).sum().backward();
  EXPECT_EQ(recomputes, 1);
  fsdp::activation::remove_activation_checkpointing(*model);
  EXPECT_FALSE(fsdp::activation::is_checkpointed(*model->blocks[0]));
}

TEST(ActivationCheckpoint, PredicateSelectingNothingIsAnError) {
  GPT model(tiny());
  auto none = [](const std::string&, torch::nn::Module&) { return false; };
  EXPECT_ERROR_CONTAINS(fsdp::activation::apply_activation_checkpointing(*model, none), "selected no submodule");
  EXPECT_ERROR_CONTAINS((void)fsdp::activation::every_kth<fsdp::models::BlockImpl>(0), "k must be at least 1");
}

// Freed means freed, with checkpointing: while a checkpointed unit recomputes, only it (and the
// prefetch) hold unsharded parameters; everything is resharded after backward; the reduce-scatter
// and all-gather counts equal the plain run's.
namespace {
struct ProbeBlockImpl;
std::vector<ProbeBlockImpl*> g_blocks;
int64_t g_max_unsharded = 0, g_max_unsharded_recompute = 0, g_recomputes = 0;

struct ProbeBlockImpl : torch::nn::Module {
  ProbeBlockImpl() { fc = register_module("fc", torch::nn::Linear(16, 16)); }
  torch::Tensor forward(const torch::Tensor& x) {
    int64_t unsharded = 0;
    for (auto* b : g_blocks) unsharded += b->fc->weight.numel() > 0;
    g_max_unsharded = std::max(g_max_unsharded, unsharded);
    if (fsdp::activation::is_recomputing()) {
      ++g_recomputes;
      g_max_unsharded_recompute = std::max(g_max_unsharded_recompute, unsharded);
    }
    return torch::relu(fc(x)) + x;
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ProbeBlock);

struct ProbeNetImpl : torch::nn::Module {
  ProbeNetImpl() {
    // std::string("b").append(...), not "b" + to_string(i): GCC 12 at -O3 warns a false
    // -Wstringop-overflow on that operator+ (GCC bug 105651).
    for (int i = 0; i < 6; ++i)
      blocks.push_back(register_module(std::string("b").append(std::to_string(i)), ProbeBlock()));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : blocks) x = fsdp::call(b, x);
    return x;
  }
  std::vector<ProbeBlock> blocks;
};
TORCH_MODULE(ProbeNet);

std::pair<fsdp::comm::OpCounters, fsdp::comm::OpCounters> gathers_and_reduces(bool checkpointed,
                                                                              int reshard_after_forward) {
  ProbeNet net;
  g_blocks.clear();
  fsdp::FullyShardOptions o;
  o.reshard_after_forward = reshard_after_forward != 0;
  for (auto& b : net->blocks) {
    g_blocks.push_back(b.get());
    fsdp::fully_shard(b, o);
  }
  fsdp::fully_shard(net);
  if (checkpointed)
    fsdp::activation::apply_activation_checkpointing(*net, fsdp::activation::every_kth<ProbeBlockImpl>(1));
  fsdp::comm::CommStatsSnapshot before;
  for (int step = 0; step < 3; ++step) {  // step 0 records the order, later steps prefetch
    if (step == 2) before = fsdp::comm::process_comm_stats().snapshot();
    g_max_unsharded = g_max_unsharded_recompute = g_recomputes = 0;
    fsdp::call(net, torch::randn({4, 16}, torch::requires_grad())).sum().backward();
    EXPECT_GE(g_max_unsharded, 1);
    if (reshard_after_forward) {
      EXPECT_LE(g_max_unsharded, 2) << "step " << step;
      EXPECT_LE(g_max_unsharded_recompute, 2) << "step " << step;
    }
    EXPECT_EQ(g_recomputes, checkpointed ? 6 : 0);
    for (auto* b : g_blocks) EXPECT_EQ(b->fc->weight.numel(), 0) << "a block stayed unsharded after backward";
  }
  auto d = fsdp::comm::process_comm_stats().snapshot() - before;
  g_blocks.clear();
  return {d[fsdp::comm::OpKind::AllGather], d[fsdp::comm::OpKind::ReduceScatter]};
}
}  // namespace

TEST(ActivationCheckpointFsdp, OnlyTheRecomputingUnitIsUnsharded) {
  for (int raf : {1, 0}) {
    auto plain = gathers_and_reduces(false, raf);
    auto ckpt = gathers_and_reduces(true, raf);
    EXPECT_EQ(ckpt.first.calls, plain.first.calls) << "all-gathers per step, reshard_after_forward " << raf;
    EXPECT_EQ(ckpt.second.calls, plain.second.calls) << "reduce-scatters per step, reshard_after_forward " << raf;
    std::cout << "reshard_after_forward " << raf << ": all-gathers/step " << ckpt.first.calls << " (plain "
              << plain.first.calls << "), reduce-scatters/step " << ckpt.second.calls << " (plain "
              << plain.second.calls << ")" << std::endl;
  }
}
