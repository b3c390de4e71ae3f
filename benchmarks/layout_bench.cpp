// layout_bench: FSDP's two CPU layouts (fsdp/debug/cpu_collectives.h) measured in one run:
// bench's GPT under fully_shard, the layout switched between blocks of steps in rotation (every
// rank switches at the same step, as it must): flat (FSDP2's one message per peer and unit, with
// copy-in, copy-out and the reduce-scatter input), and per parameter with each given
// min_piece_bytes (shards below it travel packed in one message).
//
//   build/bin/fsdprun --nproc-per-node 2 -- build/bin/layout_bench [--steps 60] [--block 5]
//       [--warmup 3] [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 8]
//       [--pieces-kib 64,1024] [--flat 0|1] [--split 0|1] [--comm-only KIB]
//
// Rank 0 prints, per layout: median wall time and process CPU time per step (both ranks' CPU is
// what two ranks on two cores share), minor page faults and the buffer pool's hits / misses /
// unmapped blocks per step, and the ratios to the first layout (flat unless --flat 0). --split 1 adds, for each size,
// the all-gather alone and the reduce-scatter alone per parameter. --comm-only KIB: no model, the all-gather of KIB per
// rank as 1, 2, 5 and 13 pieces (the cost of a message by itself).

#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"

namespace {

using fsdp_bench::bad_input;
struct Options {
  fsdp_bench::GptShape shape;         // bench's GPT, global batch 8
  fsdp_bench::Rotation rotation{60};  // the layouts: 60 steps in blocks of 5 after 3
  int64_t comm_only = 0, flat = 1, split = 0;
  std::string pieces_kib = "64,1024";
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "layout_bench",
      "usage: fsdprun --nproc-per-node N -- layout_bench [--steps N] [--block N] [--warmup N] [--layers N] [--dim N] "
      "[--heads N] [--seq N] [--batch N] [--pieces-kib K,K,...] [--flat 0|1] [--split 0|1] "
      "[--comm-only KIB]");
  o.shape.add_options(args);
  o.rotation.add_options(args);
  args.option("--comm-only", &o.comm_only).option("--flat", &o.flat).option("--split", &o.split);
  args.option("--pieces-kib", &o.pieces_kib);
  args.parse(argc, argv);
  return o;
}

struct Layout {
  std::string name;
  fsdp::CpuCollectiveOptions options;
  fsdp_bench::Samples per_step;
  uint64_t faults = 0, misses = 0, hits = 0, unmapped = 0;
};

// The collectives alone: a unit's worth of bytes per rank (--comm-only KiB) as one piece or split
// into k pieces, all-gathered `--steps` times each, in rotation.
void run_comm_only(const Options& o, int rank, int world) {
  auto w = fsdp::dist::world_comm();
  const int64_t numel = o.comm_only * 256;
  const std::vector<int> splits = {1, 2, 5, 13};
  std::map<int, fsdp_bench::Samples> calls;
  at::Tensor shard = at::randn({numel}), full = at::empty({numel * world});
  for (int64_t s = 0; s < o.rotation.steps * static_cast<int64_t>(splits.size()); ++s) {
    const int k = splits[static_cast<size_t>(s) % splits.size()];
    std::vector<at::Tensor> ins;
    std::vector<std::vector<at::Tensor>> outs;
    for (int i = 0; i < k; ++i) {
      const int64_t a = numel * i / k, b = numel * (i + 1) / k;
      ins.push_back(shard.narrow(0, a, b - a));
      std::vector<at::Tensor> by_rank;
      for (int r = 0; r < world; ++r) by_rank.push_back(full.narrow(0, r * numel + a, b - a));
      outs.push_back(by_rank);
    }
    const fsdp_bench::Stopwatch call;
    w->all_gather_pieces(ins, outs);
    calls[k].add(call);
  }
  if (rank != 0) return;
  std::printf(
      "| pieces (%lld KiB per rank in all) | calls | wall (median) | process CPU (median) |\n|---|---|---|---|\n",
      static_cast<long long>(o.comm_only));
  for (int k : splits) {
    std::printf("| %d | %zu | %.3f ms | %.3f ms |\n", k, calls[k].size(), 1e3 * calls[k].wall_median(),
                1e3 * calls[k].cpu_median());
  }
}

