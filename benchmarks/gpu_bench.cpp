// gpu_bench: one GPU, models at a size that keeps it busy, bf16 compute with fp32 master weights:
// plain LibTorch training (the limit) against fully_shard in a world of one on NCCL, in one run.
// benchmarks/fsdp2_bench.py gpu measures PyTorch's own FSDP2 on the GPT rows' model and batch.
//
//   build/bin/gpu_bench [--rows gpt,llama,offload] [--steps 20] [--warmup 5] [--rounds 2]
//                       [--layers 12] [--dim 1024] [--heads 16] [--seq 1024] [--batch 8]   (GPT)
//                       [--llama tinyllama|tiny] [--llama-layers N] [--llama-hidden N]
//                       [--llama-heads N] [--llama-kv-heads N] [--llama-ffn N] [--llama-vocab N]
//                       [--llama-seq N] [--llama-batch N] [--offload-layers N]       (Llama)
//                       [--peak-tflops 989] [--dry-run-on-cpu]
//
// --rows picks the groups of rows (default all three): gpt (plain, fsdp, fsdp_keep, fsdp_timers),
// llama (llama_plain, llama_fsdp, llama_plain_ac, llama_fsdp_ac) and offload (llama_offload_fused,
// llama_offload_libtorch). --dry-run-on-cpu runs the chosen rows on the CPU (Gloo, a world of one;
// bf16 on a CPU is slow: give the GPT a small model; the Llama is the tiny shape unless --llama
// says otherwise) so that this program's own code is checked before a GPU machine's minutes are
// spent on it; its figures mean nothing.
//
// The Llama rows: TinyLlama 1.1B's shape (22 layers, hidden 2048, 32 heads, 4 KV heads, FFN 5632,
// vocabulary 32000; seq 2048, batch 4: 8192 tokens a step), bf16 compute, LibTorch's fused
// attention (at::scaled_dot_product_attention, grouped-query), fully_shard per decoder layer then
// the root, activation checkpointing off and on (every decoder layer: llama_*_ac). Each prints
// mfu=, the model FLOPs utilisation against --peak-tflops (default 989: an H100 SXM's or H200's
// dense bf16 peak), with torchtitan's FLOPs per token: 6 x N + 12 x L x H x Q x T, N the parameters
// less the token embedding (the output head counted), L layers, H heads, Q head_dim, T the sequence
// length (the attention's matmuls); activation checkpointing's recompute is not counted (as in
// torchtitan). The offload rows: the same Llama with --offload-layers decoder layers (default 8:
// the host's optimizer step over 1.1B parameters would take most of the GPU check's minutes) and
// CPUOffloadPolicy (fp32 shards and gradients in pinned host memory, the optimizer on the host):
// fsdp::optim::FusedAdamW against torch::optim::AdamW, each with its optimizer step's host time.
//
// Rows (one line each, "row <name> key=value ..."): tokens/s (median step), peak GPU memory
// allocated, and the caching allocator's segment allocations, frees and retries per timed step
// (each a cudaMalloc or cudaFree, which a steady step should not need).
// Plain: the fp32 model is the optimizer's; a bf16 copy computes (copied in before each step,
// gradients handed back in fp32): the same arithmetic as FSDP's MixedPrecisionPolicy.
// fsdp_keep is fully_shard with reshard_after_forward=false (no all-gather in backward): what
// backward's gathers cost. fsdp_timers is fsdp again with FSDP's phase timers and all-gather wait
// timing on (a clock system call a phase, two events a gather): the phase table and how long the
// compute stream waited on all-gathers come from it; the rows compared with plain run without them.
//
// Host-bound or device-bound: each row also prints host_ms, the median time from a step's start
// until the host has issued all of its work (just before the loss's .item() waits for the GPU).
// A step whose host_ms is close to its step_ms kept the GPU waiting for the host (or the host
// waited inside the step: a synchronisation, which Gpu.ThreeStepsWithoutHostSyncBeyondClipAndLossRead
// rules out for FSDP's own code): its cost is the host's, and FSDP's share of that is printed
// under the fsdp row (the phase timers' host times per step: fsdp/debug/phase_timers.h). A host_ms well below step_ms
// means the GPU was the bottleneck (kernels, or waits between streams). host_ms alone can mislead:
// once CUDA's launch queue is full (about a thousand launches) the host waits in each launch for
// the GPU, so a GPU-bound step's host_ms comes close to its step_ms too. So each row also prints
// backlog_ms at three points of the step (forward issued, backward issued, everything issued):
// how far the GPU was behind the host there, from a timing event recorded at each point (the GPU's
// time of it since the step's start, less the host's). A GPU that waited for the host has next to
// no backlog (it runs each kernel as soon as it is launched); one that the host waited for has the
// queue's worth. The bound line says host where the backlog is under 0.5 ms at all three points,
// device where it is 0.5 ms or more at all three, mixed otherwise (without a GPU: host_ms's rule).
// docs/gpu.md reads these lines.
#include <ATen/record_function.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#ifdef FSDP_HAS_CUDA
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "models/llama/llama.h"

