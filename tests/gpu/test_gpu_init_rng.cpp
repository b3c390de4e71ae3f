// GPU tests of the random numbers outside the parameter groups (part of test_gpu; each skips with
// its reason without a GPU):
//   meta-device initialisation drawn on the GPU with the GPU's own generators: two ranks sharing
//   one GPU (Gloo) hold exactly the rows of the unsharded model initialised on that GPU, with
//   shards that cut through the drawing chunks (fsdp::init, src/sharding/materialize.cpp);
//   activation checkpointing replays dropout drawn on a checkpointed block's parameters' device
//   when its input lives on the CPU (the RNG state of the parameters' device is saved too).
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <string>

#include "fsdp/comm/backend.h"
#include "fsdp/fsdp.h"
#include "gpu_skip.h"
#include "models/gpt.h"
#include "multiprocess.h"

using fsdp::models::GPT;
using fsdp::models::GPTConfig;

namespace {

#define SKIP_WITHOUT_A_GPU()                                   \
  do {                                                         \
    const std::string why_ = fsdp_gpu_test::gpu_skip_reason(); \
    if (!why_.empty()) GTEST_SKIP() << why_;                   \
  } while (0)

torch::Device gpu() { return torch::Device(torch::kCUDA, 0); }

// Rows of 512 values: a drawing chunk holds 2048 of them (1M values), so the 4099-row embedding
// is three chunks, and at two ranks (rows 0-2049, 2050-4098) each rank's rows cross one boundary.
GPTConfig init_config() {
  GPTConfig c;
  c.vocab_size = 4099;
  c.block_size = 33;
  c.n_layer = 1;
  c.n_head = 8;
  c.n_embd = 512;
  c.init_seed = 4321;
  return c;
}

}  // namespace

FSDP_RANK_WORKER(gpu_meta_init_two_ranks) {
  fsdp::dist::InitOptions init;
  init.device_type = "cuda";
  init.backend = fsdp::comm::BackendKind::Gloo;  // two ranks on one GPU: NCCL refuses that
  fsdp::dist::init_distributed(init);
  auto c = init_config();
  GPTConfig whole_c = c;
  whole_c.device = gpu();
  GPT whole(whole_c);  // built on the GPU: reset_parameters draws there
  GPTConfig cpu_c = c;
  cpu_c.device = torch::kCPU;
  GPT on_cpu(cpu_c);
  auto want = whole->named_parameters();
  auto cpu_values = on_cpu->named_parameters();
  TORCH_CHECK(!want["wte.weight"].cpu().equal(cpu_values["wte.weight"]),
              "the GPU init drew the CPU's values: it did not use the GPU's generators");

  c.device = torch::kMeta;
  GPT model(c);
  for (auto& b : model->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(model);
  fsdp::to_empty(*model, gpu());
  model->reset_parameters();
  for (const auto& p : model->named_parameters()) {
    TORCH_CHECK(p.value().is_cuda(), p.key(), ": the materialised shard must be on the GPU");
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not a shard");
    at::Tensor full = want[p.key()].detach();
    if (full.dim() == 0) full = full.reshape({1});
    TORCH_CHECK(p.value().detach().equal(full.narrow(0, info->dim0_offset, info->local_rows)), p.key(),
                ": the shard differs from the unsharded model's rows on the same GPU");
  }
  fsdp::dist::destroy_distributed();
}

TEST(GpuInit, MetaInitAtTwoRanksOnOneGpuEqualsTheUnshardedInitThere) {
  SKIP_WITHOUT_A_GPU();
  fsdp::testing::RanksOptions o;
  o.init_runtime = false;  // the workers initialise a "cuda" runtime themselves
  o.timeout = std::chrono::milliseconds(60000);
  EXPECT_RANKS_PASS(2, "gpu_meta_init_two_ranks", o);
}

namespace {

// A block on the GPU whose input arrives on the CPU: its dropout draws from the GPU's generator,
// a device none of its inputs is on.
struct GpuDropBlockImpl : torch::nn::Module {
  GpuDropBlockImpl() { fc = register_module("fc", torch::nn::Linear(64, 64)); }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::dropout(fc(x.to(fc->weight.device())), 0.5, /*train=*/true);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(GpuDropBlock);

}  // namespace

TEST(GpuActivation, CheckpointedBlockReplaysDropoutOnItsParametersDevice) {
  SKIP_WITHOUT_A_GPU();
  GpuDropBlock block;
  block->to(gpu());
  const auto x = torch::randn({16, 64}, at::kFloat);  // on the CPU, no gradient
  const auto w = torch::randn({16, 64}, at::TensorOptions().device(gpu()));
  auto run = [&](bool checkpointed) {
    for (auto& p : block->parameters()) p.mutable_grad().reset();
    torch::manual_seed(7);  // the CPU's and every GPU's generator
    at::Tensor y;
    if (checkpointed) {
      auto wrapped = fsdp::activation::checkpoint_wrapper(block);
      y = wrapped(x);
    } else {
      y = block->forward(x);
    }
    (y * w).sum().backward();
    fsdp::activation::remove_activation_checkpointing(*block);
    at::Tensor next = torch::rand({8}, at::TensorOptions().device(gpu()));  // the generator afterwards
    return std::make_pair(block->fc->weight.grad().clone(), next);
  };
  const auto [want_grad, want_next] = run(false);
  const auto [got_grad, got_next] = run(true);
  EXPECT_TRUE(got_grad.equal(want_grad))
      << "the recompute drew another dropout mask on the block's GPU: largest gradient difference "
      << (got_grad - want_grad).abs().max().item<double>();
  EXPECT_TRUE(got_next.equal(want_next)) << "the GPU's generator does not continue as if nothing was recomputed";
}
