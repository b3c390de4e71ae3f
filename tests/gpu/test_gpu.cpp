// GPU tests: fully_shard on CUDA tensors, with the side streams of [Note: FSDP streams].
// Each test skips, with its reason, where no GPU is visible or LibTorch has no CUDA/NCCL, so the
// suite stays green on CPU machines; scripts/gpu-check.sh runs them on a GPU machine.
//
//   world of one on NCCL vs plain LibTorch training on the same GPU (fp32 and bf16)
//   2 and 3 ranks sharing one GPU through Gloo on CUDA tensors (NCCL refuses two ranks on one
//   device) vs one process: the stream/event ordering with real cross-rank collectives
//   CPU offload (pinned shards and gradients), meta init onto the GPU, and 50 steps of a model of
//   many small units compared at every step (a buffer freed too early across streams shows up
//   as drift or garbage).
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "fsdp/comm/backend.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "multiprocess.h"

using fsdp::models::GPT;
using fsdp::models::GPTConfig;
using fsdp::testing::run_ranks;
using fsdp::testing::RanksOptions;

namespace {

// Why a GPU test cannot run here; empty when it can.
std::string gpu_skip_reason(bool needs_nccl) {
#ifndef FSDP_HAS_CUDA
  return "this LibTorch (" + std::string(TORCH_VERSION) +
         ") is a CPU build: rebuild against a CUDA LibTorch (scripts/cuda-build-check.sh)";
#else
  if (!torch::cuda::is_available()) return "no GPU visible (torch::cuda::is_available() is false)";
  if (needs_nccl && !fsdp::comm::nccl_available()) return "this LibTorch has no NCCL backend";
  return "";
#endif
}

#define SKIP_WITHOUT_GPU(needs_nccl)                      \
  do {                                                    \
    const std::string why_ = gpu_skip_reason(needs_nccl); \
    if (!why_.empty()) GTEST_SKIP() << why_;              \
  } while (0)

GPTConfig small_config() {
  GPTConfig c;  // uneven on purpose: 2 and 3 divide none of the row counts
  c.vocab_size = 67;
  c.block_size = 11;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 20;
  return c;
}

constexpr int64_t kBatch = 6;

at::Tensor batch_of(const GPTConfig& c, int step) {
  auto gen = at::detail::createCPUGenerator(1000 + 17 * step);
  return at::randint(c.vocab_size, {kBatch, c.block_size + 1}, gen, at::kLong);
}

torch::Device gpu() { return torch::Device(torch::kCUDA, 0); }

GPT fresh_model(const GPTConfig& c) {
  torch::manual_seed(42);
  GPT m(c);  // initialised on the CPU (same values everywhere), then moved
  m->to(gpu());
  return m;
}

torch::optim::AdamW optimizer_for(torch::nn::Module& m) {
  return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).eps(1e-3));
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;  // plain runs: full parameters, on the CPU
  GPT model{nullptr};                        // sharded runs: the trained model
};

// Plain LibTorch on the GPU, the whole batch. bf16: fp32 master weights, a bf16 compute copy.
Run train_plain(const GPTConfig& c, int steps, bool bf16) {
  GPT master = fresh_model(c);
  GPT compute = fresh_model(c);
  if (bf16) compute->to(at::kBFloat16);
  auto opt = optimizer_for(*master);
  auto masters = master->parameters();
  auto computes = compute->parameters();
  Run r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < masters.size(); ++i) computes[i].copy_(masters[i]);
    }
    for (auto& p : computes) p.mutable_grad().reset();
    auto data = batch_of(c, s).to(gpu());
    auto logits = compute->forward(data.narrow(1, 0, c.block_size)).to(at::kFloat);
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = computes[i].grad().to(at::kFloat);
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& p : master->named_parameters()) r.params[p.key()] = p.value().detach().cpu().clone();
  return r;
}

// Largest relative difference (magnitudes below 1 count as 1) of this rank's shards against the
// reference's rows; throws naming the parameter above `tol`.
double check_shards(GPT& model, const std::map<std::string, at::Tensor>& ref, double tol) {
  double worst = 0;
  for (const auto& p : model->named_parameters()) {
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not a shard");
    at::Tensor want = ref.at(p.key());
    if (want.dim() == 0) want = want.reshape({1});
    want = want.narrow(0, info->dim0_offset, info->local_rows);
    const at::Tensor got = p.value().detach().cpu();
    const double d = want.numel() ? ((got - want).abs() / want.abs().clamp_min(1.0)).max().item<double>() : 0.0;
    TORCH_CHECK(d <= tol, p.key(), " differs from plain training by ", d, " (relative), tolerance ", tol);
    worst = std::max(worst, d);
  }
  return worst;
}