namespace {

using fsdp_bench::median;

// The Llama rows' shape: TinyLlama 1.1B's by default; "tiny" for a dry run on the CPU.
struct LlamaShape {
  int64_t layers = 22, hidden = 2048, heads = 32, kv_heads = 4, ffn = 5632, vocab = 32000, seq = 2048, batch = 4;
  int64_t offload_layers = 8;  // the offload rows' depth

  void tiny() { *this = LlamaShape{2, 64, 4, 2, 128, 256, 32, 2, 2}; }
  void add_options(fsdp_bench::Args& args) {
    args.option("--llama-layers", &layers).option("--llama-hidden", &hidden).option("--llama-heads", &heads);
    args.option("--llama-kv-heads", &kv_heads).option("--llama-ffn", &ffn).option("--llama-vocab", &vocab);
    args.option("--llama-seq", &seq).option("--llama-batch", &batch).option("--offload-layers", &offload_layers);
  }
  // The config of `depth` decoder layers, parameters on `device` (torch::kMeta: none yet).
  fsdp::models::LlamaConfig config(int64_t depth, torch::Device device) const {
    fsdp::models::LlamaConfig c;
    c.vocab_size = vocab;
    c.hidden_size = hidden;
    c.intermediate_size = ffn;
    c.num_hidden_layers = depth;
    c.num_attention_heads = heads;
    c.num_key_value_heads = kv_heads;
    c.max_position_embeddings = seq;
    c.rms_norm_eps = 1e-5;  // TinyLlama's
    c.fused_attention = true;
    c.device = device;
    c.init_seed = 1;
    return c;
  }
};

struct Options {
  fsdp_bench::GptShape shape{12, 1024, 16, 1024, 8};
  LlamaShape llama;
  std::string llama_preset;  // "" (tinyllama, or tiny in a dry run), "tinyllama", "tiny"
  bool gpt_rows = true, llama_rows = true, offload_rows = true;
  double peak_tflops = 989;
  int steps = 20, warmup = 5, rounds = 2;
  bool dry_run_on_cpu = false;
};

void parse_rows(Options& o, const std::string& list) {
  o.gpt_rows = o.llama_rows = o.offload_rows = false;
  std::stringstream ss(list);
  for (std::string item; std::getline(ss, item, ',');) {
    if (item == "gpt")
      o.gpt_rows = true;
    else if (item == "llama")
      o.llama_rows = true;
    else if (item == "offload")
      o.offload_rows = true;
    else if (item == "all")
      o.gpt_rows = o.llama_rows = o.offload_rows = true;
    else
      fsdp_bench::bad_input("--rows takes a comma-separated list of gpt, llama, offload (or all), got '" + item + "'");
  }
}

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "gpu_bench",
      "usage: gpu_bench [--rows gpt,llama,offload] [--steps N] [--warmup N] [--rounds N] [--layers N] "
      "[--dim N] [--heads N] [--seq N] [--batch N] [--llama tinyllama|tiny] [--llama-layers N] "
      "[--llama-hidden N] [--llama-heads N] [--llama-kv-heads N] [--llama-ffn N] [--llama-vocab N] "
      "[--llama-seq N] [--llama-batch N] [--offload-layers N] [--peak-tflops X] [--dry-run-on-cpu]");
  o.shape.add_options(args);
  args.option("--steps", &o.steps).option("--warmup", &o.warmup).option("--rounds", &o.rounds);
  args.option("--rows", [&o](const std::string& v) { parse_rows(o, v); });
  args.option("--peak-tflops", [&o](const std::string& v) {
    char* end = nullptr;
    o.peak_tflops = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(o.peak_tflops > 0)) fsdp_bench::bad_input("--peak-tflops takes a number > 0");
  });
  args.flag("--dry-run-on-cpu", &o.dry_run_on_cpu);
  // The Llama's preset first (tiny by default in a dry run), then the --llama-* overrides on it.
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--llama" && i + 1 < argc) o.llama_preset = argv[i + 1];
    if (a == "--dry-run-on-cpu") o.dry_run_on_cpu = true;
  }
  if (o.llama_preset == "tiny" || (o.llama_preset.empty() && o.dry_run_on_cpu))
    o.llama.tiny();
  else if (!o.llama_preset.empty() && o.llama_preset != "tinyllama")
    fsdp_bench::bad_input("--llama takes tinyllama or tiny, got '" + o.llama_preset + "'");
  args.option("--llama", [](const std::string&) {});  // read above
  o.llama.add_options(args);
  args.parse(argc, argv);
  return o;
}

