// Every LibTorch optimizer in sharded checkpoints (fsdp/checkpoint/optimizer_state.h), with real
// processes: for Adam, AdamW, SGD (momentum), Adagrad, RMSprop (centered, momentum) and a user's
// own registered optimizer, train at 2 ranks, change the learning rates, save, load at 1 and 3
// ranks into a fresh model and optimizer built with other hyperparameters, continue: the
// hyperparameters are the saved ones and training equals an uninterrupted single-process run.
// Also: LBFGS and unregistered optimizers are refused naming their type, and a checkpoint of one
// optimizer does not load into another.
#include <gtest/gtest.h>

#include <torch/optim/adagrad.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>

#include <cstdlib>
#include <iostream>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/optimizer_state.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/compat/optim.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
namespace ckpt = fsdp::checkpoint;
using fsdp::models::GPT;

namespace {

constexpr int kSaveStep = 4;
constexpr int kSteps = 8;
constexpr int64_t kBatch = 12;  // divisible by 1, 2 and 3
constexpr double kTolerance = 1e-6;
constexpr double kLr = 3e-3;
constexpr double kChangedLr = 1.7e-3;  // group 0's lr from step kSaveStep on (set before saving)

// ---- a user's own optimizer: heavy-ball momentum with a step counter --------------------------

struct HeavyBallOptions : torch::optim::OptimizerCloneableOptions<HeavyBallOptions> {
  explicit HeavyBallOptions(double lr = 0.01) : lr_(lr) {}
  TORCH_ARG(double, lr);
  TORCH_ARG(double, beta) = 0.9;
  double get_lr() const override { return lr_; }
  void set_lr(const double lr) override { lr_ = lr; }
};
struct HeavyBallState : torch::optim::OptimizerCloneableParamState<HeavyBallState> {
  TORCH_ARG(at::Tensor, velocity);
  TORCH_ARG(int64_t, step) = 0;
};
class HeavyBall : public torch::optim::Optimizer {
 public:
  HeavyBall(std::vector<torch::optim::OptimizerParamGroup> groups, HeavyBallOptions defaults)
      : Optimizer(std::move(groups), std::make_unique<HeavyBallOptions>(defaults)) {}
  at::Tensor step(LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    for (auto& group : param_groups_) {
      auto& o = static_cast<HeavyBallOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = state_[fsdp::compat::optimizer_state_key(p)];
        if (!slot) {
          auto s = std::make_unique<HeavyBallState>();
          s->velocity(at::zeros_like(p));
          slot = std::move(s);
        }
        auto& s = static_cast<HeavyBallState&>(*slot);
        s.step(s.step() + 1);
        s.velocity().mul_(o.beta()).add_(p.grad());
        p.add_(s.velocity(), -o.lr());
      }
    }
    return {};
  }
};

void register_heavy_ball() {
  ckpt::register_optimizer(ckpt::OptimizerCodecBuilder<HeavyBall, HeavyBallState, HeavyBallOptions>("HeavyBall")
                               .state("velocity", [](HeavyBallState& s) -> at::Tensor& { return s.velocity(); })
                               .state("step", [](HeavyBallState& s) -> int64_t& { return s.step(); })
                               .hyperparameter("lr", [](HeavyBallOptions& o) -> double& { return o.lr(); })
                               .hyperparameter("beta", [](HeavyBallOptions& o) -> double& { return o.beta(); })
                               .build());
}

// ---- the optimizers under test ------------------------------------------------------------

