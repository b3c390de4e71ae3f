// gpu_bench: one GPU, GPT at a size that keeps it busy, bf16 compute with fp32 master weights:
// plain LibTorch training (the limit) against fully_shard in a world of one on NCCL, in one run.
// benchmarks/fsdp2_bench.py gpu measures PyTorch's own FSDP2 on the same model and batch.
//
//   build/bin/gpu_bench [--layers 12] [--dim 1024] [--heads 16] [--seq 1024] [--batch 8]
//                       [--steps 20] [--warmup 5] [--rounds 2] [--dry-run-on-cpu]
//
// --dry-run-on-cpu runs every row on the CPU (Gloo, a world of one; bf16 on a CPU is slow: give it
// a small model) so that this program's own code is checked before a GPU machine's minutes are
// spent on it; its figures mean nothing.
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
  bool dry_run_on_cpu = false;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args("gpu_bench",
                        "usage: gpu_bench [--layers N] [--dim N] [--heads N] [--seq N] [--batch N] [--steps N] "
                        "[--warmup N] [--rounds N] [--dry-run-on-cpu]");
  o.shape.add_options(args);
  args.option("--steps", &o.steps).option("--warmup", &o.warmup).option("--rounds", &o.rounds);
  args.flag("--dry-run-on-cpu", &o.dry_run_on_cpu);
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
Result time_steps(const Options& o, StepFn step) {
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
  {
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
  return time_steps(o, [&](int s, Backlog& backlog) {
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < masters.size(); ++i) computes[i].copy_(masters[i]);
    }
    for (auto& p : computes) p.mutable_grad().reset();
    auto data = batch_of(o, s);
    auto loss = fsdp::models::gpt_loss(compute->forward(data.narrow(1, 0, o.shape.seq)).to(at::kFloat),
                                       data.narrow(1, 1, o.shape.seq));
    backlog.mark(0);
    loss.backward();
    backlog.mark(1);
    for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = computes[i].grad().to(at::kFloat);
    opt.step();
    return loss.detach();
  });
}

// instrumented: with the phase timers (two clock reads a phase, one of them a system call) and the
// all-gather wait timing (two events an all-gather) on, for the phase table; the rows compared
// with plain run without them, as plain runs without anything of the kind.
Result run_fsdp(const Options& o, bool reshard_after_forward, bool instrumented) {
  reset_peak();
  fsdp::models::GPT model(config_of(o, torch::kMeta));
  fsdp::FullyShardOptions so;
  so.mp_policy.param_dtype = at::kBFloat16;
  so.mp_policy.reduce_dtype = at::kFloat;
  so.reshard_after_forward = reshard_after_forward;
  fsdp_bench::shard_gpt(model, so);
  fsdp::to_empty(*model, kGpu);
  model->reset_parameters();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
  fsdp::set_all_gather_wait_timing(instrumented);
  fsdp::set_phase_timers(instrumented);
  Result r = time_steps(o, [&](int s, Backlog& backlog) {
    opt.zero_grad();
    auto data = batch_of(o, s);
    auto loss = fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, o.shape.seq)).to(at::kFloat),
                                       data.narrow(1, 1, o.shape.seq));
    backlog.mark(0);
    loss.backward();
    backlog.mark(1);
    opt.step();
    return loss.detach();
  });
  fsdp::set_phase_timers(false);
  fsdp::set_all_gather_wait_timing(false);
  r.instrumented = instrumented;
  return r;
}