void check_losses(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  TORCH_CHECK(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double rel = std::abs(got[i] - want[i]) / std::abs(want[i]);
    TORCH_CHECK(std::isfinite(got[i]) && rel <= tol, "step ", i, ": loss ", got[i], " vs plain ", want[i],
                " (relative ", rel, ", tolerance ", tol, ")");
  }
}

// FSDP: this rank's slice of every batch; `shard` applies fully_shard. Steps compared as they go
// when `want` is given (a drift shows at the step it starts).
Run train_fsdp(const GPTConfig& c, int steps, const std::function<void(GPT&)>& shard, bool bf16,
               const std::vector<double>* want = nullptr, double tol = 0) {
  auto world = fsdp::dist::world_comm();
  const int n = world->size(), rank = world->rank();
  const int64_t local = kBatch / n;
  GPT model = fresh_model(c);
  shard(model);
  auto opt = optimizer_for(*model);
  fsdp::check_optimizer_params(opt);
  Run r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto data = batch_of(c, s).narrow(0, rank * local, local).to(gpu());
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    TORCH_CHECK(logits.is_cuda(), "forward must run on the GPU");
    if (bf16) TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "forward must compute in bf16");
    auto loss = fsdp::models::gpt_loss(logits.to(at::kFloat), data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
    auto l = at::tensor({loss.item<double>()}, at::kDouble).to(gpu());
    world->all_reduce(l, fsdp::comm::ReduceOp::Avg);
    r.losses.push_back(l.item<double>());
    if (want) {
      const double rel = std::abs(r.losses.back() - (*want)[s]) / std::abs((*want)[s]);
      TORCH_CHECK(rel <= tol, "step ", s, ": loss ", r.losses.back(), " vs plain ", (*want)[s], " (relative ", rel,
                  ")");
    }
  }
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.scalar_type() == at::kFloat, "the master shards stay fp32");
  }
  r.model = model;
  return r;
}

}  // namespace

namespace {

fsdp::FullyShardOptions gpu_options(bool bf16) {
  fsdp::FullyShardOptions o;
  if (bf16) {
    o.mp_policy.param_dtype = at::kBFloat16;
    o.mp_policy.reduce_dtype = at::kFloat;
  }
  return o;
}

void shard_blocks_then_root(GPT& model, const fsdp::FullyShardOptions& o) {
  for (auto& b : model->blocks) fsdp::fully_shard(b, o);
  fsdp::fully_shard(model, o);
}

void init_cuda_runtime(bool gloo) {
  fsdp::dist::InitOptions init;
  init.device_type = "cuda";
  if (gloo) init.backend = fsdp::comm::BackendKind::Gloo;
  fsdp::dist::init_distributed(init);
}

// fp32 within 1e-6 (relative); bf16 within the CPU bf16 test's bounds (losses 2e-3, shards 5e-3).
void parity_worker(bool gloo, bool bf16) {
  init_cuda_runtime(gloo);
  const auto c = small_config();
  const int steps = 10;
  const Run want = train_plain(c, steps, bf16);
  const double loss_tol = bf16 ? 2e-3 : 1e-6, param_tol = bf16 ? 5e-3 : 1e-6;
  const auto o = gpu_options(bf16);
  Run got = train_fsdp(
      c, steps, [&](GPT& m) { shard_blocks_then_root(m, o); }, bf16);
  check_losses(got.losses, want.losses, loss_tol);
  const double worst = check_shards(got.model, want.params, param_tol);
  if (fsdp::dist::rank() == 0) {
    std::cout << "ranks " << fsdp::dist::world_size() << (gloo ? " (gloo on cuda)" : " (nccl)")
              << (bf16 ? " bf16" : " fp32") << ": last loss " << got.losses.back() << " vs plain " << want.losses.back()
              << ", worst shard difference " << worst << std::endl;
  }
}

RanksOptions gpu_ranks() {
  RanksOptions o;
  o.init_runtime = false;                         // the workers initialise a "cuda" runtime themselves
  o.timeout = std::chrono::milliseconds(120000);  // gpu-check.sh gives the whole binary 150 s
  return o;
}

}  // namespace

FSDP_RANK_WORKER(gpu_nccl_fp32) { parity_worker(/*gloo=*/false, /*bf16=*/false); }
FSDP_RANK_WORKER(gpu_nccl_bf16) { parity_worker(/*gloo=*/false, /*bf16=*/true); }
FSDP_RANK_WORKER(gpu_gloo_fp32) { parity_worker(/*gloo=*/true, /*bf16=*/false); }

