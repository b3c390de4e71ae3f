// optimizer_bench: LibTorch's AdamW against fsdp::optim::FusedAdamW on the fp32 shards one rank
// holds when fully_shard splits a Llama over 2 ranks (what CPUOffloadPolicy leaves the host to
// step): the same initial values, the same gradients, warm-up steps then timed steps of each.
//
//   build/bin/optimizer_bench [--sizes 100m,1.1b] [--warmup N] [--steps N] [--block-melems 64] [--threads N]
//
// --threads: ATen's intra-op threads for both optimizers, every core by default (ATen's own
// default counts physical cores: 1 on a 2-vCPU virtual machine).
//
// Sizes (models/llama's LlamaConfig, built on the meta device for its parameter shapes; each
// parameter's rows ceil(rows / 2), rank 0's shard as fully_shard pads it):
//   100m   hidden 768, intermediate 2048, 12 layers, 12 heads (12 KV heads), vocab 32000, lm_head
//          untied: 135M parameters, 68M elements a rank;
//   1.1b   TinyLlama 1.1B: hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocab
//          32000: 1.1B parameters, 550M elements a rank;
//   tiny   2 layers of hidden 64 (a smoke run).
// Default steps: 2 warm-up + 5 timed (100m, tiny), 1 + 2 (1.1b).
//
// Memory: one size's shards as parameters, gradients and two moments are 16 bytes an element
// (8.8 GB for 1.1b), twice that for both optimizers at once, plus the initial values and
// LibTorch's temporaries. So the shards go through in blocks of at most --block-melems million
// elements (whole parameters, in model order): each block's parameters are stepped by LibTorch's
// AdamW, then from the same initial values by FusedAdamW, compared, and freed. An optimizer
// steps each parameter on its own, so a step over the shards is the sum of the blocks' steps;
// a block of 64M elements (1 GiB for the four fp32 tensors) is far larger than any cache.
//
// Printed per size: LibTorch's and the fused time per step, their ratio and the fused step's
// memory throughput (7 fp32 streams: p, g, m, v read, p, m, v written); last, over all sizes:
//   speedup=X max_rel_diff=Y
// speedup: LibTorch's total time / the fused total time; max_rel_diff: the largest
// max|fused - libtorch| / max|libtorch| over every parameter and moment after the steps (above
// 1e-6 the program says so and exits 1).
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_support.h"
#include "fsdp/compat/optim.h"
#include "fsdp/optim/fused.h"
#include "models/llama/llama.h"

namespace {

using Shape = std::vector<int64_t>;

struct Options {
  std::vector<std::string> sizes = {"100m", "1.1b"};
  int64_t warmup = -1, steps = -1;  // -1: the size's default
  int64_t block_melems = 64;
  int threads = static_cast<int>(std::thread::hardware_concurrency());  // every core
};

Options parse(int argc, char** argv) {
  Options o;
  std::string sizes = "100m,1.1b";
  fsdp_bench::Args args(
      "optimizer_bench",
      "usage: optimizer_bench [--sizes 100m,1.1b,tiny] [--warmup N] [--steps N] [--block-melems N] [--threads N]");
  args.option("--sizes", &sizes).option("--warmup", &o.warmup).option("--steps", &o.steps);
  args.option("--block-melems", &o.block_melems).option("--threads", &o.threads);
  args.parse(argc, argv);
  o.sizes.clear();
  std::stringstream ss(sizes);
  for (std::string s; std::getline(ss, s, ',');) {
    if (s != "100m" && s != "1.1b" && s != "tiny")
      fsdp_bench::bad_input("--sizes: '" + s + "' is not 100m, 1.1b or tiny");
    o.sizes.push_back(s);
  }
  if (o.sizes.empty()) fsdp_bench::bad_input("--sizes names no size");
  if (o.warmup < -1 || o.steps == 0 || o.steps < -1) fsdp_bench::bad_input("--warmup must be >= 0 and --steps >= 1");
  if (o.block_melems < 1) fsdp_bench::bad_input("--block-melems must be at least 1");
  if (o.threads < 1) fsdp_bench::bad_input("--threads must be at least 1");
  return o;
}

fsdp::models::LlamaConfig config_of(const std::string& size) {
  fsdp::models::LlamaConfig c;
  c.vocab_size = 32000;
  if (size == "1.1b") {
    c.hidden_size = 2048, c.intermediate_size = 5632, c.num_hidden_layers = 22;
    c.num_attention_heads = 32, c.num_key_value_heads = 4;
  } else if (size == "100m") {
    c.hidden_size = 768, c.intermediate_size = 2048, c.num_hidden_layers = 12;
    c.num_attention_heads = 12, c.num_key_value_heads = 12;
  } else {
    c.vocab_size = 256, c.hidden_size = 64, c.intermediate_size = 128, c.num_hidden_layers = 2;
    c.num_attention_heads = 4, c.num_key_value_heads = 2;
  }
  c.device = torch::kMeta;
  return c;
}

// Rank 0's shard of every parameter at 2 ranks: dim 0 cut to ceil(rows / 2).
std::vector<Shape> rank0_shards(const std::string& size, int64_t* full_numel) {
  fsdp::models::Llama model(config_of(size));
  std::vector<Shape> shapes;
  *full_numel = 0;
  for (const auto& p : model->parameters()) {
    Shape s = p.sizes().vec();
    *full_numel += p.numel();
    s[0] = (s[0] + 1) / 2;
    shapes.push_back(s);
  }
  return shapes;
}

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

// Whole parameters in model order, at most `max_elems` a block (a larger parameter alone).
std::vector<std::vector<Shape>> blocks_of(const std::vector<Shape>& shapes, int64_t max_elems) {
  std::vector<std::vector<Shape>> blocks(1);
  int64_t in_block = 0;
  for (const auto& s : shapes) {
    if (in_block > 0 && in_block + numel(s) > max_elems) {
      blocks.emplace_back();
      in_block = 0;
    }
    blocks.back().push_back(s);
    in_block += numel(s);
  }
  return blocks;
}

struct Run {
  double seconds = 0;              // the timed steps
  std::vector<at::Tensor> finals;  // per parameter: p, exp_avg, exp_avg_sq
};

// One optimizer from copies of `initial`, the gradients `grads`: `warmup` steps, then `steps` timed.
template <typename Opt>
Run run(const std::vector<at::Tensor>& initial, const std::vector<at::Tensor>& grads, int64_t warmup, int64_t steps) {
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < initial.size(); ++i) {
    params.push_back(initial[i].clone().requires_grad_());
    params.back().mutable_grad() = grads[i];
  }
  Opt opt(params, torch::optim::AdamWOptions(3e-4).betas({0.9, 0.95}).weight_decay(0.1));
  for (int64_t s = 0; s < warmup; ++s) opt.step();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t s = 0; s < steps; ++s) opt.step();
  Run r;
  r.seconds = fsdp_bench::seconds_since(t0);
  for (auto& p : params) {
    auto& state = static_cast<torch::optim::AdamWParamState&>(*opt.state().at(fsdp::compat::optimizer_state_key(p)));
    r.finals.insert(r.finals.end(), {p.detach(), state.exp_avg(), state.exp_avg_sq()});
  }
  return r;
}

