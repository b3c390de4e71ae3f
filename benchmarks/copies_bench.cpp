// copies_bench: FSDP's own work in a world of one (copies, allocations, hooks; no network), counted
// in instructions with callgrind, which repeats to the instruction where a timing on a shared
// machine does not.
//
//   valgrind --tool=callgrind --instr-atstart=no build/bin/copies_bench --mode plain
//   valgrind --tool=callgrind --instr-atstart=no build/bin/copies_bench --mode fsdp
//   [--steps 2] [--warmup 2] [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 4]
//
// Both modes train the same GPT (bench's: 4 layers, d=256, 4 heads, seq 128, batch 4, float32,
// AdamW, one thread) from the same initial values on the same tokens; `plain` is LibTorch alone,
// `fsdp` the model with fully_shard per block and on the root in a world of one. Instrumentation
// covers only the --steps steps after the --warmup ones (CALLGRIND_START/STOP_INSTRUMENTATION);
// compare the "Collected" (Ir) totals of the two runs. Without valgrind it prints the step time.
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else  // valgrind's headers absent (package valgrind): the whole run is counted (--instr-atstart=yes)
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#endif

#include <chrono>
#include <cstdio>
#include <map>
#include <string>

#include "fsdp/fsdp.h"
#include "models/gpt.h"

namespace {

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "copies_bench: %s\nusage: copies_bench --mode plain|fsdp [--steps N] [--warmup N] [--layers N] "
               "[--dim N] [--heads N] [--seq N] [--batch N]\n",
               why.c_str());
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::string mode;
  int64_t steps = 2, warmup = 2, layers = 4, dim = 256, heads = 4, seq = 128, batch = 4;
  std::map<std::string, int64_t*> ints = {{"--steps", &steps}, {"--warmup", &warmup}, {"--layers", &layers},
                                          {"--dim", &dim},     {"--heads", &heads},   {"--seq", &seq},
                                          {"--batch", &batch}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) usage("missing value for " + a);
    std::string v = argv[++i];
    if (a == "--mode")
      mode = v;
    else if (ints.count(a))
      *ints[a] = std::stoll(v);
    else
      usage("unknown option " + a);
  }
  if (mode != "plain" && mode != "fsdp") usage("--mode must be plain or fsdp");
  at::set_num_threads(1);
  fsdp::models::GPTConfig c;
  c.vocab_size = 256;
  c.block_size = seq;
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = dim;
  torch::manual_seed(0);
  fsdp::models::GPT model(c);
  if (mode == "fsdp") {
    for (auto& b : model->blocks) fsdp::fully_shard(b);
    fsdp::fully_shard(model);
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::detail::createCPUGenerator(1234);
  double loss_value = 0, seconds = 0;
  for (int64_t s = 0; s < warmup + steps; ++s) {
    auto data = at::randint(c.vocab_size, {batch, c.block_size + 1}, gen, at::kLong);
    if (s == warmup) CALLGRIND_START_INSTRUMENTATION;
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    auto input = data.narrow(1, 0, c.block_size);
    auto logits = mode == "fsdp" ? fsdp::call(model, input) : model->forward(input);
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
    loss_value = loss.item<double>();
    if (s >= warmup) seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  CALLGRIND_STOP_INSTRUMENTATION;
  std::printf("copies_bench %s: loss %.6f after %lld steps, %.1f ms per measured step\n", mode.c_str(), loss_value,
              static_cast<long long>(warmup + steps), 1e3 * seconds / static_cast<double>(steps));
  return 0;
}