// CPU offload on a GPU: shards and their gradients in pinned host memory, the optimizer on the CPU.
FSDP_RANK_WORKER(gpu_cpu_offload) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  const int steps = 10;
  const Run want = train_plain(c, steps, /*bf16=*/false);
  fsdp::FullyShardOptions o;
  o.offload_policy = fsdp::CPUOffloadPolicy{};
  GPT model = fresh_model(c);
  shard_blocks_then_root(model, o);
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.device().is_cpu() && p.is_pinned(), "offloaded shards must be pinned host memory");
  }
  auto opt = optimizer_for(*model);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto data = batch_of(c, s).to(gpu());
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    TORCH_CHECK(logits.is_cuda(), "forward must run on the GPU");
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    for (const auto& p : model->parameters()) {
      TORCH_CHECK(p.grad().defined() && p.grad().device().is_cpu() && p.grad().is_pinned(),
                  "offloaded gradients must land in pinned host memory");
    }
    opt.step();
    losses.push_back(loss.item<double>());
  }
  check_losses(losses, want.losses, 1e-6);
  check_shards(model, want.params, 1e-6);
}

// Meta init straight onto the GPU: the same values as the unsharded model built with the seed.
FSDP_RANK_WORKER(gpu_meta_init) {
  init_cuda_runtime(/*gloo=*/false);
  auto c = small_config();
  c.init_seed = 1234;
  GPTConfig full_c = c;
  full_c.device = gpu();
  GPT full(full_c);
  full->reset_parameters();
  std::map<std::string, at::Tensor> want;
  for (const auto& p : full->named_parameters()) want[p.key()] = p.value().detach().cpu();

  c.device = torch::kMeta;
  GPT model(c);
  shard_blocks_then_root(model, {});
  fsdp::to_empty(*model, gpu());
  model->reset_parameters();
  for (const auto& p : model->parameters()) TORCH_CHECK(p.is_cuda(), "materialised shards must be on the GPU");
  check_shards(model, want, 0.0);  // identical
  auto data = batch_of(c, 0).to(gpu());
  auto loss =
      fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
  loss.backward();
  TORCH_CHECK(std::isfinite(loss.item<double>()), "the materialised model must train");
}

// Many small units, 50 steps, compared at every step: 16 blocks, ln_f and lm_head are units of
// their own (plus the root's embeddings), so 19 all-gathers and reduce-scatters per step cross the
// streams, prefetched while the neighbouring unit computes.
FSDP_RANK_WORKER(gpu_many_units) {
  const bool gloo = std::getenv("FSDP_TEST_GLOO") != nullptr;
  init_cuda_runtime(gloo);
  auto c = small_config();
  c.n_layer = 16;
  const int steps = 50;
  const Run want = train_plain(c, steps, /*bf16=*/false);
  auto many_units = [](GPT& m) {
    for (auto& b : m->blocks) fsdp::fully_shard(b);
    fsdp::fully_shard(m->ln_f);
    fsdp::fully_shard(m->lm_head);
    fsdp::fully_shard(m);
  };
  Run got = train_fsdp(c, steps, many_units, /*bf16=*/false, &want.losses, 1e-5);
  check_shards(got.model, want.params, 1e-5);
}

TEST(Gpu, WorldOfOneOnNcclMatchesPlainTrainingFp32) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_fp32", gpu_ranks());
}

TEST(Gpu, WorldOfOneOnNcclMatchesPlainTrainingBf16) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_bf16", gpu_ranks());
}

TEST(Gpu, TwoRanksSharingOneGpuMatchOneProcess) {
  SKIP_WITHOUT_GPU(false);
  EXPECT_RANKS_PASS(2, "gpu_gloo_fp32", gpu_ranks());
}

TEST(Gpu, ThreeRanksSharingOneGpuMatchOneProcess) {
  SKIP_WITHOUT_GPU(false);
  EXPECT_RANKS_PASS(3, "gpu_gloo_fp32", gpu_ranks());
}

TEST(Gpu, CpuOffloadUsesPinnedMemoryAndMatches) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_cpu_offload", gpu_ranks());
}

TEST(Gpu, MetaInitOntoTheGpuMatchesTheUnshardedInit) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_meta_init", gpu_ranks());
}

TEST(Gpu, FiftyStepsOfManySmallUnitsMatchEveryStep) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_many_units", gpu_ranks());
}

TEST(Gpu, FiftyStepsOfManySmallUnitsTwoRanksSharingOneGpu) {
  SKIP_WITHOUT_GPU(false);
  auto o = gpu_ranks();
  o.env["FSDP_TEST_GLOO"] = "1";
  EXPECT_RANKS_PASS(2, "gpu_many_units", o);
}
