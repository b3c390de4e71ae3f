// overhead_bench: what fully_shard adds to a step in a world of one, against plain LibTorch, and
// the floor of the copies it makes where there are ranks. One program, four modes:
//
//   build/bin/overhead_bench --mode host [--steps 200] [--block 10] [--warmup 6]
//       [--layers 24] [--dim 32] [--heads 2] [--seq 16] [--batch 2]
//     Host time. A launch-bound GPT (24 layers of dim 32, tiny tensors: a step is nearly all
//     per-operator host work, as on a fast GPU), trained by plain LibTorch and by fully_shard per
//     block and on the root in a world of one (no process group), in alternating blocks of steps
//     in one run; each side from the same initial values on the same tokens. Prints the median
//     block's step time of each side, FSDP's added host time per unit and step and, last,
//       fsdp_us_per_unit_step=X plain_step_ms=Y fsdp_step_ms=Z ratio=R max_loss_diff=D
//     Then the ATen operators of one step of each side (top-level ones: not called by another
//     operator), FSDP's extra per unit, and those issued inside each of FSDP's ranges
//     (fsdp::copy_in, ...; tests/support/op_counts.h's counting) per run of the range.
//
//   valgrind --tool=callgrind --instr-atstart=no build/bin/overhead_bench --mode plain
//   valgrind --tool=callgrind --instr-atstart=no build/bin/overhead_bench --mode fsdp
//       [--steps 2] [--warmup 2] [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 4]
//     Instructions and heap allocations. Both train bench's GPT (4 layers, d=256, one thread);
//     instrumentation covers only the --steps steps after the --warmup ones
//     (CALLGRIND_START/STOP_INSTRUMENTATION): compare the "Collected" (Ir) totals of the two runs,
//     which repeat to the instruction where a timing on a shared machine does not. Each run also
//     counts the heap allocations of the measured steps (every thread's malloc, calloc, realloc,
//     posix_memalign, aligned_alloc, memalign: this program interposes glibc's allocator, an
//     executable's definitions coming first in symbol lookup) and prints them per step.
//
//   build/bin/overhead_bench --mode floor [--nproc 2] [--reps 30] [--layers 4] [--dim 256] [--heads 4] [--seq 128]
//     The copies' floor: FSDP's CPU copies of one step of bench's FSDP fp32 row at --nproc ranks
//     (copy-out, reduce-scatter input, sharded gradient add) with no FSDP and no network, each
//     timed with its destination out of the caches as in a step, and as one memcpy of the same
//     bytes (docs/benchmarks.md, "What the copies cannot go under").
//
//   build/bin/overhead_bench --mode trainer [--build build] [--pairs 3] [--steps 15] [shape options]
//     The trainer: PAIRS alternating pairs of `train_gpt --parallel none` and `fsdprun
//     --nproc-per-node 1 -- train_gpt --parallel fsdp` (one thread, synthetic data, no
//     validation, sample or checkpoint), each run's median step time from its metrics summary;
//     and, in this process, the same shape's bare loop (forward, loss, backward, AdamW step) timed
//     in blocks against nothing: train_gpt's plain step minus the bare loop's is the trainer's own
//     host work per step. Prints, last,
//       trainer_us_per_step=X world_of_one_over_plain=R
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else  // valgrind's headers absent (package valgrind): the whole run is counted (--instr-atstart=yes)
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#endif

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "../tests/support/op_counts.h"
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

namespace {

struct Options {
  std::string mode;
  fsdp_bench::GptShape shape;
  int64_t steps = 0, warmup = 0, block = 10;
  int64_t nproc = 2, reps = 30, pairs = 3;
  std::string build = "build";
};

// The mode's defaults, set before the options are read (so they can override them).
Options defaults(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--mode") == 0) o.mode = argv[i + 1];
  }
  if (o.mode == "host") {
    o.shape = {24, 32, 2, 16, 2};
    o.steps = 200, o.warmup = 6;
  } else if (o.mode == "trainer") {
    o.shape = {24, 32, 2, 16, 2};
    o.steps = 15, o.warmup = 3;
  } else {
    o.shape = {4, 256, 4, 128, 4};  // bench's GPT, batch 4
    o.steps = 2, o.warmup = 2;
  }
  return o;
}

