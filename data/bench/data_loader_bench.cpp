// data_loader_bench: what train_gpt's data loading costs per step on token shards: the global
// batch of each step read as train_gpt reads it (WindowSampler's permutation, then read_windows
// from the shards (pread) into int64 rows), timed alone. Divide by a step's time
// (train_gpt's ms/step at the same --batch-size and --seq-len) for the loader's share.
//
//   build/bin/data_loader_bench --data 'data/web_train_*.bin' --batch-size 16 --seq-len 1024 --steps 200
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fsdp/data/token_shards.h"

int main(int argc, char** argv) {
  std::string pattern;
  int64_t batch = 16, seq_len = 1024, steps = 200;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--data") {
      pattern = argv[i + 1];
    } else if (k == "--batch-size") {
      batch = std::atoll(argv[i + 1]);
    } else if (k == "--seq-len") {
      seq_len = std::atoll(argv[i + 1]);
    } else if (k == "--steps") {
      steps = std::atoll(argv[i + 1]);
    } else {
      std::fprintf(stderr, "data_loader_bench: error: unknown option %s (see the header comment)\n", k.c_str());
      return 2;
    }
  }
  if (pattern.empty() || batch < 1 || seq_len < 1 || steps < 1) {
    std::fprintf(stderr,
                 "data_loader_bench: error: give --data PATTERN (and positive --batch-size, --seq-len, --steps)\n");
    return 2;
  }
  try {
    fsdp::data::TokenShards shards(fsdp::data::expand_glob(pattern));
    const fsdp::data::WindowSampler order(shards.size(), seq_len, batch, 0);
    std::vector<int64_t> rows(static_cast<size_t>(batch * (seq_len + 1)));
    int64_t checksum = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t s = 0; s < steps; ++s) {
      shards.read_windows(order.batch_windows(s), seq_len, rows.data());
      checksum += rows[static_cast<size_t>(s) % rows.size()];
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf(
        "data_loader_bench: %s; batch %lld x %lld tokens, %lld steps: %.1f us per global batch "
        "(%.0f M tokens/s; checksum %lld)\n",
        shards.describe().c_str(), static_cast<long long>(batch), static_cast<long long>(seq_len + 1),
        static_cast<long long>(steps), secs / static_cast<double>(steps) * 1e6,
        static_cast<double>(steps * batch * (seq_len + 1)) / secs / 1e6, static_cast<long long>(checksum));
  } catch (const fsdp::data::DataError& e) {
    std::fprintf(stderr, "data_loader_bench: error: %s\n", e.what());
    return 2;
  }
  return 0;
}
