// The README's first program: a model sharded with fully_shard and trained on every rank.
//   build/bin/fsdprun --nproc-per-node 2 -- build/bin/quickstart
#include <fsdp/fsdp.h>

struct Net : torch::nn::Module {  // any module; its sharded children are entered through fsdp::call
  torch::nn::Linear hidden = register_module("hidden", torch::nn::Linear(16, 64));
  torch::nn::Linear out = register_module("out", torch::nn::Linear(64, 1));
  at::Tensor forward(at::Tensor x) { return fsdp::call(out, torch::tanh(fsdp::call(hidden, x))); }
};

int main() {
  fsdp::dist::init_distributed();  // torchrun's RANK, WORLD_SIZE, ... (none set: a world of one)
  torch::manual_seed(0);           // the same initial parameters on every rank
  auto model = std::make_shared<Net>();
  fsdp::fully_shard(model->hidden), fsdp::fully_shard(model->out), fsdp::fully_shard(model);  // children first
  torch::optim::AdamW opt(model->parameters(), 3e-3);  // after fully_shard: this rank's shards
  torch::manual_seed(1 + fsdp::dist::rank());          // each rank its own data
  for (int step = 1; step <= 200; ++step) {
    at::Tensor x = torch::randn({32, 16}), y = torch::tanh(x.sum(1, true) / 4);
    at::Tensor loss = torch::mse_loss(fsdp::call(model, x), y);  // all-gathers, then forward
    opt.zero_grad(), loss.backward(), opt.step();                // gradients reduce-scattered
    if (fsdp::dist::rank() == 0 && (step == 1 || step % 50 == 0))
      std::printf("step %d  loss %.4f\n", step, loss.item<float>());
  }
  fsdp::dist::destroy_distributed();
}
