// The main job until train_gpt lands: a GPT trained with fully_shard on the ranks fsdprun starts.
//
//   fsdprun --nproc-per-node 2 -- build/bin/gpt_demo [--steps 40]
//
// The data is a learnable synthetic language (each token follows from the previous two), drawn
// from a seed, so the loss visibly falls and every world size sees the same global batch: rank r
// trains on its contiguous slice of each step's batch.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace {

// Sequences where x[t] = (x[t-1] * 7 + x[t-2] * 3 + 1) mod vocab after two random tokens.
at::Tensor make_batch(int64_t batch, int64_t len, int64_t vocab, int step) {
  auto gen = at::detail::createCPUGenerator(10'000 + step);
  at::Tensor x = at::empty({batch, len}, at::kLong);
  x.narrow(1, 0, 2).copy_(at::randint(vocab, {batch, 2}, gen, at::kLong));
  for (int64_t t = 2; t < len; ++t) x.select(1, t).copy_((x.select(1, t - 1) * 7 + x.select(1, t - 2) * 3 + 1) % vocab);
  return x;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  fsdp::raise_malloc_thresholds();  // glibc's thresholds where a Python process has them (malloc_tuning.h)
  int steps = 40;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--steps N]\n", argv[0]);
      return 2;
    }
  }
  try {
    fsdp::dist::init_distributed();
    const int rank = fsdp::dist::rank(), world = fsdp::dist::world_size();
    fsdp::models::GPTConfig config;
    config.vocab_size = 64;
    config.block_size = 32;
    config.n_layer = 4;
    config.n_head = 4;
    config.n_embd = 128;
    const int64_t global_batch = 16;
    if (global_batch % world != 0) throw std::invalid_argument("the world size must divide the global batch 16");

    torch::manual_seed(0);
    fsdp::models::GPT model(config);
    int64_t n_params = 0;
    for (const auto& p : model->parameters()) n_params += p.numel();
    for (auto& block : model->blocks) fsdp::fully_shard(block);  // blocks first,
    fsdp::fully_shard(model);                                    // then the root
    int64_t local_params = 0;
    for (const auto& p : model->parameters()) local_params += p.numel();
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.01));
    fsdp::check_optimizer_params(opt);
    if (rank == 0) {
      std::printf("GPT %lld parameters, %d ranks; this rank holds %lld (%.0f%%)\n", static_cast<long long>(n_params),
                  world, static_cast<long long>(local_params), 100.0 * local_params / n_params);
    }

    auto world_comm = fsdp::dist::world_comm();
    const int64_t local = global_batch / world;
    double first_loss = 0, last_loss = 0;
    auto t_start = std::chrono::steady_clock::now();
    auto stats0 = fsdp::comm::process_comm_stats().snapshot();
    for (int step = 0; step < steps; ++step) {
      auto data =
          make_batch(global_batch, config.block_size + 1, config.vocab_size, step).narrow(0, rank * local, local);
      opt.zero_grad();
      auto logits = fsdp::call(model, data.narrow(1, 0, config.block_size));
      auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, config.block_size));
      loss.backward();
      opt.step();
      auto global_loss = loss.detach().reshape({1});
      world_comm->all_reduce(global_loss, fsdp::comm::ReduceOp::Avg);
      last_loss = global_loss.item<double>();
      if (step == 0) first_loss = last_loss;
      if (rank == 0 && (step % 5 == 0 || step == steps - 1)) {
        std::printf("step %3d/%d  loss %.4f\n", step + 1, steps, last_loss);
        std::fflush(stdout);
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
    auto sent = fsdp::comm::process_comm_stats().snapshot() - stats0;
    std::printf("rank %d: %.2f s/step, sent %.2f MB/step (%s)\n", rank, seconds / steps,
                sent.total_bytes() / 1e6 / steps, sent.to_string().c_str());
    const bool learned = last_loss < first_loss * 0.8;
    if (rank == 0) {
      std::printf("%s: loss %.4f -> %.4f over %d steps\n", learned ? "OK" : "NOT LEARNING", first_loss, last_loss,
                  steps);
    }
    world_comm->barrier();
    fsdp::dist::destroy_distributed();
    return learned ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt_demo: %s\n", e.what());
    return 1;
  }
}
