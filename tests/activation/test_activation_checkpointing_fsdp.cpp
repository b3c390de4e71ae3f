// Activation checkpointing composed with fully_shard: 10 AdamW steps with `full` and `every:2`
// give the losses and final parameters of the same run without checkpointing (fp32 within 1e-6,
// bf16 within the bf16 parity bounds), at 1, 2, 3 ranks, HSDP 2x2, gradient accumulation,
// reshard_after_forward false and 2, CPU offload, and with dropout (RNG replay); without the
// replay the dropout run differs, so the replay is what makes it exact.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 10;

std::string env(const char* name, const std::string& fallback = "") {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Largest |a - b| / max(|b|, 1) over two identically sharded models' parameters.
double max_param_diff(GPT& a, GPT& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  TORCH_CHECK(pa.size() == pb.size());
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    TORCH_CHECK(pa[i].key() == pb[i].key(), "parameter names differ: ", pa[i].key(), " vs ", pb[i].key());
    const auto& x = pa[i].value();
    const auto& y = pb[i].value();
    if (x.numel() == 0) continue;
    worst = std::max(worst, ((x.detach() - y.detach()).abs() / y.detach().abs().clamp_min(1.0)).max().item<double>());
  }
  return worst;
}

double max_loss_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]) / std::abs(b[i]));
  return worst;
}

}  // namespace

// Settings from the environment: AC_MODE full|every:2, AC_MESH "RxS" (HSDP), AC_MICRO micro-
// batches, AC_DROPOUT p, AC_MP bf16, AC_OFFLOAD 1, AC_RAF 0|1|k, AC_NO_RNG 1 (expect a difference).
FSDP_RANK_WORKER(checkpointed_run_matches_plain) {
  auto c = uneven_config();
  c.n_layer = 4;
  c.dropout = std::stod(env("AC_DROPOUT", "0"));
  const std::string mode = env("AC_MODE", "full");
  const int k = mode == "full" ? 1 : std::stoi(mode.substr(mode.find(':') + 1));
  const int micro = std::stoi(env("AC_MICRO", "1"));
  const bool bf16 = env("AC_MP") == "bf16";
  const bool expect_difference = env("AC_NO_RNG") == "1";

  fsdp::FullyShardOptions o;
  if (const std::string m = env("AC_MESH"); !m.empty()) {
    o.mesh = fsdp::init_device_mesh({std::stoll(m.substr(0, m.find('x'))), std::stoll(m.substr(m.find('x') + 1))},
                                    {"replicate", "shard"});
  }
  if (bf16) {
    o.mp_policy.param_dtype = at::kBFloat16;
    o.mp_policy.reduce_dtype = at::kFloat;
  }
  if (env("AC_OFFLOAD") == "1") o.offload_policy = fsdp::CPUOffloadPolicy{};
  if (const std::string raf = env("AC_RAF"); !raf.empty()) {
    const int v = std::stoi(raf);
    o.reshard_after_forward = v <= 1 ? std::variant<bool, int>(v == 1) : std::variant<bool, int>(v);
  }

  auto run = [&](bool checkpointed) {
    ShardedRun r;
    r.shard = [&](GPT& model) {
      if (checkpointed) {
        fsdp::activation::CheckpointOptions co;
        co.preserve_rng_state = !expect_difference;
        fsdp::activation::apply_activation_checkpointing(*model,
                                                         fsdp::activation::every_kth<fsdp::models::BlockImpl>(k), co);
      }
      for (auto& b : model->blocks) fsdp::fully_shard(b, o);
      auto root = o;
      root.reshard_after_forward.reset();
      fsdp::fully_shard(model, root);
    };
    if (micro > 1) {
      // Accumulate without gradient sync; reduce-scatter once, in the last micro-batch.
      r.before_micro_batch = [](int m, int n, GPT& model) {
        fsdp::fsdp_module(*model)->set_requires_gradient_sync(m == n - 1);
      };
    }
    if (bf16) r.forward = [](GPT& model, const at::Tensor& x) { return fsdp::call(model, x).to(at::kFloat); };
    return train_sharded(c, kSteps, /*batch=*/12, micro, r);
  };
  auto plain = run(false);
  auto ckpt = run(true);
  const double loss_diff = max_loss_diff(ckpt.losses, plain.losses);
  const double param_diff = max_param_diff(ckpt.model, plain.model);
  if (fsdp::dist::rank() == 0) {
    std::cout << "ranks " << fsdp::dist::world_size() << " mode " << mode << " mesh '" << env("AC_MESH") << "' micro "
              << micro << " dropout " << c.dropout << (bf16 ? " bf16" : "") << (expect_difference ? " no-rng" : "")
              << ": last loss " << ckpt.losses.back() << " vs " << plain.losses.back() << ", loss diff " << loss_diff
              << ", param diff " << param_diff << std::endl;
  }
  if (expect_difference) {
    TORCH_CHECK(param_diff > 1e-4, "without RNG replay the dropout run should differ, got ", param_diff);
    return;
  }
  const double loss_tol = bf16 ? 2e-3 : 1e-6, param_tol = bf16 ? 5e-3 : 1e-6;
  TORCH_CHECK(loss_diff <= loss_tol, "losses differ by ", loss_diff, " (relative), tolerance ", loss_tol);
  TORCH_CHECK(param_diff <= param_tol, "parameters differ by ", param_diff, " (relative), tolerance ", param_tol);
}