torch::Device kGpu(torch::kCUDA, 0);  // the CPU under --dry-run-on-cpu

void reset_peak() {
  if (!kGpu.is_cuda()) return;
#ifdef FSDP_HAS_CUDA
  // The caching allocator refuses its statistics ("Invalid device argument") until it has served a
  // first allocation on the device (seen on the first GPU run): make one.
  (void)at::empty({1}, at::TensorOptions().device(kGpu));
  c10::cuda::CUDACachingAllocator::emptyCache();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
#endif
}
// The caching allocator's trips to the device (cudaMalloc / cudaFree of segments) and its retries
// (a failed cudaMalloc: every cached block freed, the device synchronised). In a steady step there
// should be none: each one synchronises or stalls the host, and a row that pays them every step
// is slower for it, whatever its kernels. All zero without a GPU.
struct AllocatorCounts {
  int64_t segments_allocated = 0, segments_freed = 0, retries = 0;
};
AllocatorCounts allocator_counts() {
  AllocatorCounts c;
  if (!kGpu.is_cuda()) return c;
#ifdef FSDP_HAS_CUDA
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  c.segments_allocated = stats.segment[0].allocated;  // [0]: all pools
  c.segments_freed = stats.segment[0].freed;
  c.retries = stats.num_alloc_retries;
#endif
  return c;
}

double peak_gib() {
  if (!kGpu.is_cuda()) return 0;
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

// The ATen operators one step dispatches, on every thread (backward runs on the device's autograd
// thread on a GPU): all of them, and the top-level ones (those no other operator called: what the
// model, autograd's backward functions, the optimizer and FSDP's hooks issue themselves). On a GPU
// each is host time (dispatch, and a kernel launch for most), so the rows' difference is the host
// work fully_shard adds to a step; docs/gpu.md reads it beside backlog_ms.
class OpCounter {
 public:
  OpCounter() {
    top_ = 0;
    all_ = 0;
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_start, &on_end).needsInputs(false).scopes({at::RecordScope::FUNCTION}));
  }
  ~OpCounter() { at::removeCallback(handle_); }
  OpCounter(const OpCounter&) = delete;
  OpCounter& operator=(const OpCounter&) = delete;
  int64_t top() const { return top_; }
  int64_t all() const { return all_; }

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
    ++all_;
    if (depth()++ == 0) ++top_;
    return nullptr;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext*) { --depth(); }
  static inline std::atomic<int64_t> top_{0}, all_{0};
  at::CallbackHandle handle_;
};

constexpr int kMarks = 3;  // forward issued, backward issued, everything issued
constexpr const char* kMarkNames = "forward/backward/end";

struct Result {
  double step_s = 0, host_s = 0, peak = 0, wait_s = 0, loss = 0;
  double segments_allocated = 0, segments_freed = 0, retries = 0;  // per timed step (AllocatorCounts)
  int64_t ops_top = 0, ops_all = 0;                                // in one more step (OpCounter)
  std::array<double, kMarks> backlog_ms{};                         // medians; NaN without a GPU
  bool instrumented = false;  // the phase timers and all-gather wait timing were on
  fsdp::PhaseTimes phases;    // fully_shard's host times over the timed steps (instrumented)
  double opt_s = 0;           // the optimizer step's median host time (the offload rows)
  std::string error;          // the row failed (out of memory, ...): its message; nothing else is set
};

// The GPU's backlog at points of a step: at start() and each mark(i) the host's clock is read and,
// on a GPU, a timing event recorded on the current stream; once the step has run, backlog_ms(i)
// is the GPU's time from the start event to mark i's less the host's (how long mark i's event
// waited behind the work queued before it). NaN on the CPU.
class Backlog {
 public:
  explicit Backlog(bool gpu) : gpu_(gpu) {
#ifdef FSDP_HAS_CUDA
    if (gpu_) {
      // BACKEND_DEFAULT: CUDA's default flags, timing on (PyTorch's default turns it off).
      for (auto& e : events_) e = std::make_unique<c10::Event>(c10::DeviceType::CUDA, c10::EventFlag::BACKEND_DEFAULT);
    }
#endif
  }
  void start() {
    t0_ = std::chrono::steady_clock::now();
    record(0);
  }
  void mark(int i) {
    host_ms_[i] = 1e3 * fsdp_bench::seconds_since(t0_);
    record(i + 1);
  }
  // After the step's work has finished on the GPU (the loss's .item()).
  double backlog_ms(int i) const {
#ifdef FSDP_HAS_CUDA
    if (gpu_) return events_[0]->elapsedTime(*events_[i + 1]) - host_ms_[i];
#endif
    return std::numeric_limits<double>::quiet_NaN();
  }

