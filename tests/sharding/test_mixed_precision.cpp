// Mixed precision: bf16 parameters and all-gathers, fp32 gradient reduction and master weights,
// against a single process that applies the same casts by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>

#include "cpu_layout.h"
#include "fsdp/compat/fused_copies.h"
#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "op_counts.h"
#include "parity.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 8;
constexpr int64_t kBatch = 6;

fsdp::FullyShardOptions bf16_options() {
  fsdp::FullyShardOptions o;
  o.mp_policy.param_dtype = at::kBFloat16;
  o.mp_policy.reduce_dtype = at::kFloat;
  return o;
}

// One process: fp32 master weights stepped by AdamW; each step copies them into a bf16 model,
// runs forward/backward there, and hands the bf16 gradients back as fp32.
std::vector<double> reference_losses(const fsdp::models::GPTConfig& c,
                                     std::map<std::string, at::Tensor>& final_params) {
  torch::manual_seed(42);
  GPT master(c);
  torch::manual_seed(42);
  GPT compute(c);
  compute->to(at::kBFloat16);
  torch::optim::AdamW opt(master->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).eps(1e-3));
  auto masters = master->parameters();
  auto computes = compute->parameters();
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < masters.size(); ++i) computes[i].copy_(masters[i]);
    }
    for (auto& p : computes) p.mutable_grad().reset();
    auto data = global_batch(c, kBatch, s, 0);
    // The loss in fp32 from the bf16 logits (in both runs): a bf16 loss value is itself rounded.
    auto loss = fsdp::models::gpt_loss(compute->forward(data.narrow(1, 0, c.block_size)).to(at::kFloat),
                                       data.narrow(1, 1, c.block_size));
    loss.backward();
    for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = computes[i].grad().to(at::kFloat);
    opt.step();
    losses.push_back(loss.item<double>());
  }
  for (const auto& p : master->named_parameters()) final_params[p.key()] = p.value().detach().clone();
  return losses;
}

}  // namespace

FSDP_RANK_WORKER(bf16_params_fp32_reduce) {
  const auto c = uneven_config();
  std::map<std::string, at::Tensor> want_params;
  auto want = reference_losses(c, want_params);

  torch::manual_seed(42);
  GPT model(c);
  auto options = bf16_options();
  if (const char* mesh = std::getenv("HSDP_MESH")) {
    // HSDP "RxS": the fp32 reduce-scatter, then the fp32 all-reduce over the replicas.
    const std::string m = mesh;
    options.mesh = fsdp::init_device_mesh({std::stoll(m.substr(0, m.find('x'))), std::stoll(m.substr(m.find('x') + 1))},
                                          {"replicate", "shard"});
  }
  if (std::getenv("SHARD_LAST_DIM")) {
    // shard_placement_fn: the bf16 unsharded matrices over memory laid out last dim first.
    options.shard_placement_fn = last_dim_of_matrices;
  }
  for (auto& b : model->blocks) fsdp::fully_shard(b, options);
  fsdp::fully_shard(model, options);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).eps(1e-3));
  auto world = fsdp::dist::world_comm();
  const int64_t local = kBatch / world->size();
  std::vector<double> got;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto data = global_batch(c, kBatch, s, 0).narrow(0, world->rank() * local, local);
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "forward must compute in bf16, got ", logits.scalar_type());
    auto loss = fsdp::models::gpt_loss(logits.to(at::kFloat), data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
    auto l = at::tensor({loss.item<double>()}, at::kDouble);
    world->all_reduce(l, fsdp::comm::ReduceOp::Avg);
    got.push_back(l.item<double>());
  }
  // The master weights and their gradients stay float32.
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.scalar_type() == at::kFloat && p.grad().scalar_type() == at::kFloat, "master copy must stay fp32");
  }
  // bf16 has 8 bits of mantissa: the two runs round differently, so compare at bf16 precision.
  check_losses_match(got, want, 2e-3);
  const double worst = check_shards_match(model, want_params, 5e-3);
  if (world->rank() == 0) {
    std::cout << "bf16/fp32: last loss " << got.back() << " vs reference " << want.back() << ", worst shard difference "
              << worst << std::endl;
  }
}

