// fsdp::optim's fused optimizers against LibTorch's own, on the same parameters and gradients:
// every parameter and every state field within 1e-6 relative over several steps (odd sizes, two
// param groups with different options, the learning rate changed between steps, weight decay,
// amsgrad, nesterov); parameters the fused loop cannot take get the base class's step (exactly
// LibTorch's result); checkpoints of one load into the other and training goes on identically.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/optimizer_state.h"
#include "fsdp/compat/optim.h"
#include "fsdp/optim/fused.h"
#include "test_helpers.h"

namespace {

namespace optim = torch::optim;
namespace ckpt = fsdp::checkpoint;
using fsdp::testing::TempDir;

constexpr double kTolerance = 1e-6;

// Parameters of odd sizes (1, 7 and 1000003 elements, and a 2-d one), as leaves requiring grad.
std::vector<at::Tensor> make_params(uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> params;
  for (const auto& shape : std::vector<std::vector<int64_t>>{{1}, {7}, {1000003}, {33, 65}})
    params.push_back(at::randn(shape).requires_grad_());
  return params;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// The same random gradient (a new one each step) on both lists.
void set_grads(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, int step) {
  torch::manual_seed(1000 + step);
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor g = at::randn_like(a[i]);
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
}

// max |got - want| / max |want| (0 for two undefined tensors, infinite for one).
double rel_diff(const at::Tensor& got, const at::Tensor& want) {
  if (!got.defined() || !want.defined())
    return got.defined() == want.defined() ? 0 : std::numeric_limits<double>::infinity();
  const double scale = want.to(at::kDouble).abs().max().item<double>();
  const double diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
  return diff == 0 ? 0 : diff / std::max(scale, 1e-30);
}

// The largest relative difference over the parameters and every state field the checkpoint codec
// knows (exp_avg, exp_avg_sq, max_exp_avg_sq, step, momentum_buffer).
double max_rel_diff(optim::Optimizer& got, const std::vector<at::Tensor>& got_params, optim::Optimizer& want,
                    const std::vector<at::Tensor>& want_params) {
  const auto& codec = ckpt::optimizer_codec(want);
  double worst = 0;
  for (size_t i = 0; i < want_params.size(); ++i) {
    worst = std::max(worst, rel_diff(got_params[i], want_params[i]));
    auto g = got.state().find(fsdp::compat::optimizer_state_key(got_params[i]));
    auto w = want.state().find(fsdp::compat::optimizer_state_key(want_params[i]));
    EXPECT_EQ(g == got.state().end(), w == want.state().end()) << "parameter " << i;
    if (g == got.state().end() || w == want.state().end()) continue;
    for (const auto& field : codec.fields)
      worst = std::max(worst, rel_diff(field.get(*g->second), field.get(*w->second)));
  }
  return worst;
}

// Two groups (parameters 0-1 with `first`, 2-3 with `second`).
template <typename Opt, typename Options>
std::unique_ptr<Opt> two_groups(const std::vector<at::Tensor>& p, const Options& first, const Options& second) {
  std::vector<optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p[0], p[1]}, std::make_unique<Options>(first));
  groups.emplace_back(std::vector<at::Tensor>{p[2], p[3]}, std::make_unique<Options>(second));
  return std::make_unique<Opt>(std::move(groups), first);
}

// LibTorch's Ref and the fused Fused over 6 steps from the same parameters and gradients, the
// learning rates lowered between steps; returns the largest difference seen after any step.
template <typename Ref, typename Fused, typename Options>
double run_both(const Options& first, const Options& second) {
  const auto want_params = make_params(1);
  const auto got_params = copies(want_params);
  auto want = two_groups<Ref>(want_params, first, second);
  auto got = two_groups<Fused>(got_params, first, second);
  double worst = 0;
  for (int step = 0; step < 6; ++step) {
    set_grads(want_params, got_params, step);
    want->step();
    got->step();
    EXPECT_EQ(got->last_step().fused, 4);
    EXPECT_EQ(got->last_step().fallback, 0);
    worst = std::max(worst, max_rel_diff(*got, got_params, *want, want_params));
    for (auto* opt : {static_cast<optim::Optimizer*>(want.get()), static_cast<optim::Optimizer*>(got.get())})
      for (auto& group : opt->param_groups()) group.options().set_lr(group.options().get_lr() * 0.7);
  }
  return worst;
}