 private:
  void record(int e) {
#ifdef FSDP_HAS_CUDA
    if (gpu_) events_[e]->record(c10::cuda::getCurrentCUDAStream());
#endif
    (void)e;
  }
  bool gpu_;
  std::chrono::steady_clock::time_point t0_;
  std::array<double, kMarks> host_ms_{};
#ifdef FSDP_HAS_CUDA
  std::array<std::unique_ptr<c10::Event>, kMarks + 1> events_;
#endif
};

// step(s, backlog) issues step s, calling backlog.mark(0) when forward is issued and mark(1) when
// backward is, and returns its loss without waiting for it; the .item() here waits.
template <typename StepFn>
Result time_steps(const Options& o, StepFn step, bool count_ops = true) {
  std::vector<double> times, host;
  std::array<std::vector<double>, kMarks> backlogs;
  Backlog backlog(kGpu.is_cuda());
  Result r;
  AllocatorCounts before;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      fsdp::all_gather_wait_seconds();  // drop the warmup's waits
      fsdp::reset_phase_timers();
      before = allocator_counts();
    }
    const auto t0 = std::chrono::steady_clock::now();
    backlog.start();
    const at::Tensor loss = step(s, backlog);
    backlog.mark(kMarks - 1);
    const double issued = fsdp_bench::seconds_since(t0);
    r.loss = loss.item<double>();  // waits for the GPU
    if (s >= o.warmup) {
      times.push_back(fsdp_bench::seconds_since(t0));
      host.push_back(issued);
      for (int i = 0; i < kMarks; ++i) backlogs[i].push_back(backlog.backlog_ms(i));
    }
  }
  const AllocatorCounts after = allocator_counts();
  if (count_ops) {
    // One more step, untimed, its operators counted (the callback slows it).
    OpCounter ops;
    const at::Tensor loss = step(o.warmup + o.steps, backlog);
    r.loss = loss.item<double>();
    r.ops_top = ops.top();
    r.ops_all = ops.all();
  }
  const double steps = std::max(1, o.steps);
  r.segments_allocated = static_cast<double>(after.segments_allocated - before.segments_allocated) / steps;
  r.segments_freed = static_cast<double>(after.segments_freed - before.segments_freed) / steps;
  r.retries = static_cast<double>(after.retries - before.retries) / steps;
  r.phases = fsdp::phase_times();
  r.step_s = median(times);
  r.host_s = median(host);
  for (int i = 0; i < kMarks; ++i) r.backlog_ms[i] = median(backlogs[i]);
  r.wait_s = fsdp::all_gather_wait_seconds() / o.steps;
  r.peak = peak_gib();
  return r;
}

// The tokens of a step: `batch` sequences of `seq` + 1 ids below `vocab` (inputs and next-token targets).
struct Tokens {
  int64_t vocab, batch, seq;
  double per_step() const { return static_cast<double>(batch * seq); }
};
Tokens gpt_tokens(const Options& o) { return {fsdp_bench::kVocab, o.shape.batch, o.shape.seq}; }
Tokens llama_tokens(const Options& o) { return {o.llama.vocab, o.llama.batch, o.llama.seq}; }

at::Tensor batch_of(const Tokens& t, int step) {
  auto gen = at::detail::createCPUGenerator(100 + step);
  return at::randint(t.vocab, {t.batch, t.seq + 1}, gen, at::kLong).to(kGpu);
}

// The loss of a forward (`forward(inputs)`: logits) on step s's tokens; backlog marks forward issued.
template <typename Forward>
at::Tensor loss_of(const Tokens& t, int s, Backlog& backlog, Forward forward) {
  auto data = batch_of(t, s);
  auto loss = fsdp::models::gpt_loss(forward(data.narrow(1, 0, t.seq)).to(at::kFloat), data.narrow(1, 1, t.seq));
  backlog.mark(0);
  return loss;
}

// Plain LibTorch: `master` (fp32) is the optimizer's; `compute`, a copy, computes in bf16 (copied
// in before each step, gradients handed back in fp32): the same arithmetic as FSDP's
// MixedPrecisionPolicy. Both built with the same values.
template <typename Net>
Result run_plain_net(const Options& o, const Tokens& t, Net master, Net compute) {
  compute->to(at::kBFloat16);
  torch::optim::AdamW opt(master->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  auto masters = master->parameters(), computes = compute->parameters();
  return time_steps(o, [&](int s, Backlog& backlog) {
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < masters.size(); ++i) computes[i].copy_(masters[i]);
    }
    for (auto& p : computes) p.mutable_grad().reset();
    auto loss = loss_of(t, s, backlog, [&](const at::Tensor& x) { return compute->forward(x); });
    loss.backward();
    backlog.mark(1);
    for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = computes[i].grad().to(at::kFloat);
    opt.step();
    return loss.detach();
  });
}

