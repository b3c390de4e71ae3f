// Two ranks on one GPU through Gloo, CUDA tensors: every multi-rank path of fully_shard's GPU side
// (the copy-in, all-gather and reduce-scatter streams and their events, prefetching several units
// ahead, reduce-scatter with AVG across ranks, clip_grad_norm_'s all-reduce) where NCCL cannot run
// it (NCCL refuses two ranks on one device; Gloo moves the CUDA tensors through the host). A small
// Llama (grouped-query attention, rows that do not split evenly) trains a few steps at 2 ranks,
// each on its half of the global batch, against one process training the whole batch on the same
// GPU: every step's loss and the final shards within 1e-5 (relative).
//
//   GpuTwoRanks.PrefetchingTwoAheadMatchesOneProcess   explicit forward and backward prefetch of the
//                                                      next two units, clip_grad_norm_
//   GpuTwoRanks.KeepAfterForwardWithRaceModeMatches    reshard_after_forward=false, the stream-race
//                                                      mode on (FSDP_STREAM_RACE_US: a missing wait
//                                                      reads unwritten memory)
//   GpuTwoRanks.SameChecksOnTheCpuThroughGloo          the workers on the CPU: checks this test's own
//                                                      logic on machines without a GPU
//
// Each GPU test skips with its reason without a GPU or a CUDA LibTorch; scripts/gpu-check.sh runs
// this binary on a GPU machine and prints its result among the summary's first lines.
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "gpu_skip.h"
#include "models/gpt.h"
#include "models/llama/llama.h"
#include "multiprocess.h"

using fsdp::models::Llama;
using fsdp::models::LlamaConfig;
using fsdp::testing::RanksOptions;

namespace {

constexpr int64_t kGlobalBatch = 4, kSeq = 12;
constexpr int kSteps = 6;
constexpr double kTol = 1e-5;

// Uneven on purpose: 67 vocabulary rows and the KV projections' 12 rows over 2 ranks, 3 units.
LlamaConfig small_llama() {
  LlamaConfig c;
  c.vocab_size = 67;
  c.hidden_size = 24;
  c.intermediate_size = 36;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.max_position_embeddings = kSeq;
  c.init_seed = 7;
  c.device = torch::kCPU;  // built (and initialised) on the CPU in every process, then moved
  return c;
}

torch::Device device() {
  return std::getenv("FSDP_TEST_ON_CPU") ? torch::Device(torch::kCPU) : torch::Device("cuda:0");
}

Llama fresh_llama() {
  Llama m(small_llama());
  m->to(device());
  return m;
}

at::Tensor global_batch(int step) {
  auto gen = at::detail::createCPUGenerator(500 + 31 * step);
  return at::randint(small_llama().vocab_size, {kGlobalBatch, kSeq + 1}, gen, at::kLong);
}

torch::optim::AdamW optimizer_for(torch::nn::Module& m) {
  return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).eps(1e-3));
}

at::Tensor loss_of(Llama& model, const at::Tensor& data, bool sharded) {
  auto input = data.narrow(1, 0, kSeq);
  auto logits = sharded ? fsdp::call(model, input) : model->forward(input);
  return fsdp::models::gpt_loss(logits, data.narrow(1, 1, kSeq));
}

struct Reference {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;  // on the CPU, full
};

// One process, the whole global batch, on the same device, clipping as the sharded run does.
Reference one_process() {
  Llama model = fresh_llama();
  auto opt = optimizer_for(*model);
  Reference r;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto loss = loss_of(model, global_batch(s).to(device()), /*sharded=*/false);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 0.5);
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->named_parameters()) r.params[p.key()] = p.value().detach().cpu();
  return r;
}

// fully_shard per decoder layer, then the root; `ahead` units prefetched explicitly each way.
std::vector<fsdp::FSDPModule> shard(Llama& model, bool reshard_after_forward, int ahead) {
  fsdp::FullyShardOptions o;
  o.reshard_after_forward = reshard_after_forward;
  std::vector<fsdp::FSDPModule> units;
  for (auto& layer : model->layers()) units.push_back(fsdp::fully_shard(layer, o));
  fsdp::fully_shard(model, o);
  const int n = static_cast<int>(units.size());
  for (int i = 0; ahead > 0 && i < n; ++i) {
    std::vector<fsdp::FSDPModule> next, previous;
    for (int k = 1; k <= ahead; ++k) {
      if (i + k < n) next.push_back(units[i + k]);
      if (i - k >= 0) previous.push_back(units[i - k]);
    }
    units[i].set_modules_to_forward_prefetch(next);
    units[i].set_modules_to_backward_prefetch(previous);
  }
  return units;
}