TEST(FusedAdamW, MatchesLibTorchWithWeightDecayAmsgradGroupsAndLrChanges) {
  for (bool amsgrad : {false, true}) {
    for (double wd : {0.0, 0.1}) {
      const auto first = optim::AdamWOptions(1e-2).weight_decay(wd).amsgrad(amsgrad);
      const auto second = optim::AdamWOptions(3e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(2 * wd).amsgrad(!amsgrad);
      const double diff = run_both<optim::AdamW, fsdp::optim::FusedAdamW>(first, second);
      EXPECT_LE(diff, kTolerance) << "amsgrad " << amsgrad << " weight_decay " << wd;
    }
  }
}

TEST(FusedAdam, MatchesLibTorchWithL2WeightDecayAmsgradGroupsAndLrChanges) {
  for (bool amsgrad : {false, true}) {
    for (double wd : {0.0, 0.05}) {
      const auto first = optim::AdamOptions(1e-2).weight_decay(wd).amsgrad(amsgrad);
      const auto second = optim::AdamOptions(3e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(2 * wd).amsgrad(!amsgrad);
      const double diff = run_both<optim::Adam, fsdp::optim::FusedAdam>(first, second);
      EXPECT_LE(diff, kTolerance) << "amsgrad " << amsgrad << " weight_decay " << wd;
    }
  }
}

TEST(FusedSGD, MatchesLibTorchWithMomentumDampeningNesterovAndWeightDecay) {
  const std::vector<std::pair<optim::SGDOptions, optim::SGDOptions>> cases = {
      {optim::SGDOptions(0.1), optim::SGDOptions(0.05).weight_decay(1e-2)},  // no momentum: no state
      {optim::SGDOptions(0.1).momentum(0.9).dampening(0.1).weight_decay(1e-2), optim::SGDOptions(0.05).momentum(0.5)},
      {optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-2),
       optim::SGDOptions(0.05).momentum(0.8).nesterov(true)},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const double diff = run_both<optim::SGD, fsdp::optim::FusedSGD>(cases[i].first, cases[i].second);
    EXPECT_LE(diff, kTolerance) << "case " << i;
  }
}

// Elementwise work split over threads (at least 2) gives the same bits as one thread.
TEST(FusedAdamW, OneThreadAndTheDefaultGiveTheSameBits) {
  const auto a = make_params(2);
  const auto b = copies(a);
  const auto options = optim::AdamWOptions(1e-2).weight_decay(0.1);
  fsdp::optim::FusedAdamW one(a, options), many(b, options);
  const int threads = at::get_num_threads();
  const int many_threads = std::max(2, threads);
  for (int step = 0; step < 3; ++step) {
    set_grads(a, b, step);
    at::set_num_threads(1);
    one.step();
    at::set_num_threads(many_threads);
    many.step();
    at::set_num_threads(threads);
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "parameter " << i;
}

// A float64 parameter and a transposed (non-contiguous) one beside a plain one: the two take the
// base class's step, so they equal LibTorch's exactly; the plain one is fused.
template <typename Ref, typename Fused, typename Options>
void expect_fallback_is_libtorchs(const Options& options) {
  torch::manual_seed(3);
  const std::vector<at::Tensor> want_params = {at::randn({5, 3}, at::kDouble).requires_grad_(),
                                               at::randn({6, 4}).t().requires_grad_(), at::randn({9}).requires_grad_()};
  const auto got_params = copies(want_params);  // clones keep the transposed strides
  ASSERT_FALSE(got_params[1].is_contiguous());
  Ref want(want_params, options);
  Fused got(got_params, options);
  for (int step = 0; step < 3; ++step) {
    set_grads(want_params, got_params, step);
    want.step();
    got.step();
    EXPECT_EQ(got.last_step().fused, 1);
    EXPECT_EQ(got.last_step().fallback, 2);
  }
  EXPECT_TRUE(torch::equal(got_params[0], want_params[0]));
  EXPECT_TRUE(torch::equal(got_params[1], want_params[1]));
  EXPECT_LE(max_rel_diff(got, got_params, want, want_params), kTolerance);
}

TEST(FusedOptimizers, NonFloat32AndNonContiguousParametersGetTheBaseClassStep) {
  expect_fallback_is_libtorchs<optim::AdamW, fsdp::optim::FusedAdamW>(
      optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true));
  expect_fallback_is_libtorchs<optim::Adam, fsdp::optim::FusedAdam>(optim::AdamOptions(1e-2).weight_decay(0.1));
  expect_fallback_is_libtorchs<optim::SGD, fsdp::optim::FusedSGD>(
      optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
}

// A sparse gradient goes to the base class, which refuses it as LibTorch does; the optimizer's
// own param groups are back in place after the error.
TEST(FusedOptimizers, SparseGradientIsRefusedAsLibTorchRefusesIt) {
  auto dense = at::randn({4, 3}).requires_grad_();
  auto sparse = at::randn({4, 3}).requires_grad_();
  dense.mutable_grad() = at::randn({4, 3});
  sparse.mutable_grad() = at::randn({4, 3}).to_sparse();
  fsdp::optim::FusedAdamW opt({dense, sparse});
  EXPECT_ERROR_CONTAINS(opt.step(), "does not support sparse gradients");
  ASSERT_EQ(opt.param_groups().size(), 1u);
  EXPECT_EQ(opt.param_groups()[0].params().size(), 2u);
}

// step(closure): the closure runs with grad enabled (its backward fills the gradients) and its
// loss is returned, as the base class does.
TEST(FusedOptimizers, ClosureLossIsReturnedAndItsGradientsUsed) {
  const auto want_params = make_params(4);
  const auto got_params = copies(want_params);
  auto closure_of = [](const std::vector<at::Tensor>& params, optim::Optimizer& opt) {
    return [&params, &opt] {
      opt.zero_grad();
      at::Tensor loss = at::zeros({});
      for (const auto& p : params) loss = loss + (p * p).sum() * 0.5 + p.sum();
      loss.backward();
      return loss;
    };
  };
  optim::Adam want(want_params, optim::AdamOptions(1e-2));
  fsdp::optim::FusedAdam got(got_params, optim::AdamOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    const at::Tensor want_loss = want.step(closure_of(want_params, want));
    const at::Tensor got_loss = got.step(closure_of(got_params, got));
    ASSERT_TRUE(got_loss.defined());
    EXPECT_NEAR(got_loss.item<double>(), want_loss.item<double>(), 1e-6 * std::abs(want_loss.item<double>()));
    EXPECT_EQ(got.last_step().fused, 4);
  }
  EXPECT_LE(max_rel_diff(got, got_params, want, want_params), kTolerance);
}

// ---- checkpoints: LibTorch's optimizer and the fused one read each other's ------------------------

torch::nn::Sequential small_model(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(33, 17), torch::nn::Functional(torch::relu), torch::nn::Linear(17, 5));
}

void train(torch::nn::Sequential& model, optim::Optimizer& opt, int from, int steps) {
  for (int step = from; step < from + steps; ++step) {
    torch::manual_seed(500 + step);
    const at::Tensor x = at::randn({8, 33});
    opt.zero_grad();
    model->forward(x).pow(2).mean().backward();
    opt.step();
  }
}

std::vector<at::Tensor> params_of(torch::nn::Sequential& model) { return model->parameters(); }

// `Saver` trains 3 steps and saves through fsdp::checkpoint; a fresh model with a `Loader` (its
// lr deliberately another) loads it; both train 3 more steps: the same parameters and state.
template <typename Saver, typename Loader, typename Options>
void expect_checkpoint_loads_across(const Options& options) {
  TempDir dir("fsdp_fused_ckpt");
  auto saved_model = small_model(1);
  Saver saver(saved_model->parameters(), options);
  train(saved_model, saver, 0, 3);
  ckpt::save(dir / "c", ckpt::State{saved_model.ptr(), &saver});

  auto loaded_model = small_model(2);
  Options other = options;
  other.lr(options.lr() * 10);
  Loader loader(loaded_model->parameters(), other);
  ckpt::load(dir / "c", ckpt::State{loaded_model.ptr(), &loader});
  EXPECT_DOUBLE_EQ(loader.param_groups()[0].options().get_lr(), options.lr());  // hyperparameters restored
  const auto saved_params = params_of(saved_model), loaded_params = params_of(loaded_model);
  EXPECT_EQ(max_rel_diff(loader, loaded_params, saver, saved_params), 0);  // the state itself, bit for bit

  train(saved_model, saver, 3, 3);
  train(loaded_model, loader, 3, 3);
  EXPECT_LE(max_rel_diff(loader, loaded_params, saver, saved_params), kTolerance);
}

TEST(FusedCheckpoints, LibTorchsAdamWLoadsIntoFusedAdamWAndBack) {
  const auto options = optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(true);
  expect_checkpoint_loads_across<optim::AdamW, fsdp::optim::FusedAdamW>(options);
  expect_checkpoint_loads_across<fsdp::optim::FusedAdamW, optim::AdamW>(options);
}

TEST(FusedCheckpoints, LibTorchsAdamAndSGDLoadIntoTheFusedOnesAndBack) {
  const auto adam = optim::AdamOptions(1e-2).weight_decay(0.01);
  expect_checkpoint_loads_across<optim::Adam, fsdp::optim::FusedAdam>(adam);
  expect_checkpoint_loads_across<fsdp::optim::FusedAdam, optim::Adam>(adam);
  const auto sgd = optim::SGDOptions(0.05).momentum(0.9).nesterov(true);
  expect_checkpoint_loads_across<optim::SGD, fsdp::optim::FusedSGD>(sgd);
  expect_checkpoint_loads_across<fsdp::optim::FusedSGD, optim::SGD>(sgd);
}

// LibTorch's own serialization (torch::save of an optimizer) is the base class's: a fused
// optimizer's archive loads into LibTorch's with the same per-parameter state.
TEST(FusedCheckpoints, TorchSaveOfFusedAdamWLoadsIntoLibTorchsAdamW) {
  TempDir dir("fsdp_fused_torch_save");
  auto model = small_model(1);
  fsdp::optim::FusedAdamW fused(model->parameters(), optim::AdamWOptions(1e-2).weight_decay(0.1));
  train(model, fused, 0, 2);
  torch::save(fused, dir / "opt.pt");
  optim::AdamW plain(model->parameters(), optim::AdamWOptions(0.5));
  torch::load(plain, dir / "opt.pt");
  const auto params = params_of(model);
  EXPECT_EQ(max_rel_diff(plain, params, fused, params), 0);
}

}  // namespace