Result run_plain(const Options& o) {
  reset_peak();
  const auto c = config_of(o, kGpu);
  return run_plain_net(o, gpt_tokens(o), fsdp::models::GPT(c), fsdp::models::GPT(c));
}

// A model already sharded and materialised on the device (or, offloaded, on the host), trained by
// `opt` over its shards; the optimizer step's host time is kept (Result::opt_s).
template <typename Net>
Result run_sharded_net(const Options& o, const Tokens& t, Net model, torch::optim::Optimizer& opt,
                       bool count_ops = true) {
  std::vector<double> opt_times;
  Result r = time_steps(
      o,
      [&](int s, Backlog& backlog) {
        opt.zero_grad();
        auto loss = loss_of(t, s, backlog, [&](const at::Tensor& x) { return fsdp::call(model, x); });
        loss.backward();
        backlog.mark(1);
        const auto t0 = std::chrono::steady_clock::now();
        opt.step();
        if (s >= o.warmup && s < o.warmup + o.steps) opt_times.push_back(fsdp_bench::seconds_since(t0));
        return loss.detach();
      },
      count_ops);
  r.opt_s = median(opt_times);
  return r;
}

fsdp::FullyShardOptions bf16_options() {
  fsdp::FullyShardOptions so;
  so.mp_policy.param_dtype = at::kBFloat16;
  so.mp_policy.reduce_dtype = at::kFloat;
  return so;
}

// instrumented: with the phase timers (two clock reads a phase, one of them a system call) and the
// all-gather wait timing (two events an all-gather) on, for the phase table; the rows compared
// with plain run without them, as plain runs without anything of the kind.
Result run_fsdp(const Options& o, bool reshard_after_forward, bool instrumented) {
  reset_peak();
  fsdp::models::GPT model(config_of(o, torch::kMeta));
  fsdp::FullyShardOptions so = bf16_options();
  so.reshard_after_forward = reshard_after_forward;
  fsdp_bench::shard_gpt(model, so);
  fsdp::to_empty(*model, kGpu);
  model->reset_parameters();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  fsdp::set_all_gather_wait_timing(instrumented);
  fsdp::set_phase_timers(instrumented);
  Result r = run_sharded_net(o, gpt_tokens(o), model, opt);
  fsdp::set_phase_timers(false);
  fsdp::set_all_gather_wait_timing(false);
  r.instrumented = instrumented;
  return r;
}

// ---- The Llama rows -----------------------------------------------------------------------------

void checkpoint_every_layer(fsdp::models::Llama& model) {
  fsdp::activation::apply_activation_checkpointing(*model,
                                                   fsdp::activation::every_kth<fsdp::models::LlamaDecoderLayerImpl>(1));
}

Result run_llama_plain(const Options& o, bool ac) {
  reset_peak();
  const auto c = o.llama.config(o.llama.layers, kGpu);
  fsdp::models::Llama master(c), compute(c);  // the same values (init_seed)
  if (ac) checkpoint_every_layer(compute);
  return run_plain_net(o, llama_tokens(o), master, compute);
}

// The Llama built on the meta device, checkpointed (ac), fully_shard per decoder layer then the
// root, materialised on the GPU (offload: its shards in pinned host memory) and initialised.
fsdp::models::Llama sharded_llama(const Options& o, int64_t depth, bool ac, bool offload) {
  fsdp::models::Llama model(o.llama.config(depth, torch::kMeta));
  if (ac) checkpoint_every_layer(model);
  fsdp::FullyShardOptions so = bf16_options();
  if (offload) so.offload_policy = fsdp::CPUOffloadPolicy{.pin_memory = kGpu.is_cuda()};
  for (auto& layer : model->layers()) fsdp::fully_shard(layer, so);
  fsdp::fully_shard(model, so);
  fsdp::to_empty(*model, kGpu);
  model->reset_parameters();
  return model;
}

Result run_llama_fsdp(const Options& o, bool ac) {
  reset_peak();
  auto model = sharded_llama(o, o.llama.layers, ac, /*offload=*/false);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  return run_sharded_net(o, llama_tokens(o), model, opt);
}

// CPUOffloadPolicy: the optimizer steps on the host over the fp32 shards, fused or LibTorch's.
Result run_llama_offload(const Options& o, bool fused) {
  reset_peak();
  auto model = sharded_llama(o, o.llama.offload_layers, /*ac=*/false, /*offload=*/true);
  const auto adamw = torch::optim::AdamWOptions(3e-4).weight_decay(0.1);
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (fused)
    opt = std::make_unique<fsdp::optim::FusedAdamW>(model->parameters(), adamw);
  else
    opt = std::make_unique<torch::optim::AdamW>(model->parameters(), adamw);
  return run_sharded_net(o, llama_tokens(o), model, *opt, /*count_ops=*/false);
}

