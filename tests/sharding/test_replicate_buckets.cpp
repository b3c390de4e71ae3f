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
