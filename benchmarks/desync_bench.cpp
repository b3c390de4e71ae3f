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
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_support.h"

namespace {

using fsdp_bench::bad_input;
using fsdp_bench::median;

struct Options {
  fsdp_bench::GptShape shape;     // bench's GPT, global batch 8
  fsdp_bench::Rotation rotation;  // off and on (--detail 2): 40 steps in blocks of 5 after 3
  int64_t detail = 2, calls = 200;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "desync_bench",
      "usage: fsdprun --nproc-per-node N -- desync_bench [--steps N] [--block N] [--warmup N] [--layers N] [--dim N] "
      "[--heads N] [--seq N] [--batch N] [--detail 0|1|2] [--calls N]");
  o.shape.add_options(args);
  o.rotation.add_options(args);
  args.option("--detail", &o.detail).option("--calls", &o.calls);
  args.parse(argc, argv);
  if (o.detail < 0 || o.detail > 2) bad_input("--detail must be 0 (off), 1 (on) or 2 (alternate)");
  if (o.detail == 2) o.rotation.check(2, "2");
  return o;
}

struct Mode {
  fsdp_bench::Samples per_step;
  uint64_t steps = 0, collectives = 0, checks = 0, comm_bytes = 0, check_bytes = 0;
};

int run(const Options& o) {
  const auto place = fsdp_bench::join_world(true);
  const int rank = place.rank, world = place.world;
  if (world < 2) bad_input("run it under fsdprun with 2 or more ranks (a world of one is never checked)");
  if (o.shape.batch % world != 0) bad_input("--batch must be a multiple of the world size");
  fsdp_bench::GptTraining t(o.shape, place);
  auto w = fsdp::dist::world_comm();
  Mode modes[2];
  const auto& r = o.rotation;
  for (int64_t s = 0; s < r.total(); ++s) {
    const bool measured = r.measured(s);
    const bool on = measured && (o.detail == 2 ? r.configuration(s, 2) == 1 : o.detail == 1);
    fsdp::comm::set_desync_detection(on);
    auto data = t.next_batch();
    const auto stats0 = fsdp::comm::process_comm_stats().snapshot();
    const auto checks0 = fsdp::comm::desync_check_counters();
    const uint64_t seq0 = w->seq();
    const fsdp_bench::Stopwatch step;
    (void)t.step(data).item<float>();
    const double wall = step.wall(), cpu = step.cpu();
    if (!measured) continue;
    const auto checks = fsdp::comm::desync_check_counters();
    Mode& m = modes[on ? 1 : 0];
    m.per_step.add(wall, cpu);
    m.steps += 1;
    m.collectives += w->seq() - seq0;
    m.checks += checks.checks - checks0.checks;
    m.comm_bytes += (fsdp::comm::process_comm_stats().snapshot() - stats0).total_bytes();
    m.check_bytes += checks.bytes_sent - checks0.bytes_sent;
  }
  // One check alone: a one-float all_reduce, off and on alternating in blocks of 10 calls.
  std::vector<double> call_s[2];
  at::Tensor one = at::ones({1});
  for (int64_t i = 0; i < o.calls; ++i) {
    const bool on = (i / 10) % 2 == 1;
    fsdp::comm::set_desync_detection(on);
    const auto t0 = std::chrono::steady_clock::now();
    w->all_reduce(one);
    call_s[on ? 1 : 0].push_back(fsdp_bench::seconds_since(t0));
  }
  fsdp::comm::set_desync_detection(false);
  if (rank == 0 && !call_s[0].empty() && !call_s[1].empty()) {
    const double off_us = 1e6 * median(call_s[0]), on_us = 1e6 * median(call_s[1]);
    std::printf("one-float all_reduce (median of %zu calls each): off %.0f us, on %.0f us: one check adds %.0f us\n",
                call_s[0].size(), off_us, on_us, on_us - off_us);
  }
  if (rank == 0) {
    std::printf("desync_bench: %s alternating off/on after %lld warm-up\n", r.describe(o.shape, world).c_str(),
                static_cast<long long>(r.warmup));
    std::printf(
        "| DETAIL | steps | step wall (median) | step CPU (median) | collectives / step | checks / step | "
        "collective bytes / step | check bytes / step |\n|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < 2; ++i) {
      const Mode& m = modes[i];
      if (m.steps == 0) continue;
      const double n = static_cast<double>(m.steps);
      std::printf("| %s | %llu | %.1f ms | %.1f ms | %.1f | %.1f | %.0f | %.0f |\n", i ? "on" : "off",
                  static_cast<unsigned long long>(m.steps), 1e3 * m.per_step.wall_median(),
                  1e3 * m.per_step.cpu_median(), m.collectives / n, m.checks / n, m.comm_bytes / n, m.check_bytes / n);
    }
    if (modes[0].steps > 0 && modes[1].steps > 0) {
      const double wall_ratio = modes[1].per_step.wall_median() / modes[0].per_step.wall_median();
      const double cpu_ratio = modes[1].per_step.cpu_median() / modes[0].per_step.cpu_median();
      std::printf("on / off: wall %.3fx, CPU %.3fx; extra bytes %.4f%% of the collectives'\n", wall_ratio, cpu_ratio,
                  100.0 * static_cast<double>(modes[1].check_bytes) / static_cast<double>(modes[1].comm_bytes));
    }
  }
  fsdp::dist::destroy_distributed();
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return fsdp_bench::run_main(argc, argv, parse, run); }