Options parse(int argc, char** argv) {
  Options o = defaults(argc, argv);
  fsdp_bench::Args args("overhead_bench",
                        "usage: overhead_bench --mode host|plain|fsdp|floor|trainer [--steps N] [--warmup N] "
                        "[--block N] [--nproc N] [--reps N] [--build DIR] [--pairs N] [--layers N] [--dim N] "
                        "[--heads N] [--seq N] [--batch N]");
  o.shape.add_options(args);
  args.option("--mode", &o.mode).option("--steps", &o.steps).option("--warmup", &o.warmup);
  args.option("--block", &o.block).option("--nproc", &o.nproc).option("--reps", &o.reps);
  args.option("--build", &o.build).option("--pairs", &o.pairs);
  args.parse(argc, argv);
  const std::string m = o.mode;
  if (m != "host" && m != "plain" && m != "fsdp" && m != "floor" && m != "trainer")
    args.fail("--mode must be host, plain, fsdp, floor or trainer");
  if (m == "floor" && o.nproc < 2) args.fail("--nproc must be at least 2 (a world of one copies nothing)");
  if (o.reps < 1 || o.pairs < 1 || o.steps < 1 || o.warmup < 0) args.fail("--reps, --pairs, --steps must be >= 1");
  if (m == "host" && (o.block < 1 || o.steps < 2 * o.block)) args.fail("--steps must be at least 2 x --block");
  return o;
}

// ---- --mode plain|fsdp: instructions and allocations -------------------------------------------

int run_instructions(const Options& o) {
  at::set_num_threads(1);
  fsdp_bench::GptTraining t(o.shape, {}, /*sharded=*/o.mode == "fsdp");
  double loss_value = 0, seconds = 0;
  for (int64_t s = 0; s < o.warmup + o.steps; ++s) {
    auto data = t.next_batch();
    if (s == o.warmup) {
      CALLGRIND_START_INSTRUMENTATION;
      g_counting = true;
    }
    const auto t0 = std::chrono::steady_clock::now();
    loss_value = t.step(data).item<double>();
    if (s >= o.warmup) seconds += fsdp_bench::seconds_since(t0);
  }
  g_counting = false;
  CALLGRIND_STOP_INSTRUMENTATION;
  const double per_step = 1.0 / static_cast<double>(o.steps);
  std::printf(
      "overhead_bench %s: loss %.6f after %lld steps, %.1f ms per measured step, %.0f heap allocations per step "
      "(%.2f MB)\n",
      o.mode.c_str(), loss_value, static_cast<long long>(o.warmup + o.steps), 1e3 * seconds * per_step,
      static_cast<double>(g_allocations.load()) * per_step, static_cast<double>(g_bytes.load()) * per_step / 1e6);
  return 0;
}

// ---- --mode floor: the copies' floor ------------------------------------------------------------

using FloorOptions = Options;

// The last-level cache's size from sysfs (0 if not there).
int64_t last_level_cache_bytes() {
  int64_t best = 0;
  for (int i = 0; i < 8; ++i) {
    std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/size");
    std::string s;
    if (!(f >> s) || s.empty()) continue;
    int64_t v = std::atoll(s.c_str());
    if (s.back() == 'K') v <<= 10;
    if (s.back() == 'M') v <<= 20;
    best = std::max(best, v);
  }
  return best;
}

// One unit's parameters, sharded over n ranks, and the buffers of its three copies.
struct Unit {
  std::string name;
  std::vector<int64_t> rows, row_numel, shard_numel;
  int64_t total = 0;  // elements of one rank's shards, side by side
  at::Tensor gathered, rs_input, reduced;
  std::vector<at::Tensor> unsharded_by_rank, grads, sharded_grads;

  Unit(std::string unit_name, const std::vector<at::Tensor>& params, int64_t n) : name(std::move(unit_name)) {
    for (const auto& p : params) {
      const int64_t r = p.dim() == 0 ? 1 : p.size(0), rn = p.numel() / std::max<int64_t>(r, 1);
      const int64_t padded = (r + n - 1) / n;
      rows.push_back(r);
      row_numel.push_back(rn);
      shard_numel.push_back(padded * rn);
      total += padded * rn;
      unsharded_by_rank.push_back(at::zeros({n, padded * rn}));
      grads.push_back(at::randn({r, rn}));
      sharded_grads.push_back(at::zeros({padded * rn}));
    }
    gathered = at::randn({n, total});
    rs_input = at::zeros({n, total});
    reduced = at::randn({total});
  }
  int64_t bytes() const { return gathered.nbytes(); }