// [Note: one copy kernel per unit] under bf16 mixed precision on the CPU: each all-gather's copy-in
// (the fp32 shards cast into the bf16 input) is one copy_ of the unit's shard buffer and nothing
// else ([Note: the shards in one buffer]; on every LibTorch), and its copy-out one
// split_with_sizes_copy, whatever the unit's number of parameters. The reduce-scatter input stays a copy per parameter
// on the CPU by design (each gradient freed as soon as it is copied); test_gpu checks its one _chunk_cat on CUDA.
FSDP_RANK_WORKER(bf16_copies_one_op_per_unit) {
  const auto c = uneven_config();
  torch::manual_seed(42);
  GPT model(c);
  for (auto& b : model->blocks) fsdp::fully_shard(b, bf16_options());
  fsdp::fully_shard(model, bf16_options());
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-3));
  auto world = fsdp::dist::world_comm();
  const int64_t local = kBatch / world->size();
  auto step = [&](int s) {
    opt.zero_grad();
    auto data = global_batch(c, kBatch, s, 0).narrow(0, world->rank() * local, local);
    fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)).to(at::kFloat),
                           data.narrow(1, 1, c.block_size))
        .backward();
    opt.step();
  };
  step(0);
  fsdp::testing::RangeOpCounter counter;
  step(1);
  check_one_copy_op_per_unit(counter, c.n_layer + 1, /*copy_in_from_buffer=*/true,
                             /*fused_reduce_input=*/false);  // per parameter on the CPU, by design
  if (world->rank() == 0) {
    std::cout << "the operators FSDP's ranges issued themselves in one step:\n" << counter.describe_all() << std::flush;
  }
}

// float16 works the same way. LibTorch 1.13 has no CPU float16 LayerNorm or matmul, so this model
// uses elementwise ops only: y = sum((x * w1) * w2), with rows the world size does not divide.
struct ElementwiseImpl : torch::nn::Module {
  ElementwiseImpl() {
    w1 = register_parameter("w1", torch::randn({7, 5}));
    w2 = register_parameter("w2", torch::randn({7, 5}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return (x * w1 * w2).sum({1, 2}); }
  torch::Tensor w1, w2;
};
TORCH_MODULE(Elementwise);

FSDP_RANK_WORKER(fp16_params_fp32_reduce) {
  const int n = fsdp::dist::world_size(), rank = fsdp::dist::rank();
  auto batch_of = [](int step) {
    auto gen = at::detail::createCPUGenerator(77 + step);
    return at::randn({4, 7, 5}, gen);
  };
  // Reference: fp32 masters, fp16 compute copies, fp32 gradients.
  torch::manual_seed(5);
  Elementwise master;
  torch::manual_seed(5);
  Elementwise compute;
  compute->to(at::kHalf);
  torch::optim::SGD ref_opt(master->parameters(), torch::optim::SGDOptions(0.01));
  for (int s = 0; s < 5; ++s) {
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < 2; ++i) compute->parameters()[i].copy_(master->parameters()[i]);
    }
    for (auto& p : compute->parameters()) p.mutable_grad().reset();
    compute->forward(batch_of(s).to(at::kHalf)).pow(2).mean().backward();
    for (size_t i = 0; i < 2; ++i)
      master->parameters()[i].mutable_grad() = compute->parameters()[i].grad().to(at::kFloat);
    ref_opt.step();
  }
  torch::manual_seed(5);
  Elementwise model;
  fsdp::FullyShardOptions o;
  o.mp_policy.param_dtype = at::kHalf;
  o.mp_policy.reduce_dtype = at::kFloat;
  fsdp::fully_shard(model, o);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  for (int s = 0; s < 5; ++s) {
    opt.zero_grad();
    auto x = batch_of(s).narrow(0, rank * (4 / n), 4 / n);
    auto y = fsdp::call(model, x);  // cast_forward_inputs: x becomes fp16
    TORCH_CHECK(y.scalar_type() == at::kHalf, "forward must compute in fp16");
    y.pow(2).mean().backward();
    opt.step();
  }
  auto want = master->named_parameters();
  for (const auto& p : model->named_parameters()) {
    auto info = fsdp::shard_info(p.value());
    at::Tensor expect = want[p.key()].narrow(0, info->dim0_offset, info->local_rows);
    const double diff = ((p.value() - expect).abs() / expect.abs().clamp_min(1.0)).max().item<double>();
    TORCH_CHECK(diff <= 2e-3, p.key(), " differs from the fp16 reference by ", diff);
  }
  if (rank == 0) std::cout << "fp16/fp32 SGD matches the hand-cast reference" << std::endl;
}

