// profiler_bench: what FSDP's profiler ranges cost, and a trace of bench's GPT (run under fsdprun).
//
//   build/bin/fsdprun --nproc-per-node 2 build/bin/profiler_bench [--dir DIR] [--rounds 5] [--steps 4]
//
// bench's GPT (4 layers, dim 256, 4 heads, seq 128, global batch 8, fp32, AdamW), every block a
// unit plus the root. After 3 warm-up steps, rounds alternate: --steps steps with nothing
// recording (the ranges are inactive: one check each), then --steps steps recorded by a
// TraceSession (Backend::Auto: Kineto where this LibTorch has it, else FSDP's writer, operators
// included). Rank 0 prints the median step time of each, the cost of one inactive range (timed
// alone, 10^6 times) times the ranges a step runs (counted in the trace), and where the last
// recorded round's traces are (DIR/trace_rank<r>.json; scripts/trace_summary.py sums them by phase).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fsdp/debug/cpu_tuning.h"
#include "fsdp/debug/profiler.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Ranges named fsdp::... in one step of a trace: counted from the file, a plain substring count
// over the step's events (the trace holds only recorded steps).
size_t count_fsdp_ranges(const std::string& path) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t n = 0;
  for (size_t at = text.find("\"fsdp::"); at != std::string::npos; at = text.find("\"fsdp::", at + 1)) ++n;
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::string dir = "runs/profiler_bench";
  int rounds = 5, steps = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dir")
      dir = argv[i + 1];
    else if (a == "--rounds")
      rounds = std::atoi(argv[i + 1]);
    else if (a == "--steps")
      steps = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: profiler_bench [--dir DIR] [--rounds N] [--steps N] (under fsdprun)\n");
      return 2;
    }
  }
  if (rounds < 1 || steps < 1) {
    std::fprintf(stderr, "profiler_bench: --rounds and --steps must be at least 1\n");
    return 2;
  }
  try {
    fsdp::dist::init_distributed();
    const int rank = fsdp::dist::rank(), world = fsdp::dist::world_size();
    fsdp::models::GPTConfig c;
    c.vocab_size = 256;
    c.block_size = 128;
    c.n_layer = 4;
    c.n_head = 4;
    c.n_embd = 256;
    torch::manual_seed(0);
    fsdp::models::GPT model(c);
    for (auto& block : model->blocks) fsdp::fully_shard(block);
    fsdp::fully_shard(model);
    torch::optim::AdamW opt(model->parameters(), 1e-3);
    const int64_t per_rank = 8 / world > 0 ? 8 / world : 1;
    int step_no = 0;
    auto one_step = [&] {
      ++step_no;
      const fsdp::profiler::Range step_range("ProfilerStep#" + std::to_string(step_no));
      torch::manual_seed(1000 + step_no * world + rank);
      const at::Tensor batch = torch::randint(0, c.vocab_size, {per_rank, c.block_size + 1}, at::kLong);
      opt.zero_grad();
      auto loss =
          fsdp::models::gpt_loss(fsdp::call(model, batch.narrow(1, 0, c.block_size)), batch.narrow(1, 1, c.block_size));
      loss.backward();
      const fsdp::profiler::Range opt_range("fsdp::optimizer_step");
      opt.step();
    };
    auto world_comm = fsdp::dist::world_comm();
    for (int i = 0; i < 3; ++i) one_step();
    std::vector<double> off, on;
    std::string path;
    int first_recorded = 0;
    fsdp::profiler::Backend backend = fsdp::profiler::Backend::Auto;
    for (int r = 0; r < rounds; ++r) {
      world_comm->barrier();
      for (int i = 0; i < steps; ++i) {
        const auto t = std::chrono::steady_clock::now();
        one_step();
        off.push_back(seconds_since(t));
      }
      world_comm->barrier();
      fsdp::profiler::TraceSession trace(fsdp::profiler::rank_trace_path(dir, rank));
      first_recorded = step_no + 1;
      trace.start();
      for (int i = 0; i < steps; ++i) {
        const auto t = std::chrono::steady_clock::now();
        one_step();
        on.push_back(seconds_since(t));
      }
      trace.stop();
      path = trace.path();
      backend = trace.backend();
    }
    // One inactive range, alone.
    const int reps = 1000000;
    const auto t = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) {
      const fsdp::profiler::Range range("fsdp::copy_out", "h.0");
    }
    const double ns_per_range = seconds_since(t) / reps * 1e9;
    const size_t ranges_per_step = count_fsdp_ranges(path) / static_cast<size_t>(steps);
    if (rank == 0) {
      const double m_off = median(off), m_on = median(on);
      std::printf("profiler_bench: %d ranks, bench's GPT (4 x 256, seq 128, batch 8), %d rounds x %d steps\n", world,
                  rounds, steps);
      std::printf("  step, nothing recording (ranges inactive): median %.1f ms (min %.1f, max %.1f)\n", m_off * 1e3,
                  *std::min_element(off.begin(), off.end()) * 1e3, *std::max_element(off.begin(), off.end()) * 1e3);
      std::printf("  step, recording (%s):                   median %.1f ms (min %.1f, max %.1f), %.2fx\n",
                  fsdp::profiler::backend_name(backend), m_on * 1e3, *std::min_element(on.begin(), on.end()) * 1e3,
                  *std::max_element(on.begin(), on.end()) * 1e3, m_on / m_off);
      std::printf("  one inactive range: %.1f ns; %zu fsdp:: ranges per step -> %.2f us per step (%.4f%% of it)\n",
                  ns_per_range, ranges_per_step, ns_per_range * static_cast<double>(ranges_per_step) / 1e3,
                  ns_per_range * static_cast<double>(ranges_per_step) / (m_off * 1e9) * 100);
      std::printf("  traces of steps %d-%d: %s (one per rank)\n", first_recorded, first_recorded + steps - 1,
                  path.c_str());
    }
    world_comm->barrier();
    fsdp::dist::destroy_distributed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "profiler_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