// FLOPs per token, torchtitan's: 6 x N + 12 x L x H x Q x T (N: the parameters less the token
// embedding; the attention's two matmuls, forward and backward, over T positions).
struct LlamaFlops {
  double non_embedding_params = 0, per_token = 0;
};
LlamaFlops llama_flops(const Options& o) {
  fsdp::models::Llama meta(o.llama.config(o.llama.layers, torch::kMeta));
  LlamaFlops f;
  for (const auto& p : meta->parameters()) f.non_embedding_params += static_cast<double>(p.numel());
  f.non_embedding_params -= static_cast<double>(meta->model->embed_tokens->weight.numel());
  const auto& c = meta->config;
  f.per_token = 6 * f.non_embedding_params +
                12.0 * static_cast<double>(c.num_hidden_layers) * static_cast<double>(c.num_attention_heads) *
                    static_cast<double>(c.resolved_head_dim()) * static_cast<double>(o.llama.seq);
  return f;
}

bool g_row_failed = false;  // a row printed FAILED: the exit status is 1

// One row's line; `extra` ends it (mfu=, the optimizer's step). A failed row prints its error.
void print_row(const char* name, const Options& o, const Tokens& t, const Result& r, const Result* plain,
               const std::string& extra = "") {
  if (!r.error.empty()) {
    std::printf("row %-22s FAILED: %s\n", name, r.error.c_str());
    g_row_failed = true;
    std::fflush(stdout);
    return;
  }
  std::printf("row %-22s tokens_per_s=%.0f step_ms=%.1f host_ms=%.1f peak_gib=%.2f last_loss=%.4f", name,
              t.per_step() / r.step_s, r.step_s * 1e3, r.host_s * 1e3, r.peak, r.loss);
  if (kGpu.is_cuda())
    std::printf(" cuda_segments_alloc_per_step=%.1f cuda_segments_freed_per_step=%.1f alloc_retries_per_step=%.1f",
                r.segments_allocated, r.segments_freed, r.retries);
  else
    std::printf(" cuda_segments=n/a");
  if (std::isnan(r.backlog_ms[0]))
    std::printf(" backlog_ms=n/a");
  else
    std::printf(" backlog_ms=%.2f/%.2f/%.2f", r.backlog_ms[0], r.backlog_ms[1], r.backlog_ms[2]);
  if (r.ops_all > 0)
    std::printf(" aten_ops_per_step=%lld/%lld", static_cast<long long>(r.ops_top), static_cast<long long>(r.ops_all));
  if (plain && plain->error.empty()) std::printf(" vs_plain=%.3f", plain->step_s / r.step_s);
  if (r.instrumented)
    std::printf(" ag_wait_ms_per_step=%.2f fsdp_host_cpu_ms=%.1f", r.wait_s * 1e3, r.phases.own_cpu_ms() / o.steps);
  std::printf("%s\n", extra.c_str());
  std::fflush(stdout);
}

// Host-bound where the GPU had next to no backlog at every mark (it waited for the host), device-
// bound where it had some at every mark; without a GPU's events, where the host issued the step for
// most of its time.
const char* bound_by(const Result& r) {
  if (!r.error.empty()) return "n/a";
  if (std::isnan(r.backlog_ms[0])) return r.host_s >= 0.9 * r.step_s ? "host" : "device";
  const auto behind = std::count_if(r.backlog_ms.begin(), r.backlog_ms.end(), [](double b) { return b >= 0.5; });
  return behind == 0 ? "host" : behind == kMarks ? "device" : "mixed";
}

// A row run with its failure (out of memory on a smaller card, ...) kept as the row's error, so
// that one row's failure leaves the others' figures; the models of a failed row are freed.
template <typename Run>
Result guarded(Run run) {
  try {
    return run();
  } catch (const std::exception& e) {
    Result r;
    std::string what = e.what();
    r.error = what.substr(0, what.find('\n'));
    fsdp::set_phase_timers(false);
    fsdp::set_all_gather_wait_timing(false);
    reset_peak();
    return r;
  }
}

// Keeps the best (fastest) of the rounds' results; a failed round counts only if all failed.
void keep_best(Result& best, const Result& r, int round) {
  if (round == 0 || (!r.error.empty() ? false : !best.error.empty() || r.step_s < best.step_s)) best = r;
}

// In a dry run the rows train the same model from the same values on the same tokens with the same
// arithmetic: on the CPU their last losses agree (a GPU's kernels may round differently).
bool same_loss(const char* what, const Result& got, const Result& want) {
  if (got.error.empty() && want.error.empty() && std::abs(got.loss - want.loss) <= 1e-3) return true;
  std::fprintf(stderr, "gpu_bench: %s: loss %.6f vs %.6f%s%s\n", what, got.loss, want.loss,
               got.error.empty() ? "" : ", failed: ", got.error.c_str());
  return false;
}

