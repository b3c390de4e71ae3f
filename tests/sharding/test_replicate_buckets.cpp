// fsdp::replicate keeps gradients in its buckets (DDP's gradient_as_bucket_view): after a synced
// backward every .grad lives in its bucket's flat buffer, the same memory step after step, so the
// all-reduce averages them in place with no copy-out and no buffer allocated per step; and the
// optimizer's zero_grad() (detach_ + zero_ on 1.13, set to none on 2.x) still works on them.
#include <gtest/gtest.h>

#include <iostream>

#include "fsdp/fsdp.h"
#include "multiprocess.h"

using namespace fsdp::testing;

namespace {
struct TwoLayersImpl : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr};
  TwoLayersImpl() {
    l1 = register_module("l1", torch::nn::Linear(32, 16));
    l2 = register_module("l2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return l2(l1(x).relu()); }
};
TORCH_MODULE(TwoLayers);
}  // namespace

FSDP_RANK_WORKER(replicate_grads_in_buckets) {
  torch::manual_seed(0);
  TwoLayers model;
  auto ddp = fsdp::replicate(model);  // default caps: one bucket for this small model
  TORCH_CHECK(ddp.num_buckets() == 1, "one bucket expected, got ", ddp.num_buckets());
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  std::vector<const void*> first_ptrs;
  const int rank = fsdp::dist::rank(), world = fsdp::dist::world_size();
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    torch::manual_seed(100 + step * world + rank);  // each rank its own data
    auto x = torch::randn({4, 32});
    model->forward(x).sum().backward();
    auto params = model->parameters();
    std::vector<const void*> ptrs;
    for (const auto& p : params) {
      TORCH_CHECK(p.grad().defined(), "no gradient after backward");
      TORCH_CHECK(p.grad().is_alias_of(params[0].grad()), "the gradients do not share the bucket's memory");
      ptrs.push_back(p.grad().data_ptr());
    }
    if (step == 0) first_ptrs = ptrs;
    // Step 0 may have copied fresh gradients in (2.x zero_grad sets them to none every step);
    // whatever the path, the bucket is the same memory every step.
    TORCH_CHECK(ptrs == first_ptrs, "step ", step, ": the gradients moved to other memory (a bucket per step?)");
    // Averaged over the ranks: every rank holds the same gradient.
    for (const auto& p : params) {
      auto g = p.grad().clone();
      fsdp::dist::world_comm()->broadcast(g, 0);
      TORCH_CHECK(g.equal(p.grad()), "rank ", rank, " holds a gradient that differs from rank 0's");
    }
    opt.step();
  }
  if (rank == 0)
    std::cout << "3 steps: gradients in one bucket, same memory each step, equal on all ranks" << std::endl;
}

TEST(Replicate, GradientsLiveInTheBuckets) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  EXPECT_RANKS_PASS(2, "replicate_grads_in_buckets", o);
}

// Each gradient goes into its bucket as soon as backward has produced it (DDP's
// mark_variable_ready), not when the whole bucket is ready: with one bucket for the whole model,
// the second layer's gradients already live in it while the first layer's backward has yet to
// run, though the bucket's all-reduce waits for that layer. A fresh gradient (the first step, or
// set to none by zero_grad) is thus freed while backward still allocates.
FSDP_RANK_WORKER(replicate_fills_bucket_early) {
  torch::manual_seed(0);
  TwoLayers model;
  auto ddp = fsdp::replicate(model);
  TORCH_CHECK(ddp.num_buckets() == 1, "one bucket expected, got ", ddp.num_buckets());
  const int rank = fsdp::dist::rank(), world = fsdp::dist::world_size();
  torch::manual_seed(7 + rank);
  auto x = torch::randn({4, 32});
  auto h = model->l1(x).relu();
  bool in_bucket = false;
  h.register_hook([&](const at::Tensor&) {  // runs after l2's backward, before l1's
    const auto& w = model->l2->weight.grad();
    const auto& b = model->l2->bias.grad();
    in_bucket = w.defined() && b.defined() && w.is_alias_of(b) && !model->l1->weight.grad().defined();
  });
  model->l2(h).sum().backward();
  TORCH_CHECK(in_bucket, "l2's gradients were not in the bucket before l1's backward");
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.grad().is_alias_of(model->l2->weight.grad()), "a gradient is not in the bucket after backward");
  }
  // The bucket holds the average: divided on the way in (Gloo has no AVG), summed by the all-reduce.
  auto g = model->l1->weight.grad().clone();
  fsdp::dist::world_comm()->broadcast(g, 0);
  TORCH_CHECK(g.equal(model->l1->weight.grad()), "rank ", rank, " holds a gradient that differs from rank 0's");
  torch::manual_seed(0);
  TwoLayers alone;
  at::Tensor sum;
  for (int r = 0; r < world; ++r) {
    torch::manual_seed(7 + r);
    alone->zero_grad();
    alone->forward(torch::randn({4, 32})).sum().backward();
    sum = r == 0 ? alone->l1->weight.grad().clone() : sum + alone->l1->weight.grad();
  }
  TORCH_CHECK(model->l1->weight.grad().allclose(sum / world, 1e-6, 1e-7), "the bucket does not hold the average");
  if (rank == 0) std::cout << "l2's gradients were in the bucket before l1's backward; the average after" << std::endl;
}

TEST(Replicate, GradientsGoIntoTheBucketWhenReady) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  EXPECT_RANKS_PASS(2, "replicate_fills_bucket_early", o);
}