namespace {
void expect_match(int world, std::map<std::string, std::string> settings) {
  RanksOptions o;
  o.env = std::move(settings);
  o.timeout = std::chrono::milliseconds(300000);
  auto r = run_ranks(world, "checkpointed_run_matches_plain", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}
}  // namespace

TEST(ActivationCheckpointExact, OneProcess) {
  expect_match(1, {{"AC_MODE", "full"}});
  expect_match(1, {{"AC_MODE", "every:2"}});
}
TEST(ActivationCheckpointExact, FsdpTwoRanks) {
  expect_match(2, {{"AC_MODE", "full"}});
  expect_match(2, {{"AC_MODE", "every:2"}});
}
TEST(ActivationCheckpointExact, FsdpThreeRanks) { expect_match(3, {{"AC_MODE", "full"}}); }
TEST(ActivationCheckpointExact, Hsdp2x2) {
  expect_match(4, {{"AC_MODE", "full"}, {"AC_MESH", "2x2"}});
  expect_match(4, {{"AC_MODE", "every:2"}, {"AC_MESH", "2x2"}});
}
TEST(ActivationCheckpointExact, GradientAccumulation) {
  expect_match(2, {{"AC_MODE", "full"}, {"AC_MICRO", "2"}});
  expect_match(2, {{"AC_MODE", "every:2"}, {"AC_MICRO", "2"}});
}
TEST(ActivationCheckpointExact, ReshardAfterForwardFalseAndTwo) {
  expect_match(2, {{"AC_MODE", "full"}, {"AC_RAF", "0"}});
  expect_match(4, {{"AC_MODE", "full"}, {"AC_RAF", "2"}});
}
TEST(ActivationCheckpointExact, CpuOffload) { expect_match(2, {{"AC_MODE", "full"}, {"AC_OFFLOAD", "1"}}); }
TEST(ActivationCheckpointExact, Bf16) {
  expect_match(2, {{"AC_MODE", "full"}, {"AC_MP", "bf16"}});
  expect_match(2, {{"AC_MODE", "every:2"}, {"AC_MP", "bf16"}});
}
TEST(ActivationCheckpointExact, DropoutIsReplayed) {
  expect_match(1, {{"AC_MODE", "full"}, {"AC_DROPOUT", "0.1"}});
  expect_match(2, {{"AC_MODE", "full"}, {"AC_DROPOUT", "0.1"}});
  expect_match(2, {{"AC_MODE", "every:2"}, {"AC_DROPOUT", "0.1"}});
}
TEST(ActivationCheckpointExact, WithoutRngReplayDropoutDiffers) {
  expect_match(2, {{"AC_MODE", "full"}, {"AC_DROPOUT", "0.1"}, {"AC_NO_RNG", "1"}});
}