// The GPT rows: plain, fsdp, fsdp_keep, fsdp_timers. False where a dry run's losses disagree.
bool gpt_rows(const Options& o) {
  Result best_plain, best_fsdp, best_keep;
  for (int round = 0; round < o.rounds; ++round) {  // alternate; keep each one's best median
    keep_best(best_plain, guarded([&] { return run_plain(o); }), round);
    keep_best(best_fsdp, guarded([&] { return run_fsdp(o, /*reshard_after_forward=*/true, false); }), round);
    keep_best(best_keep, guarded([&] { return run_fsdp(o, /*reshard_after_forward=*/false, false); }), round);
  }
  // Once more with the phase timers on, for the table below (and what they cost: against fsdp).
  const Result timed = guarded([&] { return run_fsdp(o, /*reshard_after_forward=*/true, /*instrumented=*/true); });
  const Tokens t = gpt_tokens(o);
  print_row("plain", o, t, best_plain, nullptr);
  print_row("fsdp", o, t, best_fsdp, &best_plain);
  print_row("fsdp_keep", o, t, best_keep, &best_plain);
  print_row("fsdp_timers", o, t, timed, &best_plain);
  std::printf(
      "bound plain=%s fsdp=%s fsdp_keep=%s (backlog_ms at %s issued: host where under 0.5 ms at all, device where "
      "0.5 ms or more at all, else mixed; without a GPU, host where host_ms >= 0.9 x step_ms)\n",
      bound_by(best_plain), bound_by(best_fsdp), bound_by(best_keep), kMarkNames);
  if (timed.error.empty())
    std::printf("fsdp phases (host ms per step, the fsdp_timers row: fsdp with the phase timers on):\n%s",
                timed.phases.table(o.steps).c_str());
  const bool ok = best_plain.error.empty() && best_fsdp.error.empty();
  std::printf("target fsdp >= 0.97 x plain tokens/s: %s\n", !ok ? "n/a (a row failed)"
                                                            : best_plain.step_s / best_fsdp.step_s >= 0.97 ? "met"
                                                                                                           : "NOT met");
  if (!o.dry_run_on_cpu) return true;
  return same_loss("fsdp vs plain", best_fsdp, best_plain) && same_loss("fsdp_keep vs plain", best_keep, best_plain) &&
         same_loss("fsdp_timers vs plain", timed, best_plain);
}

std::string mfu_of(const Options& o, const LlamaFlops& f, const Result& r) {
  if (!r.error.empty()) return "";
  const double mfu = llama_tokens(o).per_step() / r.step_s * f.per_token / (o.peak_tflops * 1e12);
  char buf[64];
  std::snprintf(buf, sizeof(buf), " mfu=%.1f%%", 100 * mfu);
  return buf;
}

std::string ratio_of(const Result& fsdp, const Result& plain) {
  if (!fsdp.error.empty() || !plain.error.empty()) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3fx", plain.step_s / fsdp.step_s);
  return buf;
}

// The Llama rows: plain and fully_shard, activation checkpointing off and on, with MFU.
bool llama_rows(const Options& o) {
  const LlamaFlops f = llama_flops(o);
  std::printf(
      "llama layers=%lld hidden=%lld heads=%lld kv_heads=%lld ffn=%lld vocab=%lld seq=%lld batch=%lld: %.4g "
      "non-embedding parameters\n",
      static_cast<long long>(o.llama.layers), static_cast<long long>(o.llama.hidden),
      static_cast<long long>(o.llama.heads), static_cast<long long>(o.llama.kv_heads),
      static_cast<long long>(o.llama.ffn), static_cast<long long>(o.llama.vocab), static_cast<long long>(o.llama.seq),
      static_cast<long long>(o.llama.batch), f.non_embedding_params);
  std::printf(
      "mfu basis: %.4g FLOPs per token (torchtitan's 6N + 12 x layers x heads x head_dim x seq, N without the token "
      "embedding; activation checkpointing's recompute not counted) against %.0f TFLOPS dense bf16 (--peak-tflops; "
      "H100 SXM / H200: 989); torchtitan publishes 33-39%% for Llama 3.1 8B on 8 H100s (eager, bf16), well-tuned "
      "Hopper training 40-50%%\n",
      f.per_token, o.peak_tflops);
  std::fflush(stdout);
  std::array<Result, 4> best;  // plain, fsdp, plain_ac, fsdp_ac
  for (int round = 0; round < o.rounds; ++round) {
    for (int ac = 0; ac < 2; ++ac) {
      keep_best(best[2 * ac], guarded([&] { return run_llama_plain(o, ac == 1); }), round);
      keep_best(best[2 * ac + 1], guarded([&] { return run_llama_fsdp(o, ac == 1); }), round);
    }
  }
  const Tokens t = llama_tokens(o);
  print_row("llama_plain", o, t, best[0], nullptr, mfu_of(o, f, best[0]));
  print_row("llama_fsdp", o, t, best[1], &best[0], mfu_of(o, f, best[1]));
  print_row("llama_plain_ac", o, t, best[2], nullptr, mfu_of(o, f, best[2]));
  print_row("llama_fsdp_ac", o, t, best[3], &best[2], mfu_of(o, f, best[3]));
  const bool met = best[0].error.empty() && best[1].error.empty() && best[2].error.empty() && best[3].error.empty() &&
                   best[0].step_s / best[1].step_s >= 0.97 && best[2].step_s / best[3].step_s >= 0.97;
  std::printf("target llama_fsdp >= 0.97 x llama_plain tokens/s: %s (ac off %s, ac on %s)\n", met ? "met" : "NOT met",
              ratio_of(best[1], best[0]).c_str(), ratio_of(best[3], best[2]).c_str());
  if (!o.dry_run_on_cpu) return true;
  return same_loss("llama_fsdp vs llama_plain", best[1], best[0]) &&
         same_loss("llama_plain_ac vs llama_plain", best[2], best[0]) &&
         same_loss("llama_fsdp_ac vs llama_plain", best[3], best[0]);
}

