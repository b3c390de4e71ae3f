// copies_bench: FSDP's own work in a world of one (copies, allocations, hooks; no network), counted
// in instructions with callgrind, which repeats to the instruction where a timing on a shared
// machine does not.
//
//   valgrind --tool=callgrind --instr-atstart=no build/bin/copies_bench --mode plain
//   valgrind --tool=callgrind --instr-atstart=no build/bin/copies_bench --mode fsdp
//   [--steps 2] [--warmup 2] [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 4]
//
// Both modes train the same GPT (bench's: 4 layers, d=256, 4 heads, seq 128, batch 4, float32,
// AdamW, one thread) from the same initial values on the same tokens; `plain` is LibTorch alone,
// `fsdp` the model with fully_shard per block and on the root in a world of one. Instrumentation
// covers only the --steps steps after the --warmup ones (CALLGRIND_START/STOP_INSTRUMENTATION);
// compare the "Collected" (Ir) totals of the two runs. Without valgrind it prints the step time.
//
// It also counts the heap allocations of the measured steps (every malloc, calloc, realloc,
// posix_memalign, aligned_alloc and memalign of every thread, LibTorch's included: this program
// interposes glibc's allocator, which works because an executable's definitions come first in
// symbol lookup) and prints them per step: `fsdp` minus `plain` is what fully_shard's hooks,
// copies and bookkeeping allocate in a step beyond LibTorch's own.
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else  // valgrind's headers absent (package valgrind): the whole run is counted (--instr-atstart=yes)
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#endif

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <string>

#include "bench_support.h"

// ---- Counting allocations: glibc's allocator, interposed --------------------------------------
extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
}
namespace {
std::atomic<bool> g_counting{false};
std::atomic<int64_t> g_allocations{0}, g_bytes{0};
void* counted(void* p, size_t n) {
  if (p && g_counting.load(std::memory_order_relaxed)) {
    g_allocations.fetch_add(1, std::memory_order_relaxed);
    g_bytes.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed);
  }
  return p;
}
}  // namespace
extern "C" {
void* malloc(size_t n) { return counted(__libc_malloc(n), n); }
void* calloc(size_t k, size_t n) { return counted(__libc_calloc(k, n), k * n); }
void* realloc(void* p, size_t n) { return counted(__libc_realloc(p, n), n); }
void* memalign(size_t a, size_t n) { return counted(__libc_memalign(a, n), n); }
void* aligned_alloc(size_t a, size_t n) { return counted(__libc_memalign(a, n), n); }
int posix_memalign(void** out, size_t a, size_t n) {
  void* p = counted(__libc_memalign(a, n), n);
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}
}

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::string mode;
  int64_t steps = 2, warmup = 2;
  fsdp_bench::GptShape shape{4, 256, 4, 128, 4};  // bench's GPT, batch 4
  fsdp_bench::Args args("copies_bench",
                        "usage: copies_bench --mode plain|fsdp [--steps N] [--warmup N] [--layers N] [--dim N] "
                        "[--heads N] [--seq N] [--batch N]");
  shape.add_options(args);
  args.option("--mode", &mode).option("--steps", &steps).option("--warmup", &warmup);
  args.parse(argc, argv);
  if (mode != "plain" && mode != "fsdp") args.fail("--mode must be plain or fsdp");
  at::set_num_threads(1);
  fsdp_bench::GptTraining t(shape, {}, /*sharded=*/mode == "fsdp");
  double loss_value = 0, seconds = 0;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    auto data = t.next_batch();
    if (s == warmup) {
      CALLGRIND_START_INSTRUMENTATION;
      g_counting = true;
    }
    const auto t0 = std::chrono::steady_clock::now();
    loss_value = t.step(data).item<double>();
    if (s >= warmup) seconds += fsdp_bench::seconds_since(t0);
  }
  g_counting = false;
  CALLGRIND_STOP_INSTRUMENTATION;
  const double per_step = 1.0 / static_cast<double>(steps);
  std::printf(
      "copies_bench %s: loss %.6f after %lld steps, %.1f ms per measured step, %.0f heap allocations per step "
      "(%.2f MB)\n",
      mode.c_str(), loss_value, static_cast<long long>(warmup + steps), 1e3 * seconds * per_step,
      static_cast<double>(g_allocations.load()) * per_step, static_cast<double>(g_bytes.load()) * per_step / 1e6);
  return 0;
}