// The largest relative difference (magnitudes below 1 count as 1) of this rank's shards against
// the reference's rows.
double worst_shard_difference(Llama& model, const Reference& ref) {
  double worst = 0;
  for (const auto& p : model->named_parameters()) {
    const auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not a shard");
    TORCH_CHECK(p.value().device() == device(), p.key(), " left ", device());
    at::Tensor want = ref.params.at(p.key());
    want = want.narrow(0, info->dim0_offset, info->local_rows);
    const at::Tensor got = p.value().detach().cpu();
    if (want.numel() > 0)
      worst = std::max(worst, ((got - want).abs() / want.abs().clamp_min(1.0)).max().item<double>());
  }
  return worst;
}

void two_rank_worker(bool reshard_after_forward, int ahead) {
  fsdp::dist::InitOptions init;
  init.device_type = device().is_cuda() ? "cuda" : "cpu";
  init.backend = fsdp::comm::BackendKind::Gloo;  // NCCL refuses two ranks on one GPU
  fsdp::dist::init_distributed(init);
  auto world = fsdp::dist::world_comm();
  TORCH_CHECK(world->size() == 2 && world->backend_kind() == fsdp::comm::BackendKind::Gloo, "2 ranks on Gloo");
  const Reference ref = one_process();
  Llama model = fresh_llama();
  shard(model, reshard_after_forward, ahead);
  auto opt = optimizer_for(*model);
  fsdp::check_optimizer_params(opt);
  const int64_t local = kGlobalBatch / world->size();
  double worst_loss = 0;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto data = global_batch(s).narrow(0, world->rank() * local, local).to(device());
    auto loss = loss_of(model, data, /*sharded=*/true);
    loss.backward();
    fsdp::clip_grad_norm_(model->parameters(), 0.5);
    opt.step();
    auto mean = loss.detach().reshape({1}).to(at::kDouble);
    world->all_reduce(mean, fsdp::comm::ReduceOp::Avg);
    const double got = mean.item<double>(), rel = std::abs(got - ref.losses[s]) / std::abs(ref.losses[s]);
    TORCH_CHECK(std::isfinite(got) && rel <= kTol, "step ", s, ": loss ", got, " vs one process ", ref.losses[s],
                " (relative ", rel, ", tolerance ", kTol, ")");
    worst_loss = std::max(worst_loss, rel);
  }
  const double worst_shard = worst_shard_difference(model, ref);
  TORCH_CHECK(worst_shard <= kTol, "shards differ from one process by ", worst_shard, " (relative)");
  if (world->rank() == 0) {
    std::cout << "two ranks on " << device() << " through Gloo, " << kSteps << " steps"
              << (reshard_after_forward ? "" : ", reshard_after_forward=false") << ", prefetch " << ahead
              << " ahead: losses within " << worst_loss << " of one process, shards within " << worst_shard
              << std::endl;
  }
  fsdp::dist::destroy_distributed();
}

RanksOptions two_ranks(bool on_cpu) {
  RanksOptions o;
  o.init_runtime = false;  // the workers join a world of their own device and backend
  o.timeout = std::chrono::milliseconds(120000);
  if (on_cpu) o.env["FSDP_TEST_ON_CPU"] = "1";
  return o;
}

}  // namespace

FSDP_RANK_WORKER(two_ranks_prefetch) { two_rank_worker(/*reshard_after_forward=*/true, /*ahead=*/2); }
FSDP_RANK_WORKER(two_ranks_keep) { two_rank_worker(/*reshard_after_forward=*/false, /*ahead=*/0); }

TEST(GpuTwoRanks, PrefetchingTwoAheadMatchesOneProcess) {
  if (const auto why = fsdp_gpu_test::gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  EXPECT_RANKS_PASS(2, "two_ranks_prefetch", two_ranks(/*on_cpu=*/false));
}

TEST(GpuTwoRanks, KeepAfterForwardWithRaceModeMatches) {
  if (const auto why = fsdp_gpu_test::gpu_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  auto o = two_ranks(/*on_cpu=*/false);
  o.env["FSDP_STREAM_RACE_US"] = "200";
  EXPECT_RANKS_PASS(2, "two_ranks_keep", o);
}

TEST(GpuTwoRanks, SameChecksOnTheCpuThroughGloo) {
  EXPECT_RANKS_PASS(2, "two_ranks_prefetch", two_ranks(/*on_cpu=*/true));
  EXPECT_RANKS_PASS(2, "two_ranks_keep", two_ranks(/*on_cpu=*/true));
}