  void copy_out() { at::split_with_sizes_copy_out(unsharded_by_rank, gathered, shard_numel, 1); }

  // As split_rows: the ranks whose rows all exist in one strided copy, a short last rank's rows
  // and its padding apart.
  void reduce_scatter_input() {
    const int64_t n = rs_input.size(0);
    int64_t offset = 0;
    for (size_t i = 0; i < grads.size(); ++i) {
      const int64_t padded = shard_numel[i] / row_numel[i], whole = std::min<int64_t>(rows[i] / padded, n);
      const at::Tensor flat = grads[i].view(-1);
      if (whole > 0) {
        rs_input.narrow(0, 0, whole)
            .narrow(1, offset, shard_numel[i])
            .copy_(flat.narrow(0, 0, whole * shard_numel[i]).view({whole, shard_numel[i]}));
      }
      for (int64_t r = whole; r < n; ++r) {
        const int64_t first = r * padded, have = std::max<int64_t>(0, std::min(padded, rows[i] - first));
        at::Tensor dst = rs_input[r].narrow(0, offset, shard_numel[i]);
        if (have > 0)
          dst.narrow(0, 0, have * row_numel[i]).copy_(flat.narrow(0, first * row_numel[i], have * row_numel[i]));
        if (have < padded) dst.narrow(0, have * row_numel[i], (padded - have) * row_numel[i]).zero_();
      }
      offset += shard_numel[i];
    }
  }

  void grad_add() {
    int64_t offset = 0;
    for (size_t i = 0; i < sharded_grads.size(); ++i) {
      sharded_grads[i].add_(reduced.narrow(0, offset, shard_numel[i]));
      offset += shard_numel[i];
    }
  }
};

// Reads every byte of `t` (brings it into the caches, as a tensor just written is).
void touch(const at::Tensor& t) { (void)t.sum().item<float>(); }