int run(const Options& o) {
  const auto place = fsdp_bench::join_world(true);
  const int rank = place.rank, world = place.world;
  if (world < 2) bad_input("run it under fsdprun with 2 or more ranks (a world of one has no collectives)");
  if (o.shape.batch % world != 0) bad_input("--batch must be a multiple of the world size");
  if (o.comm_only > 0) {
    run_comm_only(o, rank, world);
    fsdp::dist::destroy_distributed();
    return 0;
  }
  std::vector<Layout> layouts;
  if (o.flat) layouts.push_back({"flat", {false, false, 0}, {}});
  std::stringstream kibs(o.pieces_kib);
  for (std::string k; std::getline(kibs, k, ',');) {
    const size_t bytes = static_cast<size_t>(std::stoll(k)) * 1024;
    layouts.push_back({"per parameter, min_piece_bytes " + k + " KiB", {true, true, bytes}, {}});
    if (o.split) {
      layouts.push_back({"gather per parameter only, " + k + " KiB", {true, false, bytes}, {}});
      layouts.push_back({"reduce per parameter only, " + k + " KiB", {false, true, bytes}, {}});
    }
  }
  const auto& r = o.rotation;
  r.check(layouts.size(), "(layouts)");
  fsdp_bench::GptTraining t(o.shape, place);
  for (int64_t s = 0; s < r.total(); ++s) {
    const bool measured = r.measured(s);
    const size_t which = r.configuration(s, layouts.size());
    fsdp::set_cpu_collective_options(layouts[which].options);
    auto data = t.next_batch();
    const auto pool0 = fsdp::buffer_memory_stats();
    const uint64_t faults0 = fsdp_bench::minor_faults();
    const fsdp_bench::Stopwatch step;
    (void)t.step(data).item<float>();
    const double wall = step.wall(), cpu = step.cpu();
    if (!measured) continue;
    const auto pool1 = fsdp::buffer_memory_stats();
    Layout& l = layouts[which];
    l.per_step.add(wall, cpu);
    l.faults += fsdp_bench::minor_faults() - faults0;
    l.misses += pool1.pool_misses - pool0.pool_misses;
    l.hits += pool1.pool_hits - pool0.pool_hits;
    l.unmapped += pool1.pool_unmapped - pool0.pool_unmapped;
  }
  fsdp::set_cpu_collective_options({});
  if (rank == 0) {
    std::printf("layout_bench: %s, layouts in rotation, after %lld warm-up\n", r.describe(o.shape, world).c_str(),
                static_cast<long long>(r.warmup));
    std::printf(
        "| layout | steps | step wall (median) | step CPU, rank 0 (median) | wall / flat | CPU / flat | page faults "
        "/ step | pool hits / misses / unmapped per step |\n"
        "|---|---|---|---|---|---|---|---|\n");
    // Ratios to the first layout (flat unless --flat 0).
    const double flat_wall = layouts[0].per_step.wall_median(), flat_cpu = layouts[0].per_step.cpu_median();
    for (const auto& l : layouts) {
      const double wall = l.per_step.wall_median(), cpu = l.per_step.cpu_median();
      const double n = static_cast<double>(l.per_step.size());
      std::printf("| %s | %zu | %.1f ms | %.1f ms | %.3fx | %.3fx | %.0f | %.1f / %.1f / %.1f |\n", l.name.c_str(),
                  l.per_step.size(), 1e3 * wall, 1e3 * cpu, wall / flat_wall, cpu / flat_cpu, l.faults / n, l.hits / n,
                  l.misses / n, l.unmapped / n);
    }
  }
  fsdp::dist::destroy_distributed();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return fsdp_bench::run_main(argc, argv, parse, run); }
