// Checkpoint cost for the benchmark model (bench's default GPT: 4 layers, d=256, vocab 256, with
// AdamW state): sharded save, async save (time until training may continue, and until committed),
// load at the same world size, and the bytes each rank writes. Run under the launcher:
//
//   build/bin/fsdprun --nproc-per-node 2 -- build/bin/checkpoint_bench [--dir DIR] [--rounds N]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::string dir = (std::filesystem::temp_directory_path() / "fsdp_checkpoint_bench").string();
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--dir")
      dir = argv[i + 1];
    else if (a == "--rounds")
      rounds = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: checkpoint_bench [--dir DIR] [--rounds N]\n");
      return 2;
    }
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
    // One step so that the optimizer holds its state (2 more tensors per parameter).
    auto tokens = at::randint(256, {2, c.block_size + 1}, at::kLong);
    fsdp::models::gpt_loss(fsdp::call(model, tokens.narrow(1, 0, c.block_size)), tokens.narrow(1, 1, c.block_size))
        .backward();
    opt.step();
    fsdp::checkpoint::State state{model.ptr(), &opt, {}};

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
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", e.what());
    return 1;
  }
}