double micros(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// Times `op` with the caches flushed (by writing `evict`) and `warm` read just before; then again
// right after (everything in the caches). Medians over `reps`, in microseconds.
template <typename Op>
std::pair<double, double> cold_and_hot(const Op& op, const std::vector<at::Tensor>& warm, at::Tensor& evict,
                                       int64_t reps) {
  std::vector<double> cold, hot;
  op();
  for (int64_t i = 0; i < reps; ++i) {
    evict.add_(1.0f);
    for (const auto& t : warm) touch(t);
    auto t0 = std::chrono::steady_clock::now();
    op();
    auto t1 = std::chrono::steady_clock::now();
    op();
    auto t2 = std::chrono::steady_clock::now();
    cold.push_back(micros(t0, t1));
    hot.push_back(micros(t1, t2));
  }
  return {fsdp_bench::median(cold), fsdp_bench::median(hot)};
}

int run_floor(const FloorOptions& o) {
  at::set_num_threads(1);  // as each of bench's ranks
  auto config = o.shape.config();
  auto model = fsdp_bench::seeded_gpt(config);
  std::vector<Unit> units;
  std::vector<at::Tensor> root;
  for (size_t b = 0; b < model->blocks.size(); ++b) {
    std::vector<at::Tensor> ps;
    for (const auto& p : model->blocks[b]->parameters()) ps.push_back(p.detach());
    units.emplace_back("block " + std::to_string(b), ps, o.nproc);
  }
  std::vector<const void*> in_blocks;  // the blocks' parameters, by storage
  for (const auto& b : model->blocks) {
    for (const auto& p : b->parameters()) in_blocks.push_back(p.data_ptr());
  }
  for (const auto& p : model->parameters()) {
    if (std::find(in_blocks.begin(), in_blocks.end(), p.data_ptr()) == in_blocks.end()) root.push_back(p.detach());
  }
  if (!root.empty()) units.emplace_back("root", root, o.nproc);

  const int64_t llc = last_level_cache_bytes();
  at::Tensor evict = at::zeros({std::max<int64_t>(64 << 20, 4 * llc) / 4});
  std::printf(
      "overhead_bench --mode floor: %s, %lld ranks' layout, one process, one thread; last-level cache %.1f MiB, caches "
      "flushed "
      "by writing %.0f MiB; medians of %lld\n\n",
      o.shape.describe().c_str(), static_cast<long long>(o.nproc), llc / 1048576.0, evict.nbytes() / 1048576.0,
      static_cast<long long>(o.reps));
  std::printf(
      "| unit | parameters | all-gather output | copy-out (hot) | memcpy of its bytes | reduce-scatter input (hot) | "
      "sharded grad add (hot) |\n|---|---|---|---|---|---|---|\n");
  double out_step = 0, rs_step = 0, add_step = 0, memcpy_step = 0, hot_step = 0;
  for (auto& u : units) {
    at::Tensor flat_dst = at::empty({u.gathered.numel()});
    const auto [out_cold, out_hot] = cold_and_hot([&] { u.copy_out(); }, {u.gathered}, evict, o.reps);
    const auto [mem_cold, mem_hot] =
        cold_and_hot([&] { std::memcpy(flat_dst.data_ptr(), u.gathered.data_ptr(), u.gathered.nbytes()); },
                     {u.gathered}, evict, o.reps);
    const auto [rs_cold, rs_hot] = cold_and_hot([&] { u.reduce_scatter_input(); }, u.grads, evict, o.reps);
    const auto [add_cold, add_hot] = cold_and_hot([&] { u.grad_add(); }, {u.reduced}, evict, o.reps);
    const double gathers = u.name == "root" ? 1 : 2;  // reshard_after_forward: blocks gathered again
    out_step += gathers * out_cold;
    memcpy_step += gathers * mem_cold;
    rs_step += rs_cold;
    add_step += add_cold;
    hot_step += gathers * out_hot + rs_hot + add_hot;
    const double mb = u.bytes() / 1e6;
    std::printf(
        "| %s | %zu | %.2f MB | %.0f us (%.0f), %.1f GB/s | %.0f us, %.1f GB/s | %.0f us (%.0f) | %.0f us (%.0f) |\n",
        u.name.c_str(), u.rows.size(), mb, out_cold, out_hot, 2 * mb / out_cold * 1e3, mem_cold,
        2 * mb / mem_cold * 1e3, rs_cold, rs_hot, add_cold, add_hot);
    std::fflush(stdout);
  }
  std::printf(
      "\nGB/s: bytes read plus bytes written, per second. A step of bench's FSDP fp32 row, per rank: copy-out %zu "
      "times (every block twice, the root once) %.2f ms (one memcpy of the same bytes each: %.2f ms), "
      "reduce-scatter input %.2f ms, sharded grad add %.2f ms\n",
      2 * units.size() - (root.empty() ? 0 : 1), out_step / 1e3, memcpy_step / 1e3, rs_step / 1e3, add_step / 1e3);
  std::printf(
      "copies' floor per rank and step: %.2f ms with the destinations out of the caches (as in a step); %.2f ms if "
      "every byte were in the caches (bench's \"ours: copies\" is the same work, measured in the step)\n",
      (out_step + rs_step + add_step) / 1e3, hot_step / 1e3);
  return 0;
}

// ---- --mode host: FSDP's added host time per unit and step -------------------------------------

using fsdp::testing::TopLevelOps;

int64_t total(const std::map<std::string, int64_t>& ops) {
  int64_t n = 0;
  for (const auto& [name, count] : ops) n += count;
  return n;
}

// One step of each side under the counters: the top-level operators, those whose count differs
// (FSDP's own, per unit), and what FSDP's ranges issued.
void count_ops(fsdp_bench::GptTraining& plain, fsdp_bench::GptTraining& sharded, int64_t units) {
  std::map<std::string, int64_t> per_side[2];
  std::string ranges;
  fsdp_bench::GptTraining* sides[2] = {&plain, &sharded};
  for (int side = 0; side < 2; ++side) {
    auto data = sides[side]->next_batch();
    fsdp::testing::RangeOpCounter in_ranges;
    TopLevelOps top;
    sides[side]->step(data);
    per_side[side] = top.ops();
    if (side == 1) ranges = in_ranges.describe_all();
  }
  const int64_t p = total(per_side[0]), f = total(per_side[1]);
  std::printf("ATen operators per step (top-level): plain %lld, fully_shard %lld: %.2f more per unit (%lld units)\n",
              static_cast<long long>(p), static_cast<long long>(f),
              static_cast<double>(f - p) / static_cast<double>(units), static_cast<long long>(units));
  std::map<std::string, int64_t> diff = per_side[1];
  for (const auto& [name, count] : per_side[0]) diff[name] -= count;
  for (const auto& [name, count] : diff) {
    if (count != 0)
      std::printf("  %s: %+lld per step (%.2f per unit)\n", name.c_str(), static_cast<long long>(count),
                  static_cast<double>(count) / static_cast<double>(units));
  }
  std::printf("operators issued inside FSDP's ranges in one step (all units):\n%s", ranges.c_str());
}

// The calling thread's CPU time: every op of a step runs on it (one thread, CPU autograd), and it
// does not count the time another process holds the core, which a wall clock on a loaded machine
// does.
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The two sides in alternating blocks of o.block steps; each side's step times in ms by block, and
// its losses by step (the same tokens at the same step on both sides).
struct Timed {
  std::vector<double> block_ms[2], block_cpu_ms[2];  // wall; this thread's CPU time
  std::vector<double> losses[2];
};
Timed time_blocks(const Options& o, fsdp_bench::GptTraining* sides[2]) {
  Timed r;
  for (int side = 0; side < 2; ++side) {
    for (int64_t i = 0; i < o.warmup; ++i)
      r.losses[side].push_back(sides[side]->step(sides[side]->next_batch()).item<double>());
  }
  for (int64_t b = 0; b < o.steps / o.block; ++b) {
    const int side = static_cast<int>(b % 2);
    double seconds = 0, cpu = 0;
    for (int64_t i = 0; i < o.block; ++i) {
      auto data = sides[side]->next_batch();
      const double c0 = thread_cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor loss = sides[side]->step(data);
      seconds += fsdp_bench::seconds_since(t0);
      cpu += thread_cpu_seconds() - c0;
      r.losses[side].push_back(loss.item<double>());
    }
    r.block_ms[side].push_back(1e3 * seconds / static_cast<double>(o.block));
    r.block_cpu_ms[side].push_back(1e3 * cpu / static_cast<double>(o.block));
  }
  return r;
}

// The first number of /proc/loadavg ("?" where there is none).
std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string s;
  return f >> s ? s : std::string("?");
}

