// desync_bench: what TORCH_DISTRIBUTED_DEBUG=DETAIL (collective desync detection) costs per step,
// measured in one run: bench's GPT under fully_shard, with the check switched off and on in
// alternating blocks of steps (every rank switches at the same step, as it must).
//
//   build/bin/fsdprun --nproc-per-node 2 -- build/bin/desync_bench [--steps 40] [--block 5]
//       [--warmup 3] [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 8] [--detail 2]
//
// --detail 0 or 1 keeps the check off or on for every step instead (e.g. for instruction counts
// under valgrind on a quiet machine: on the shared development machine it did not finish).
// Then, the latency of one check alone: --calls all_reduces of one float, off and on alternating
// in blocks of 10 (the median per call; the difference is what one check adds to a collective).
//
// Rank 0 prints, for off and on: median wall time and process CPU time per step, collectives and
// desync checks per step, bytes sent per step by the collectives and by the checks, and the ratios.
#include <time.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "bench_support.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "desync_bench: %s\nusage: fsdprun --nproc-per-node N -- desync_bench [--steps N] [--block N] "
               "[--warmup N] [--layers N] [--dim N] [--heads N] [--seq N] [--batch N]\n",
               why.c_str());
  std::exit(2);
}

struct Mode {
  std::vector<double> wall, cpu;
  uint64_t steps = 0, collectives = 0, checks = 0, comm_bytes = 0, check_bytes = 0;
};

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::map<std::string, int64_t> o = {{"--steps", 40}, {"--block", 5},  {"--warmup", 3}, {"--layers", 4},
                                      {"--dim", 256},  {"--heads", 4},  {"--seq", 128},  {"--batch", 8},
                                      {"--detail", 2}, {"--calls", 200}};
  for (int i = 1; i < argc; i += 2) {
    if (!o.count(argv[i])) usage(std::string("unknown option ") + argv[i]);
    if (i + 1 >= argc) usage(std::string("missing value for ") + argv[i]);
    o[argv[i]] = std::stoll(argv[i + 1]);
  }
  try {
    fsdp::dist::init_distributed();
    const int rank = fsdp::dist::rank(), world = fsdp::dist::world_size();
    if (world < 2) usage("run it under fsdprun with 2 or more ranks (a world of one is never checked)");
    if (o["--batch"] % world != 0) usage("--batch must be a multiple of the world size");
    if (o["--detail"] < 0 || o["--detail"] > 2) usage("--detail must be 0 (off), 1 (on) or 2 (alternate)");
    if (o["--detail"] == 2 && (o["--block"] < 1 || o["--steps"] < 2 * o["--block"])) {
      usage("--steps must be at least 2 x --block");
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
    auto w = fsdp::dist::world_comm();
    const int64_t local_batch = o["--batch"] / world;
    Mode modes[2];
    for (int64_t s = 0; s < o["--warmup"] + o["--steps"]; ++s) {
      const bool measured = s >= o["--warmup"];
      const bool on = o["--detail"] == 2 ? measured && ((s - o["--warmup"]) / o["--block"]) % 2 == 1
                                         : measured && o["--detail"] == 1;
      fsdp::comm::set_desync_detection(on);
      auto data = at::randint(c.vocab_size, {local_batch, c.block_size + 1}, gen, at::kLong);
      const auto stats0 = fsdp::comm::process_comm_stats().snapshot();
      const auto checks0 = fsdp::comm::desync_check_counters();
      const uint64_t seq0 = w->seq();
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
      const auto checks = fsdp::comm::desync_check_counters();
      Mode& m = modes[on ? 1 : 0];
      m.wall.push_back(wall);
      m.cpu.push_back(cpu);
      m.steps += 1;
      m.collectives += w->seq() - seq0;
      m.checks += checks.checks - checks0.checks;
      m.comm_bytes += (fsdp::comm::process_comm_stats().snapshot() - stats0).total_bytes();
      m.check_bytes += checks.bytes_sent - checks0.bytes_sent;
    }
    // One check alone: a one-float all_reduce, off and on alternating in blocks of 10 calls.
    std::vector<double> call_s[2];
    at::Tensor one = at::ones({1});
    for (int64_t i = 0; i < o["--calls"]; ++i) {
      const bool on = (i / 10) % 2 == 1;
      fsdp::comm::set_desync_detection(on);
      const auto t0 = std::chrono::steady_clock::now();
      w->all_reduce(one);
      call_s[on ? 1 : 0].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    fsdp::comm::set_desync_detection(false);
    if (rank == 0 && !call_s[0].empty() && !call_s[1].empty()) {
      const double off_us = 1e6 * fsdp_bench::median(call_s[0]), on_us = 1e6 * fsdp_bench::median(call_s[1]);
      std::printf("one-float all_reduce (median of %zu calls each): off %.0f us, on %.0f us: one check adds %.0f us\n",
                  call_s[0].size(), off_us, on_us, on_us - off_us);
    }
    if (rank == 0) {
      std::printf(
          "desync_bench: GPT %lld layers, d=%lld, %lld heads, seq %lld, global batch %lld, float32, "
          "fully_shard per block + root; %d ranks; %lld steps in blocks of %lld alternating off/on after "
          "%lld warm-up\n",
          static_cast<long long>(c.n_layer), static_cast<long long>(c.n_embd), static_cast<long long>(c.n_head),
          static_cast<long long>(c.block_size), static_cast<long long>(o["--batch"]), world,
          static_cast<long long>(o["--steps"]), static_cast<long long>(o["--block"]),
          static_cast<long long>(o["--warmup"]));
      std::printf(
          "| DETAIL | steps | step wall (median) | step CPU (median) | collectives / step | checks / step | "
          "collective bytes / step | check bytes / step |\n|---|---|---|---|---|---|---|---|\n");
      for (int i = 0; i < 2; ++i) {
        const Mode& m = modes[i];
        if (m.steps == 0) continue;
        const double n = static_cast<double>(m.steps);
        std::printf("| %s | %llu | %.1f ms | %.1f ms | %.1f | %.1f | %.0f | %.0f |\n", i ? "on" : "off",
                    static_cast<unsigned long long>(m.steps), 1e3 * fsdp_bench::median(m.wall),
                    1e3 * fsdp_bench::median(m.cpu), m.collectives / n, m.checks / n, m.comm_bytes / n,
                    m.check_bytes / n);
      }
      if (modes[0].steps == 0 || modes[1].steps == 0) {
        fsdp::dist::destroy_distributed();
        return 0;
      }
      const double wall_ratio = fsdp_bench::median(modes[1].wall) / fsdp_bench::median(modes[0].wall);
      const double cpu_ratio = fsdp_bench::median(modes[1].cpu) / fsdp_bench::median(modes[0].cpu);
      std::printf("on / off: wall %.3fx, CPU %.3fx; extra bytes %.4f%% of the collectives'\n", wall_ratio, cpu_ratio,
                  100.0 * static_cast<double>(modes[1].check_bytes) / static_cast<double>(modes[1].comm_bytes));
    }
    fsdp::dist::destroy_distributed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "desync_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