std::string opt_step_of(const Result& r) {
  if (!r.error.empty()) return "";
  char buf[64];
  std::snprintf(buf, sizeof(buf), " opt_step_ms=%.1f", r.opt_s * 1e3);
  return buf;
}

// The offload rows: CPUOffloadPolicy, FusedAdamW against LibTorch's AdamW on the host's shards.
bool offload_rows(const Options& o) {
  std::printf(
      "offload llama layers=%lld (the rows above: %lld), CPUOffloadPolicy, bf16 compute; the optimizer on "
      "the host (%d threads)\n",
      static_cast<long long>(o.llama.offload_layers), static_cast<long long>(o.llama.layers), at::get_num_threads());
  std::fflush(stdout);
  Result fused, libtorch;
  for (int round = 0; round < o.rounds; ++round) {
    keep_best(fused, guarded([&] { return run_llama_offload(o, /*fused=*/true); }), round);
    keep_best(libtorch, guarded([&] { return run_llama_offload(o, /*fused=*/false); }), round);
  }
  const Tokens t = llama_tokens(o);
  print_row("llama_offload_fused", o, t, fused, nullptr, opt_step_of(fused));
  print_row("llama_offload_libtorch", o, t, libtorch, nullptr, opt_step_of(libtorch));
  if (fused.error.empty() && libtorch.error.empty())
    std::printf("offload fused vs libtorch: tokens/s %.2fx, optimizer step %.2fx (%.1f ms vs %.1f ms)\n",
                libtorch.step_s / fused.step_s, libtorch.opt_s / fused.opt_s, fused.opt_s * 1e3, libtorch.opt_s * 1e3);
  if (!o.dry_run_on_cpu) return true;
  return same_loss("llama_offload_fused vs llama_offload_libtorch", fused, libtorch);
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.dry_run_on_cpu) {
    kGpu = torch::Device(torch::kCPU);
    std::printf("dry run on the CPU: this program's code is checked, its figures mean nothing\n");
  } else if (!torch::cuda::is_available()) {
    std::fprintf(stderr,
                 "gpu_bench: no GPU visible (torch::cuda::is_available() is false); nothing to measure "
                 "(--dry-run-on-cpu checks this program on the CPU)\n");
    return 2;
  }
  fsdp::dist::InitOptions init;
  init.device_type = kGpu.is_cuda() ? "cuda" : "cpu";  // a world of one on NCCL (Gloo in a dry run)
  fsdp::dist::init_distributed(init);
  std::printf(
      "config layers=%lld dim=%lld heads=%lld seq=%lld batch=%lld bf16 params, fp32 reduce+master; steps=%d warmup=%d "
      "rounds=%d\n",
      static_cast<long long>(o.shape.layers), static_cast<long long>(o.shape.dim),
      static_cast<long long>(o.shape.heads), static_cast<long long>(o.shape.seq), static_cast<long long>(o.shape.batch),
      o.steps, o.warmup, o.rounds);
  bool same = true;
  if (o.gpt_rows) same = gpt_rows(o) && same;
  if (o.llama_rows) same = llama_rows(o) && same;
  if (o.offload_rows) same = offload_rows(o) && same;
  if (o.dry_run_on_cpu) {
    if (!same) {
      std::fprintf(stderr, "gpu_bench: the rows do not train alike (above)\n");
      return 1;
    }
    std::printf("dry run: every row ran; the fully_shard rows' last losses equal the plain rows'\n");
  }
  return g_row_failed ? 1 : 0;
}