int run_host(const Options& o) {
  at::set_num_threads(1);
  fsdp_bench::GptTraining plain(o.shape, {}, /*sharded=*/false), sharded(o.shape, {}, /*sharded=*/true);
  fsdp_bench::GptTraining* sides[2] = {&plain, &sharded};
  const int64_t units = o.shape.layers + 1;  // a unit per block and the root
  std::printf(
      "overhead_bench --mode host: %s, batch %lld, float32, one thread; fully_shard per block + root in a "
      "world of one (%lld units) against plain LibTorch, %lld steps in alternating blocks of %lld; "
      "load average %s\n",
      o.shape.describe().c_str(), static_cast<long long>(o.shape.batch), static_cast<long long>(units),
      static_cast<long long>(o.steps), static_cast<long long>(o.block), load_average().c_str());
  const Timed t = time_blocks(o, sides);
  double max_diff = 0;
  const size_t n = std::min(t.losses[0].size(), t.losses[1].size());
  for (size_t i = 0; i < n; ++i) max_diff = std::max(max_diff, std::abs(t.losses[0][i] - t.losses[1][i]));
  const double plain_wall = fsdp_bench::median(t.block_ms[0]), fsdp_wall = fsdp_bench::median(t.block_ms[1]);
  const double plain_ms = fsdp_bench::median(t.block_cpu_ms[0]), fsdp_ms = fsdp_bench::median(t.block_cpu_ms[1]);
  const double per_unit_us = 1e3 * (fsdp_ms - plain_ms) / static_cast<double>(units);
  count_ops(plain, sharded, units);
  std::printf("wall clock (median block): plain %.3f ms, fully_shard %.3f ms per step: %.1f us per unit and step\n",
              plain_wall, fsdp_wall, 1e3 * (fsdp_wall - plain_wall) / static_cast<double>(units));
  std::printf(
      "host CPU time of the step's thread (median block), the figures below; losses step by step equal "
      "within max_loss_diff\n");
  std::printf("fsdp_us_per_unit_step=%.1f plain_step_ms=%.3f fsdp_step_ms=%.3f ratio=%.3f max_loss_diff=%.3g\n",
              per_unit_us, plain_ms, fsdp_ms, fsdp_ms / plain_ms, max_diff);
  return 0;
}

// ---- --mode trainer: train_gpt's world of one, and its own host work ----------------------------

