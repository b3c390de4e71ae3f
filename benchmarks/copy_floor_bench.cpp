// copy_floor_bench: what FSDP's CPU copies of one step cost the memory system by themselves, no
// FSDP and no network: the same bytes, in the same layouts, as bench's FSDP fp32 row moves, each
// timed with its destination out of the caches as it is in a training step. It answers whether
// the "ours: copies" of bench's CPU split is FSDP's code or the machine's memory bandwidth
// (docs/benchmarks.md, "What the copies cannot go under").
//
//   build/bin/copy_floor_bench [--nproc 2] [--reps 30] [--layers 4] [--dim 256] [--heads 4] [--seq 128]
//
// The units are fully_shard's in bench (one per block, and the root), each parameter's rows
// sharded over --nproc ranks as FSDP2 pads them (dim 0, ceil(rows / N) rows a rank). Per unit,
// the three copies FSDP makes on a rank ([Note: one copy kernel per unit] in
// src/sharding/collectives.cpp):
//  - copy-out: at::split_with_sizes_copy_out of the all-gather output [N, total] into each
//    parameter's unsharded storage seen as [N, shard_numel]; the output just received (in the
//    caches), the unsharded storage not (last written a unit's forward and backward ago);
//  - reduce-scatter input: each full gradient (just computed: in the caches) into its columns of
//    the [N, total] input, its rows by rank (the padding zeroed), the input not in the caches;
//  - sharded gradient add: this rank's row of the reduced output added into each parameter's
//    sharded gradient (kept since the last step: out of the caches).
// "Out of the caches" is made by writing a buffer of four times the last-level cache (at least 64
// MiB) before the copy. Each copy is also timed twice in a row (its data in the caches), and the
// same bytes as one memcpy with its destination out of the caches, the machine's floor for them.
//
// A step of bench's FSDP fp32 row copies out 2 x (blocks) + 1 times (reshard_after_forward: every
// block is gathered again for backward, the root is not), builds one reduce-scatter input per unit
// and adds one reduced row per unit: the sum is the copies' floor per rank and step, printed last.
// One process: two ranks copying at once on two cores share the memory bandwidth, which only
// raises the floor.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "bench_support.h"

namespace {

struct Options {
  fsdp_bench::GptShape shape;
  int64_t nproc = 2, reps = 30;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args("copy_floor_bench",
                        "usage: copy_floor_bench [--nproc N] [--reps N] [--layers N] [--dim N] [--heads N] [--seq N]");
  o.shape.add_options(args);
  args.option("--nproc", &o.nproc).option("--reps", &o.reps);
  args.parse(argc, argv);
  if (o.nproc < 2) fsdp_bench::bad_input("--nproc must be at least 2 (a world of one copies nothing)");
  if (o.reps < 1) fsdp_bench::bad_input("--reps must be at least 1");
  return o;
}

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

int run(const Options& o) {
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
      "copy_floor_bench: %s, %lld ranks' layout, one process, one thread; last-level cache %.1f MiB, caches flushed "
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

}  // namespace

int main(int argc, char** argv) { return fsdp_bench::run_main(argc, argv, parse, run); }