double rel_diff(const at::Tensor& got, const at::Tensor& want) {
  const double scale = want.abs().max().item<double>();
  const double diff = (got - want).abs().max().item<double>();
  return diff == 0 ? 0 : diff / std::max(scale, 1e-30);
}

struct SizeResult {
  double libtorch_s = 0, fused_s = 0, max_rel_diff = 0;
  int64_t elements = 0;
};

SizeResult bench_size(const std::string& size, const Options& o, int64_t warmup, int64_t steps) {
  int64_t full = 0;
  const auto shapes = rank0_shards(size, &full);
  SizeResult r;
  const auto blocks = blocks_of(shapes, o.block_melems * 1000000);
  for (size_t b = 0; b < blocks.size(); ++b) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + b);
    std::vector<at::Tensor> initial, grads;
    for (const auto& s : blocks[b]) {
      initial.push_back(at::randn(s, gen));
      grads.push_back(at::randn(s, gen));
      r.elements += numel(s);
    }
    const Run libtorch = run<torch::optim::AdamW>(initial, grads, warmup, steps);
    const Run fused = run<fsdp::optim::FusedAdamW>(initial, grads, warmup, steps);
    r.libtorch_s += libtorch.seconds / static_cast<double>(steps);
    r.fused_s += fused.seconds / static_cast<double>(steps);
    for (size_t i = 0; i < fused.finals.size(); ++i)
      r.max_rel_diff = std::max(r.max_rel_diff, rel_diff(fused.finals[i], libtorch.finals[i]));
  }
  std::printf(
      "%-5s %5zu params %7.1fM of %7.1fM elements %3zu block(s)  libtorch %9.1f ms  fused %8.1f ms  "
      "%5.2fx  fused %5.1f GB/s  max_rel_diff %.2e\n",
      size.c_str(), shapes.size(), static_cast<double>(r.elements) / 1e6, static_cast<double>(full) / 1e6,
      blocks.size(), 1e3 * r.libtorch_s, 1e3 * r.fused_s, r.libtorch_s / r.fused_s,
      28.0 * static_cast<double>(r.elements) / r.fused_s / 1e9, r.max_rel_diff);
  std::fflush(stdout);
  return r;
}

int body(const Options& o) {
  fsdp::dist::set_num_threads(o.threads);  // both optimizers' (ATen's intra-op threads)
  std::printf("optimizer_bench: LibTorch %s AdamW vs fsdp::optim::FusedAdamW, rank 0 of 2's fp32 shards, %d threads\n",
              TORCH_VERSION, at::get_num_threads());
  double libtorch = 0, fused = 0, worst = 0;
  for (const auto& size : o.sizes) {
    const bool large = size == "1.1b";
    const int64_t warmup = o.warmup >= 0 ? o.warmup : (large ? 1 : 2);
    const int64_t steps = o.steps >= 1 ? o.steps : (large ? 2 : 5);
    const SizeResult r = bench_size(size, o, warmup, steps);
    libtorch += r.libtorch_s;
    fused += r.fused_s;
    worst = std::max(worst, r.max_rel_diff);
  }
  std::printf("speedup=%.2f max_rel_diff=%.2e\n", libtorch / fused, worst);
  if (worst > 1e-6) {
    std::fprintf(
        stderr, "optimizer_bench: FusedAdamW differs from LibTorch's AdamW by %.2e relative (more than 1e-6)\n", worst);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::raise_malloc_thresholds();  // as train_gpt's default (--malloc warm), for LibTorch's temporaries
  return fsdp_bench::run_main(argc, argv, parse, body);
}