// With bf16 parameters the all-gathers move half the bytes; gradients reduce in fp32 either way.
// Both runs flat (casting mixed precision always is): per parameter, fp32 would send no padding.
FSDP_RANK_WORKER(bf16_halves_all_gather) {
  const fsdp::testing::FlatCpuCollectives flat;
  const auto c = uneven_config();
  auto bytes_of_one_step = [&](const fsdp::FullyShardOptions& o) {
    torch::manual_seed(42);
    GPT model(c);
    for (auto& b : model->blocks) fsdp::fully_shard(b, o);
    fsdp::fully_shard(model, o);
    auto before = fsdp::comm::process_comm_stats().snapshot();
    auto data = global_batch(c, kBatch, 0, 0).narrow(0, 0, 2);
    fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size))
        .backward();
    return fsdp::comm::process_comm_stats().snapshot() - before;
  };
  auto fp32 = bytes_of_one_step({});
  auto bf16 = bytes_of_one_step(bf16_options());
  using fsdp::comm::OpKind;
  TORCH_CHECK(bf16[OpKind::AllGather].bytes_sent * 2 == fp32[OpKind::AllGather].bytes_sent, "all-gather bytes: bf16 ",
              bf16[OpKind::AllGather].bytes_sent, " vs fp32 ", fp32[OpKind::AllGather].bytes_sent);
  TORCH_CHECK(bf16[OpKind::ReduceScatter].bytes_sent == fp32[OpKind::ReduceScatter].bytes_sent,
              "reduce_dtype fp32: reduce-scatter bytes must not change");
  if (fsdp::dist::rank() == 0) {
    std::cout << "all-gather bytes per step: fp32 " << fp32[OpKind::AllGather].bytes_sent << ", bf16 "
              << bf16[OpKind::AllGather].bytes_sent << std::endl;
  }
}

TEST(MixedPrecision, Bf16ParamsFp32ReduceMatchesReference) {
  auto r = run_ranks(2, "bf16_params_fp32_reduce");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

TEST(MixedPrecision, Bf16ParamsFp32ReduceUnderHsdpMatchesReference) {
  fsdp::testing::RanksOptions o;
  o.env["HSDP_MESH"] = "2x1";
  auto r = run_ranks(2, "bf16_params_fp32_reduce", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

TEST(MixedPrecision, Bf16ParamsFp32ReduceShardedAlongLastDimMatchesReference) {
  fsdp::testing::RanksOptions o;
  o.env["SHARD_LAST_DIM"] = "1";
  auto r = run_ranks(3, "bf16_params_fp32_reduce", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

TEST(MixedPrecision, Fp16ParamsFp32ReduceMatchesReference) {
  auto r = run_ranks(2, "fp16_params_fp32_reduce");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

TEST(MixedPrecision, Bf16CopiesAreOneOpPerUnit) {
  auto r = run_ranks(2, "bf16_copies_one_op_per_unit");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

TEST(MixedPrecision, Bf16HalvesAllGatherBytes) {
  auto r = run_ranks(2, "bf16_halves_all_gather");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}