// Two param groups (matrices; vectors at half the lr), so that per-group hyperparameters count.
// `variant` 1 builds the same optimizer with other hyperparameters (what a load must overwrite).
// eps 1e-3 where there is one: see parity.cpp (Adam-like division amplifies rounding noise).
std::unique_ptr<torch::optim::Optimizer> make_opt(const std::string& name, torch::nn::Module& model, int variant = 0) {
  namespace o = torch::optim;
  std::vector<at::Tensor> matrices, vectors;
  for (const auto& p : model.parameters()) (p.dim() >= 2 ? matrices : vectors).push_back(p);
  const double lr = variant ? 0.5 : kLr;
  auto groups = [&](auto options) {
    auto half = options;
    half.lr(lr / 2);
    std::vector<o::OptimizerParamGroup> g;
    g.emplace_back(matrices, std::make_unique<decltype(options)>(options));
    g.emplace_back(vectors, std::make_unique<decltype(half)>(half));
    return std::make_pair(std::move(g), options);
  };
  if (name == "adamw") {
    auto [g, d] =
        groups(o::AdamWOptions(lr).weight_decay(variant ? 0.0 : 0.1).eps(1e-3).betas({0.9, variant ? 0.5 : 0.99}));
    return std::make_unique<o::AdamW>(std::move(g), d);
  }
  if (name == "adam") {
    auto [g, d] = groups(o::AdamOptions(lr).eps(1e-3).amsgrad(variant == 0).betas({variant ? 0.1 : 0.8, 0.99}));
    return std::make_unique<o::Adam>(std::move(g), d);
  }
  if (name == "sgd") {
    auto [g, d] =
        groups(o::SGDOptions(lr * 10).momentum(variant ? 0.1 : 0.9).nesterov(variant == 0).weight_decay(0.01));
    return std::make_unique<o::SGD>(std::move(g), d);
  }
  if (name == "adagrad") {
    auto [g, d] =
        groups(o::AdagradOptions(lr * 10).eps(1e-3).lr_decay(variant ? 0.0 : 0.01).initial_accumulator_value(0.1));
    return std::make_unique<o::Adagrad>(std::move(g), d);
  }
  if (name == "rmsprop") {
    auto [g, d] =
        groups(o::RMSpropOptions(lr).eps(1e-3).momentum(variant ? 0.0 : 0.5).centered(variant == 0).alpha(0.95));
    return std::make_unique<o::RMSprop>(std::move(g), d);
  }
  if (name == "heavyball") {
    auto [g, d] = groups(HeavyBallOptions(lr * 10).beta(variant ? 0.2 : 0.8));
    return std::make_unique<HeavyBall>(std::move(g), d);
  }
  throw std::invalid_argument("unknown optimizer " + name);
}

// Every hyperparameter of every group, by the optimizer's codec, as doubles.
std::vector<std::vector<double>> hyperparameters(torch::optim::Optimizer& opt) {
  const auto& codec = ckpt::optimizer_codec(opt);
  std::vector<std::vector<double>> out;
  for (auto& group : opt.param_groups()) {
    std::vector<double> values;
    for (const auto& h : codec.hyperparameters) {
      at::Tensor t = h.get(group.options());
      for (int64_t i = 0; i < t.numel(); ++i) values.push_back(t[i].item<double>());
    }
    out.push_back(values);
  }
  return out;
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v, name, " is not set");
  return v;
}

// One step of this rank's slice of the global batch (the whole batch in a world of one).
void train_step(GPT& model, torch::optim::Optimizer& opt, int step) {
  const auto c = uneven_config();
  const int world = fsdp::dist::is_initialized() ? fsdp::dist::world_size() : 1;
  const int rank = fsdp::dist::is_initialized() ? fsdp::dist::rank() : 0;
  const int64_t local = kBatch / world;
  opt.zero_grad();
  auto data = global_batch(c, kBatch, step, 0).narrow(0, rank * local, local);
  fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size))
      .backward();
  opt.step();
}

void change_lr(torch::optim::Optimizer& opt) { opt.param_groups()[0].options().set_lr(kChangedLr); }

