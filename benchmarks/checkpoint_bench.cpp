// Checkpoint cost for the benchmark model (bench's default GPT: 4 layers, d=256, vocab 256, with
// AdamW state): sharded save, async save (time until training may continue, and until committed),
// load at the same world size, and the bytes each rank writes. Run under the launcher:
//
//   build/bin/fsdprun --nproc-per-node 2 -- build/bin/checkpoint_bench [--dir DIR] [--rounds N]
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_support.h"

using fsdp_bench::median;
using fsdp_bench::seconds_since;

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::string dir = (std::filesystem::temp_directory_path() / "fsdp_checkpoint_bench").string();
  int rounds = 3;
  fsdp_bench::Args args("checkpoint_bench", "usage: checkpoint_bench [--dir DIR] [--rounds N] (under fsdprun)");
  args.option("--dir", &dir).option("--rounds", &rounds);
  args.parse(argc, argv);
  if (rounds < 1) args.fail("--rounds must be at least 1");
  return fsdp_bench::report_errors([&] {
    const auto place = fsdp_bench::join_world(true);
    const int rank = place.rank, world = place.world;
    fsdp_bench::GptTraining t(fsdp_bench::GptShape{}, place);  // bench's GPT
    auto& model = t.model;
    // One step so that the optimizer holds its state (2 more tensors per parameter).
    t.step(at::randint(fsdp_bench::kVocab, {2, t.seq + 1}, at::kLong));
    fsdp::checkpoint::State state{model.ptr(), &t.opt, {}};

    std::vector<double> save_s, async_return_s, async_total_s, load_s;
    for (int r = 0; r < rounds; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      fsdp::checkpoint::save(dir, state);
      save_s.push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      auto pending = fsdp::checkpoint::async_save(dir, state);
      async_return_s.push_back(seconds_since(t0));
      pending.wait();
      async_total_s.push_back(seconds_since(t0));
      t0 = std::chrono::steady_clock::now();
      fsdp::checkpoint::load(dir, state);
      load_s.push_back(seconds_since(t0));
    }
    uint64_t my_bytes = 0, total_bytes = 0;
    char mine[64];
    std::snprintf(mine, sizeof(mine), "rank%05d.safetensors", rank);
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      const auto name = e.path().filename().string();
      if (name.rfind("data-", 0) != 0) continue;
      total_bytes += e.file_size();
      if (name.size() >= std::strlen(mine) &&
          name.compare(name.size() - std::strlen(mine), std::string::npos, mine) == 0)
        my_bytes = e.file_size();
    }
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    fsdp::dist::world_comm()->barrier();
    std::printf("rank %d: wrote %.2f MB (%lld parameters held)\n", rank, my_bytes / 1e6,
                static_cast<long long>(params));
    std::fflush(stdout);
    fsdp::dist::world_comm()->barrier();
    if (rank == 0) {
      std::printf("checkpoint of %.2f MB total (params + AdamW state, fp32) at %d ranks, median of %d rounds:\n",
                  total_bytes / 1e6, world, rounds);
      std::printf(
          "  save        %.3f s\n  async save  %.3f s until training may continue, %.3f s until committed\n"
          "  load        %.3f s\n",
          median(save_s), median(async_return_s), median(async_total_s), median(load_s));
    }
    return 0;
  });
}
