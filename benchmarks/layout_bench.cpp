// layout_bench: FSDP's two CPU layouts (fsdp/sharding/cpu_collectives.h) measured in one run:
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
#include "fsdp/fsdp.h"
#include "fsdp/memory/buffer_pool.h"
#include "models/gpt.h"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "layout_bench: %s\nusage: fsdprun --nproc-per-node N -- layout_bench [--steps N] [--block N] "
               "[--warmup N] [--layers N] [--dim N] [--heads N] [--seq N] [--batch N] [--pieces-kib K,K,...]\n",
               why.c_str());
  std::exit(2);
}

struct Layout {
  std::string name;
  fsdp::CpuCollectiveOptions options;
  std::vector<double> wall, cpu;
  uint64_t faults = 0, misses = 0, hits = 0, unmapped = 0;
};

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::map<std::string, int64_t> o = {{"--steps", 60},    {"--block", 5}, {"--warmup", 3}, {"--layers", 4},
                                      {"--dim", 256},     {"--heads", 4}, {"--seq", 128},  {"--batch", 8},
                                      {"--comm-only", 0}, {"--flat", 1},  {"--split", 0}};
  std::string pieces_kib = "64,1024";
  for (int i = 1; i < argc; i += 2) {
    if (i + 1 >= argc) usage(std::string("missing value for ") + argv[i]);
    if (std::string(argv[i]) == "--pieces-kib") {
      pieces_kib = argv[i + 1];
      continue;
    }
    if (!o.count(argv[i])) usage(std::string("unknown option ") + argv[i]);
    o[argv[i]] = std::stoll(argv[i + 1]);
  }
  try {
    fsdp::dist::init_distributed();
    const int rank = fsdp::dist::rank(), world = fsdp::dist::world_size();
    if (world < 2) usage("run it under fsdprun with 2 or more ranks (a world of one has no collectives)");
    if (o["--batch"] % world != 0) usage("--batch must be a multiple of the world size");
    if (o.count("--comm-only") && o["--comm-only"] > 0) {
      // The collectives alone: a unit's worth of bytes per rank (--comm-only KiB) as one piece or
      // split into k pieces, all-gathered `--steps` times each, in rotation.
      auto w = fsdp::dist::world_comm();
      const int64_t numel = o["--comm-only"] * 256;
      const std::vector<int> splits = {1, 2, 5, 13};
      std::map<int, std::vector<double>> wall, cpu;
      at::Tensor shard = at::randn({numel}), full = at::empty({numel * world});
      for (int64_t s = 0; s < o["--steps"] * static_cast<int64_t>(splits.size()); ++s) {
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
        const double cpu0 = fsdp_bench::cpu_seconds();
        const auto t0 = std::chrono::steady_clock::now();
        w->all_gather_pieces(ins, outs);
        wall[k].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        cpu[k].push_back(fsdp_bench::cpu_seconds() - cpu0);
      }
      if (rank == 0) {
        std::printf(
            "| pieces (%lld KiB per rank in all) | calls | wall (median) | process CPU (median) |\n|---|---|---|---|\n",
            static_cast<long long>(o["--comm-only"]));
        for (int k : splits) {
          std::printf("| %d | %zu | %.3f ms | %.3f ms |\n", k, wall[k].size(), 1e3 * fsdp_bench::median(wall[k]),
                      1e3 * fsdp_bench::median(cpu[k]));
        }
      }
      fsdp::dist::destroy_distributed();
      return 0;
    }
    std::vector<Layout> layouts;
    if (o["--flat"]) layouts.push_back({"flat", {false, false, 0}, {}, {}});
    std::stringstream kibs(pieces_kib);
    for (std::string k; std::getline(kibs, k, ',');) {
      const size_t bytes = static_cast<size_t>(std::stoll(k)) * 1024;
      layouts.push_back({"per parameter, min_piece_bytes " + k + " KiB", {true, true, bytes}, {}, {}});
      if (o["--split"]) {
        layouts.push_back({"gather per parameter only, " + k + " KiB", {true, false, bytes}, {}, {}});
        layouts.push_back({"reduce per parameter only, " + k + " KiB", {false, true, bytes}, {}, {}});
      }
    }
    if (o["--block"] < 1 || o["--steps"] < static_cast<int64_t>(layouts.size()) * o["--block"]) {
      usage("--steps must be at least (layouts) x --block");
    }
    fsdp::models::GPTConfig c;
    c.vocab_size = 256;
    c.block_size = o["--seq"];
    c.n_layer = o["--layers"];
    c.n_head = o["--heads"];
    c.n_embd = o["--dim"];
    torch::manual_seed(0);
    fsdp::models::GPT model(c);
    for (auto& b : model->blocks) fsdp::fully_shard(b);
    fsdp::fully_shard(model);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
    auto gen = at::detail::createCPUGenerator(1234 + rank);
    const int64_t local_batch = o["--batch"] / world;
    for (int64_t s = 0; s < o["--warmup"] + o["--steps"]; ++s) {
      const bool measured = s >= o["--warmup"];
      const size_t which = measured ? static_cast<size_t>((s - o["--warmup"]) / o["--block"]) % layouts.size() : 0;
      fsdp::set_cpu_collective_options(layouts[which].options);
      auto data = at::randint(c.vocab_size, {local_batch, c.block_size + 1}, gen, at::kLong);
      const auto pool0 = fsdp::buffer_memory_stats();
      const uint64_t faults0 = fsdp_bench::minor_faults();
      const double cpu0 = fsdp_bench::cpu_seconds();
      const auto t0 = std::chrono::steady_clock::now();
      opt.zero_grad();
      auto loss =
          fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
      loss.backward();
      opt.step();
      (void)loss.item<float>();
      const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double cpu = fsdp_bench::cpu_seconds() - cpu0;
      if (!measured) continue;
      const auto pool1 = fsdp::buffer_memory_stats();
      Layout& l = layouts[which];
      l.wall.push_back(wall);
      l.cpu.push_back(cpu);
      l.faults += fsdp_bench::minor_faults() - faults0;
      l.misses += pool1.pool_misses - pool0.pool_misses;
      l.hits += pool1.pool_hits - pool0.pool_hits;
      l.unmapped += pool1.pool_unmapped - pool0.pool_unmapped;
    }
    fsdp::set_cpu_collective_options({});
    if (rank == 0) {
      std::printf(
          "layout_bench: GPT %lld layers, d=%lld, %lld heads, seq %lld, global batch %lld, float32, "
          "fully_shard per block + root; %d ranks; %lld steps in blocks of %lld, layouts in rotation, after "
          "%lld warm-up\n",
          static_cast<long long>(c.n_layer), static_cast<long long>(c.n_embd), static_cast<long long>(c.n_head),
          static_cast<long long>(c.block_size), static_cast<long long>(o["--batch"]), world,
          static_cast<long long>(o["--steps"]), static_cast<long long>(o["--block"]),
          static_cast<long long>(o["--warmup"]));
      std::printf(
          "| layout | steps | step wall (median) | step CPU, rank 0 (median) | wall / flat | CPU / flat | page faults "
          "/ step | pool hits / misses / unmapped per step |\n"
          "|---|---|---|---|---|---|---|---|\n");
      // Ratios to the first layout (flat unless --flat 0).
      const double flat_wall = fsdp_bench::median(layouts[0].wall), flat_cpu = fsdp_bench::median(layouts[0].cpu);
      for (const auto& l : layouts) {
        const double wall = fsdp_bench::median(l.wall), cpu = fsdp_bench::median(l.cpu);
        const double n = static_cast<double>(l.wall.size());
        std::printf("| %s | %zu | %.1f ms | %.1f ms | %.3fx | %.3fx | %.0f | %.1f / %.1f / %.1f |\n", l.name.c_str(),
                    l.wall.size(), 1e3 * wall, 1e3 * cpu, wall / flat_wall, cpu / flat_cpu, l.faults / n, l.hits / n,
                    l.misses / n, l.unmapped / n);
      }
    }
    fsdp::dist::destroy_distributed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "layout_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