// The "median_step_time_s" of a train_gpt metrics file's last line (its summary); -1 if absent.
double median_step_time(const std::string& metrics) {
  std::ifstream f(metrics);
  std::string line, last;
  while (std::getline(f, line)) {
    if (!line.empty()) last = line;
  }
  const std::string key = "\"median_step_time_s\":";
  const auto at = last.find(key);
  return at == std::string::npos ? -1 : std::atof(last.c_str() + at + key.size());
}

// One train_gpt run's median step time in seconds (fsdp: a world of one under fsdprun).
double train_gpt_step(const Options& o, bool fsdp, const std::string& metrics) {
  const fsdp_bench::GptShape& s = o.shape;
  std::vector<std::string> cmd;
  if (fsdp) cmd = {o.build + "/bin/fsdprun", "--nproc-per-node", "1", "--master-port", "0", "--"};
  for (const std::string& a : {o.build + "/bin/train_gpt",
                               std::string("--parallel"),
                               std::string(fsdp ? "fsdp" : "none"),
                               std::string("--layers"),
                               std::to_string(s.layers),
                               std::string("--dim"),
                               std::to_string(s.dim),
                               std::string("--heads"),
                               std::to_string(s.heads),
                               std::string("--seq-len"),
                               std::to_string(s.seq),
                               std::string("--batch-size"),
                               std::to_string(s.batch),
                               std::string("--data"),
                               std::string("synthetic"),
                               std::string("--eval-every"),
                               std::string("0"),
                               std::string("--sample-tokens"),
                               std::string("0"),
                               std::string("--checkpoint-dir"),
                               std::string(""),
                               std::string("--metrics"),
                               metrics,
                               std::string("--steps"),
                               std::to_string(o.steps)})
    cmd.push_back(a);
  std::remove(metrics.c_str());
  const int rc = fsdp_bench::spawn_and_wait(cmd, {"OMP_NUM_THREADS=1"});
  if (rc != 0)
    throw std::runtime_error("overhead_bench: " + cmd[0] + " exited with " + std::to_string(rc) +
                             "; build train_gpt and fsdprun (--build DIR names their build folder)");
  return median_step_time(metrics);
}

int run_trainer(const Options& o) {
  at::set_num_threads(1);
  const std::string metrics = "/tmp/overhead_bench." + std::to_string(::getpid()) + ".jsonl";
  std::vector<double> plain, fsdp, ratios;
  for (int64_t i = 0; i < o.pairs; ++i) {
    const bool fsdp_first = i % 2 == 1;
    const double a = train_gpt_step(o, fsdp_first, metrics), b = train_gpt_step(o, !fsdp_first, metrics);
    plain.push_back(fsdp_first ? b : a);
    fsdp.push_back(fsdp_first ? a : b);
    ratios.push_back(fsdp.back() / plain.back());
  }
  std::remove(metrics.c_str());
  fsdp_bench::GptTraining bare(o.shape, {}, /*sharded=*/false);
  std::vector<double> bare_s;
  for (int64_t i = 0; i < o.warmup + o.steps; ++i) {
    auto data = bare.next_batch();
    const auto t0 = std::chrono::steady_clock::now();
    (void)bare.step(data).item<double>();
    if (i >= o.warmup) bare_s.push_back(fsdp_bench::seconds_since(t0));
  }
  const double p = fsdp_bench::median(plain), f = fsdp_bench::median(fsdp), b = fsdp_bench::median(bare_s);
  std::printf(
      "overhead_bench --mode trainer: %s, batch %lld, %lld pairs of %lld steps; median step: train_gpt plain "
      "%.3f ms, world of one %.3f ms, the bare loop %.3f ms\n",
      o.shape.describe().c_str(), static_cast<long long>(o.shape.batch), static_cast<long long>(o.pairs),
      static_cast<long long>(o.steps), 1e3 * p, 1e3 * f, 1e3 * b);
  std::printf("trainer_us_per_step=%.1f world_of_one_over_plain=%.3f\n", 1e6 * (p - b), fsdp_bench::median(ratios));
  return 0;
}

int run(const Options& o) {
  if (o.mode == "host") return run_host(o);
  if (o.mode == "floor") return run_floor(o);
  if (o.mode == "trainer") return run_trainer(o);
  return run_instructions(o);
}

}  // namespace

int main(int argc, char** argv) { return fsdp_bench::run_main(argc, argv, parse, run); }