// The uninterrupted single-process run (no process group needed: nothing is sharded): full
// parameters after `steps` steps, the lr changed after kSaveStep as the sharded run does.
std::map<std::string, at::Tensor> reference(const std::string& name, int steps) {
  auto model = parity_model(uneven_config());
  auto opt = make_opt(name, *model);
  for (int s = 0; s < steps; ++s) {
    if (s == kSaveStep) change_lr(*opt);
    const auto c = uneven_config();
    opt->zero_grad();
    auto data = global_batch(c, kBatch, s, 0);
    fsdp::models::gpt_loss(model->forward(data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size)).backward();
    opt->step();
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

double check_params_match(GPT& model, const std::map<std::string, at::Tensor>& want_full, double tolerance) {
  double worst = 0;
  for (const auto& p : model->named_parameters()) {
    at::Tensor want = want_full.at(p.key());
    if (auto info = fsdp::shard_info(p.value())) want = want.narrow(0, info->dim0_offset, info->local_rows);
    if (want.numel() == 0) continue;
    const double diff = ((p.value().detach() - want).abs() / want.abs().clamp_min(1.0)).max().item<double>();
    TORCH_CHECK(diff <= tolerance, p.key(), " differs from the uninterrupted run by ", diff);
    worst = std::max(worst, diff);
  }
  return worst;
}

// 42: the parity model the reference starts from; another seed: other initial weights.
GPT sharded_model(int seed) {
  auto c = uneven_config();
  c.init_seed = static_cast<uint64_t>(seed);
  GPT model = seed == 42 ? parity_model(uneven_config()) : GPT(c);
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  return model;
}

}  // namespace

// ---- rank workers ------------------------------------------------------------------------

FSDP_RANK_WORKER(optimizer_train_save) {
  register_heavy_ball();
  const std::string name = env("OPTIMIZER");
  auto model = sharded_model(42);
  auto opt = make_opt(name, *model);
  for (int s = 0; s < kSaveStep; ++s) train_step(model, *opt, s);
  change_lr(*opt);  // saved, and what the loaded optimizer must have
  ckpt::save(env("CKPT_DIR"), ckpt::State{model.ptr(), opt.get()});
}

FSDP_RANK_WORKER(optimizer_load_continue) {
  register_heavy_ball();
  const std::string name = env("OPTIMIZER");
  auto model = sharded_model(7);  // other weights and other hyperparameters: the load must set both
  auto opt = make_opt(name, *model, /*variant=*/1);
  torch::manual_seed(8);
  GPT unsharded(uneven_config());
  auto want_hypers = make_opt(name, *unsharded, /*variant=*/0);
  change_lr(*want_hypers);
  TORCH_CHECK(hyperparameters(*opt) != hyperparameters(*want_hypers), "the variant must differ");
  ckpt::load(env("CKPT_DIR"), ckpt::State{model.ptr(), opt.get()});
  TORCH_CHECK(hyperparameters(*opt) == hyperparameters(*want_hypers), name, ": hyperparameters not restored");
  TORCH_CHECK(opt->param_groups()[0].options().get_lr() == kChangedLr, "lr ",
              opt->param_groups()[0].options().get_lr());
  check_params_match(model, reference(name, kSaveStep), kTolerance);
  for (int s = kSaveStep; s < kSteps; ++s) train_step(model, *opt, s);
  const double worst = check_params_match(model, reference(name, kSteps), kTolerance);
  if (fsdp::dist::rank() == 0)
    std::cout << name << " resumed at " << fsdp::dist::world_size() << " ranks: worst difference from the "
              << "uninterrupted run " << worst << std::endl;
}

// A checkpoint of one optimizer into another: refused naming both.
FSDP_RANK_WORKER(optimizer_load_into_another) {
  auto model = sharded_model(7);
  auto opt = make_opt(env("OTHER"), *model);
  expect_error([&] { ckpt::load(env("CKPT_DIR"), ckpt::State{model.ptr(), opt.get()}); }, env("EXPECT"));
  TORCH_CHECK(opt->state().empty(), "a refused load left optimizer state behind");
}

// Through the state-dict API too: full dicts at 2 ranks carry hyperparameters and RMSprop state.
FSDP_RANK_WORKER(optimizer_state_dict_hyperparameters) {
  auto model = sharded_model(42);
  auto opt = make_opt("rmsprop", *model);
  for (int s = 0; s < 2; ++s) train_step(model, *opt, s);
  change_lr(*opt);
  auto full = ckpt::get_optimizer_state_dict(*model, *opt, {.full_state_dict = true});
  TORCH_CHECK(full.count("param_groups.0.lr") && full.at("param_groups.0.lr").item<double>() == kChangedLr);
  TORCH_CHECK(full.count("param_groups.1.centered") && full.at("param_groups.1.centered").item<double>() == 1.0);
  int square_avg = 0, grad_avg = 0, momentum = 0;
  for (const auto& [k, t] : full) {
    auto ends = [&](const std::string& f) {
      return k.size() > f.size() && k.compare(k.size() - f.size(), f.size(), f) == 0;
    };
    square_avg += ends(".square_avg");
    grad_avg += ends(".grad_avg");
    momentum += ends(".momentum_buffer");
  }
  const int params = static_cast<int>(model->parameters().size());
  TORCH_CHECK(square_avg == params && grad_avg == params && momentum == params, "RMSprop state missing: ", square_avg,
              " ", grad_avg, " ", momentum, " of ", params);
  auto fresh = sharded_model(7);
  auto fresh_opt = make_opt("rmsprop", *fresh, 1);
  ckpt::StateDict from_rank0;
  if (fsdp::dist::rank() == 0) from_rank0 = full;
  ckpt::set_optimizer_state_dict(*fresh, *fresh_opt, from_rank0, {.broadcast_from_rank0 = true});
  TORCH_CHECK(hyperparameters(*fresh_opt) == hyperparameters(*opt), "hyperparameters not broadcast");
  auto again = ckpt::get_optimizer_state_dict(*fresh, *fresh_opt, {.full_state_dict = true});
  TORCH_CHECK(again.size() == full.size(), again.size(), " vs ", full.size());
  for (const auto& [k, t] : full) TORCH_CHECK(at::equal(again.at(k), t), k, " differs after the round trip");
}

// ---- tests ---------------------------------------------------------------------------------

class OptimizerCheckpoint : public ::testing::TestWithParam<std::string> {};

TEST_P(OptimizerCheckpoint, SaveAtTwoLoadAtOneAndThreeContinuesExactly) {
  TempDir dir("fsdp_optim_" + GetParam());
  RanksOptions o;
  o.timeout = std::chrono::seconds(240);
  o.env["CKPT_DIR"] = dir / "n2";
  o.env["OPTIMIZER"] = GetParam();
  EXPECT_RANKS_PASS(2, "optimizer_train_save", o);
  ASSERT_TRUE(ckpt::is_committed(dir / "n2"));
  // The keys: per-parameter state by name, each group's hyperparameters.
  const auto saved = ckpt::describe(dir / "n2");
  EXPECT_TRUE(saved.count("optim.param_groups.0.lr"));
  EXPECT_TRUE(saved.count("optim.param_groups.1.lr"));
  EXPECT_FALSE(saved.count("optim.param_groups.2.lr"));
  EXPECT_RANKS_PASS(1, "optimizer_load_continue", o);
  EXPECT_RANKS_PASS(3, "optimizer_load_continue", o);
}

INSTANTIATE_TEST_SUITE_P(EveryOptimizer, OptimizerCheckpoint,
                         ::testing::Values("adamw", "adam", "sgd", "adagrad", "rmsprop", "heavyball"),
                         [](const auto& info) { return info.param; });

TEST(OptimizerCheckpointErrors, AnotherOptimizersCheckpointIsRefused) {
  TempDir dir("fsdp_optim_other");
  RanksOptions o;
  o.timeout = std::chrono::seconds(180);
  o.env["CKPT_DIR"] = dir / "sgd";
  o.env["OPTIMIZER"] = "sgd";
  EXPECT_RANKS_PASS(2, "optimizer_train_save", o);
  o.env["OTHER"] = "rmsprop";
  o.env["EXPECT"] = "saved by SGD";
  EXPECT_RANKS_PASS(2, "optimizer_load_into_another", o);
  o.env["OTHER"] = "adamw";
  o.env["EXPECT"] = "but the optimizer given is AdamW";
  EXPECT_RANKS_PASS(2, "optimizer_load_into_another", o);
}

TEST(OptimizerCheckpointErrors, StateDictCarriesHyperparameters) {
  RanksOptions o;
  o.timeout = std::chrono::seconds(180);
  EXPECT_RANKS_PASS(2, "optimizer_state_dict_hyperparameters", o);
}

// LBFGS: refused, saying why; an optimizer nobody registered: refused, naming its type and the way out.
TEST(OptimizerCheckpointErrors, LbfgsAndUnregisteredOptimizersAreRefused) {
  TempDir dir("fsdp_optim_refused");
  torch::manual_seed(1);
  GPT model(uneven_config());
  torch::optim::LBFGS lbfgs(model->parameters(), torch::optim::LBFGSOptions(0.1));
  EXPECT_ERROR_CONTAINS(ckpt::save(dir / "lbfgs", ckpt::State{model.ptr(), &lbfgs}), "LBFGS's state cannot be sharded");
  EXPECT_ERROR_CONTAINS(ckpt::get_optimizer_state_dict(*model, lbfgs), "flat vectors over all its parameters");
  EXPECT_FALSE(ckpt::is_committed(dir / "lbfgs"));

  struct Unregistered : torch::optim::SGD {
    using SGD::SGD;
  };
  Unregistered mine(model->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_ERROR_CONTAINS(ckpt::save(dir / "mine", ckpt::State{model.ptr(), &mine}), "Unregistered");
  EXPECT_ERROR_CONTAINS(ckpt::save(dir / "mine", ckpt::State{model.ptr(), &mine}), "register_optimizer");
}

// A registered codec replaces the previous one for its type; find_optimizer_codec sees it.
TEST(OptimizerCheckpointErrors, RegistrationIsFoundByExactType) {
  torch::manual_seed(1);
  GPT model(uneven_config());
  HeavyBall hb({torch::optim::OptimizerParamGroup(model->parameters())}, HeavyBallOptions(0.1));
  register_heavy_ball();
  const auto* codec = ckpt::find_optimizer_codec(hb);
  ASSERT_NE(codec, nullptr);
  EXPECT_EQ(codec->name, "HeavyBall");
  EXPECT_EQ(codec->fields.size(), 2u);
  register_heavy_ball();  // again: replaced, not duplicated
  EXPECT_EQ(ckpt::find_optimizer_codec(hb)->name, "HeavyBall");
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_EQ(ckpt::optimizer_codec(sgd).name, "SGD");
}