void print_row(const char* name, const Options& o, const Result& r, const Result* plain) {
  const double tokens = static_cast<double>(o.shape.batch * o.shape.seq);
  std::printf("row %-11s tokens_per_s=%.0f step_ms=%.1f host_ms=%.1f peak_gib=%.2f last_loss=%.4f", name,
              tokens / r.step_s, r.step_s * 1e3, r.host_s * 1e3, r.peak, r.loss);
  if (kGpu.is_cuda())
    std::printf(" cuda_segments_alloc_per_step=%.1f cuda_segments_freed_per_step=%.1f alloc_retries_per_step=%.1f",
                r.segments_allocated, r.segments_freed, r.retries);
  else
    std::printf(" cuda_segments=n/a");
  if (std::isnan(r.backlog_ms[0]))
    std::printf(" backlog_ms=n/a");
  else
    std::printf(" backlog_ms=%.2f/%.2f/%.2f", r.backlog_ms[0], r.backlog_ms[1], r.backlog_ms[2]);
  std::printf(" aten_ops_per_step=%lld/%lld", static_cast<long long>(r.ops_top), static_cast<long long>(r.ops_all));
  if (plain) std::printf(" vs_plain=%.3f", plain->step_s / r.step_s);
  if (r.instrumented)
    std::printf(" ag_wait_ms_per_step=%.2f fsdp_host_cpu_ms=%.1f", r.wait_s * 1e3, r.phases.own_cpu_ms() / o.steps);
  std::printf("\n");
  std::fflush(stdout);
}

// Host-bound where the GPU had next to no backlog at every mark (it waited for the host), device-
// bound where it had some at every mark; without a GPU's events, where the host issued the step for
// most of its time.
const char* bound_by(const Result& r) {
  if (std::isnan(r.backlog_ms[0])) return r.host_s >= 0.9 * r.step_s ? "host" : "device";
  const auto behind = std::count_if(r.backlog_ms.begin(), r.backlog_ms.end(), [](double b) { return b >= 0.5; });
  return behind == 0 ? "host" : behind == kMarks ? "device" : "mixed";
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
  Result best_plain, best_fsdp, best_keep;
  for (int round = 0; round < o.rounds; ++round) {  // alternate; keep each one's best median
    Result p = run_plain(o);
    Result f = run_fsdp(o, /*reshard_after_forward=*/true, /*instrumented=*/false);
    Result k = run_fsdp(o, /*reshard_after_forward=*/false, /*instrumented=*/false);
    if (round == 0 || p.step_s < best_plain.step_s) best_plain = p;
    if (round == 0 || f.step_s < best_fsdp.step_s) best_fsdp = f;
    if (round == 0 || k.step_s < best_keep.step_s) best_keep = k;
  }
  // Once more with the phase timers on, for the table below (and what they cost: against fsdp).
  const Result timed = run_fsdp(o, /*reshard_after_forward=*/true, /*instrumented=*/true);
  print_row("plain", o, best_plain, nullptr);
  print_row("fsdp", o, best_fsdp, &best_plain);
  print_row("fsdp_keep", o, best_keep, &best_plain);
  print_row("fsdp_timers", o, timed, &best_plain);
  std::printf(
      "bound plain=%s fsdp=%s fsdp_keep=%s (backlog_ms at %s issued: host where under 0.5 ms at all, device where "
      "0.5 ms or more at all, else mixed; without a GPU, host where host_ms >= 0.9 x step_ms)\n",
      bound_by(best_plain), bound_by(best_fsdp), bound_by(best_keep), kMarkNames);
  std::printf("fsdp phases (host ms per step, the fsdp_timers row: fsdp with the phase timers on):\n%s",
              timed.phases.table(o.steps).c_str());
  std::printf("target fsdp >= 0.97 x plain tokens/s: %s\n",
              best_plain.step_s / best_fsdp.step_s >= 0.97 ? "met" : "NOT met");
  if (o.dry_run_on_cpu) {
    // The rows train the same model from the same values on the same tokens with the same
    // arithmetic: on the CPU their last losses agree (a GPU's kernels may round differently).
    const Result* sharded[] = {&best_fsdp, &best_keep, &timed};
    for (const Result* r : sharded) {
      if (std::abs(r->loss - best_plain.loss) > 1e-3) {
        std::fprintf(stderr, "gpu_bench: the fully_shard rows do not train as the plain one does: loss %.6f vs %.6f\n",
                     r->loss, best_plain.loss);
        return 1;
      }
    }
    std::printf("dry run: every row ran; the fully_shard rows' last losses equal the plain row's\n");
  }
  return 0;
}
