// gpu_bench: one GPU, GPT at a size that keeps it busy, bf16 compute with fp32 master weights:
// plain LibTorch training (the limit) against fully_shard in a world of one on NCCL, in one run.
// benchmarks/fsdp2_gpu_bench.py measures PyTorch's own FSDP2 on the same model and batch.
//
//   build/bin/gpu_bench [--layers 12] [--dim 1024] [--heads 16] [--seq 1024] [--batch 8]
//                       [--steps 20] [--warmup 5] [--rounds 2]
//
// Rows (one line each, "row <name> key=value ..."): tokens/s (median step), peak GPU memory
// allocated, and for fully_shard how long the compute stream waited on all-gathers per step.
// Plain: the fp32 model is the optimizer's; a bf16 copy computes (copied in before each step,
// gradients handed back in fp32): the same arithmetic as FSDP's MixedPrecisionPolicy.
#include <torch/cuda.h>
#include <torch/torch.h>

#ifdef FSDP_HAS_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_support.h"
#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace {

using fsdp_bench::median;

struct Options {
  fsdp_bench::GptShape shape{12, 1024, 16, 1024, 8};
  int steps = 20, warmup = 5, rounds = 2;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args("gpu_bench",
                        "usage: gpu_bench [--layers N] [--dim N] [--heads N] [--seq N] [--batch N] [--steps N] "
                        "[--warmup N] [--rounds N]");
  o.shape.add_options(args);
  args.option("--steps", &o.steps).option("--warmup", &o.warmup).option("--rounds", &o.rounds);
  args.parse(argc, argv);
  return o;
}

const torch::Device kGpu(torch::kCUDA, 0);

void reset_peak() {
#ifdef FSDP_HAS_CUDA
  // The caching allocator refuses its statistics ("Invalid device argument") until it has served a
  // first allocation on the device (seen on the first GPU run): make one.
  (void)at::empty({1}, at::TensorOptions().device(kGpu));
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}
double peak_gib() {
#ifdef FSDP_HAS_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0 * 1024.0);  // [0]: all pools
#else
  return 0;
#endif
}

fsdp::models::GPTConfig config_of(const Options& o, torch::Device device) {
  auto c = o.shape.config(device);
  c.init_seed = 1;
  return c;
}

struct Result {
  double step_s = 0, peak = 0, wait_s = 0, loss = 0;
};

template <typename StepFn>
Result time_steps(const Options& o, StepFn step) {
  std::vector<double> times;
  Result r;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) fsdp::all_gather_wait_seconds();  // drop the warmup's waits
    const auto t0 = std::chrono::steady_clock::now();
    r.loss = step(s);  // .item(): waits for the GPU
    if (s >= o.warmup) times.push_back(fsdp_bench::seconds_since(t0));
  }
  r.step_s = median(times);
  r.wait_s = fsdp::all_gather_wait_seconds() / o.steps;
  r.peak = peak_gib();
  return r;
}

at::Tensor batch_of(const Options& o, int step) {
  auto gen = at::detail::createCPUGenerator(100 + step);
  return at::randint(256, {o.shape.batch, o.shape.seq + 1}, gen, at::kLong).to(kGpu);
}

Result run_plain(const Options& o) {
  reset_peak();
  const auto c = config_of(o, kGpu);
  fsdp::models::GPT master(c), compute(c);
  compute->to(at::kBFloat16);
  torch::optim::AdamW opt(master->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  auto masters = master->parameters(), computes = compute->parameters();
  return time_steps(o, [&](int s) {
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < masters.size(); ++i) computes[i].copy_(masters[i]);
    }
    for (auto& p : computes) p.mutable_grad().reset();
    auto data = batch_of(o, s);
    auto loss = fsdp::models::gpt_loss(compute->forward(data.narrow(1, 0, o.shape.seq)).to(at::kFloat),
                                       data.narrow(1, 1, o.shape.seq));
    loss.backward();
    for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = computes[i].grad().to(at::kFloat);
    opt.step();
    return loss.item<double>();
  });
}

Result run_fsdp(const Options& o) {
  reset_peak();
  fsdp::models::GPT model(config_of(o, torch::kMeta));
  fsdp::FullyShardOptions so;
  so.mp_policy.param_dtype = at::kBFloat16;
  so.mp_policy.reduce_dtype = at::kFloat;
  fsdp_bench::shard_gpt(model, so);
  fsdp::to_empty(*model, kGpu);
  model->reset_parameters();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  fsdp::set_all_gather_wait_timing(true);
  Result r = time_steps(o, [&](int s) {
    opt.zero_grad();
    auto data = batch_of(o, s);
    auto loss = fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, o.shape.seq)).to(at::kFloat),
                                       data.narrow(1, 1, o.shape.seq));
    loss.backward();
    opt.step();
    return loss.item<double>();
  });
  fsdp::set_all_gather_wait_timing(false);
  return r;
}

void print_row(const char* name, const Options& o, const Result& r, const Result* plain) {
  const double tokens = static_cast<double>(o.shape.batch * o.shape.seq);
  std::printf("row %-6s tokens_per_s=%.0f step_ms=%.1f peak_gib=%.2f ag_wait_ms_per_step=%.2f last_loss=%.4f", name,
              tokens / r.step_s, r.step_s * 1e3, r.peak, r.wait_s * 1e3, r.loss);
  if (plain) std::printf(" vs_plain=%.3f", plain->step_s / r.step_s);
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (!torch::cuda::is_available()) {
    std::fprintf(stderr, "gpu_bench: no GPU visible (torch::cuda::is_available() is false); nothing to measure\n");
    return 2;
  }
  fsdp::dist::InitOptions init;
  init.device_type = "cuda";  // a world of one on NCCL
  fsdp::dist::init_distributed(init);
  std::printf(
      "config layers=%lld dim=%lld heads=%lld seq=%lld batch=%lld bf16 params, fp32 reduce+master; steps=%d warmup=%d "
      "rounds=%d\n",
      static_cast<long long>(o.shape.layers), static_cast<long long>(o.shape.dim),
      static_cast<long long>(o.shape.heads), static_cast<long long>(o.shape.seq), static_cast<long long>(o.shape.batch),
      o.steps, o.warmup, o.rounds);
  Result best_plain, best_fsdp;
  for (int round = 0; round < o.rounds; ++round) {  // alternate; keep each one's best median
    Result p = run_plain(o);
    Result f = run_fsdp(o);
    if (round == 0 || p.step_s < best_plain.step_s) best_plain = p;
    if (round == 0 || f.step_s < best_fsdp.step_s) best_fsdp = f;
  }
  print_row("plain", o, best_plain, nullptr);
  print_row("fsdp", o, best_fsdp, &best_plain);
  std::printf("target fsdp >= 0.97 x plain tokens/s: %s\n",
              best_plain.step_s / best_fsdp.step_s >= 0.97 ? "met" : "NOT met");
  return 0;
}
