// fsdp::replicate (DDP): N ranks against one process on the same global batch, float32 AdamW for
// 10 steps, with one bucket and with many; plus no-sync accumulation, overlap of the bucket
// all-reduces with backward, and what checkpoints see (full parameters, no shard_info).
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kBatch = 8;
constexpr double kTolerance = 1e-6;

}  // namespace

// PARITY_MODE: replicate | no_sync; BUCKET: bucket_cap_bytes.
FSDP_RANK_WORKER(replicate_parity) {
  const auto config = uneven_config();
  const std::string m = env("PARITY_MODE", "replicate");
  const int64_t bucket = std::stoll(env("BUCKET", "26214400"));
  ShardedRun run;
  size_t buckets = 0;
  run.shard = [bucket, &buckets](GPT& model) {
    auto ddp = fsdp::replicate(model, fsdp::ReplicateOptions{std::nullopt, bucket});
    buckets = ddp.num_buckets();
  };
  int micro_batches = 1;
  if (m == "no_sync") {
    micro_batches = 3;
    run.before_micro_batch = [](int micro, int total, GPT& model) {
      fsdp::replicate_module(*model)->set_requires_gradient_sync(micro == total - 1);
    };
  } else {
    TORCH_CHECK(m == "replicate", "unknown PARITY_MODE ", m);
  }
  auto want = train_reference(config, kSteps, kBatch, micro_batches);
  const auto before = fsdp::dist::world_comm()->stats().snapshot();
  auto got = train_sharded(config, kSteps, kBatch, micro_batches, run);
  const auto ops = fsdp::dist::world_comm()->stats().snapshot() - before;
  check_losses_match(got.losses, want.losses, kTolerance);
  const double worst = check_full_params_match(got.model, want.parameters, kTolerance);
  for (const auto& p : got.model->parameters()) {
    TORCH_CHECK(!fsdp::shard_info(p).has_value(), "replicated parameters are not shards");
  }
  // One all-reduce per bucket per synced backward (plus train_sharded's loss all-reduce per step).
  const uint64_t want_calls = static_cast<uint64_t>(kSteps) * (buckets + 1);
  TORCH_CHECK(ops[fsdp::comm::OpKind::AllReduce].calls == want_calls, "expected ", want_calls, " all-reduces, got ",
              ops[fsdp::comm::OpKind::AllReduce].calls);
  if (fsdp::dist::rank() == 0) {
    std::cout << m << " (" << buckets << " buckets): " << kSteps << " steps, last loss " << got.losses.back()
              << " (single process " << want.losses.back() << "), worst parameter difference " << worst << " relative; "
              << ops.to_string() << std::endl;
  }
}

struct ReplicateCase {
  std::string mode;
  int world;
  int64_t bucket;
};

class ReplicateParity : public ::testing::TestWithParam<ReplicateCase> {};

TEST_P(ReplicateParity, MatchesSingleProcess) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(600000);
  o.env["PARITY_MODE"] = GetParam().mode;
  o.env["BUCKET"] = std::to_string(GetParam().bucket);
  auto r = run_ranks(GetParam().world, "replicate_parity", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

INSTANTIATE_TEST_SUITE_P(Replicate, ReplicateParity,
                         ::testing::Values(ReplicateCase{"replicate", 2, 25 << 20}, ReplicateCase{"replicate", 4, 4096},
                                           ReplicateCase{"no_sync", 2, 4096}, ReplicateCase{"no_sync", 4, 25 << 20}),
                         [](const auto& info) {
                           return info.param.mode + "_bucket" + std::to_string(info.param.bucket) + "_" +
                                  std::to_string(info.param.world) + "ranks";
                         });

namespace {
struct ThreeLayersImpl : torch::nn::Module {
  torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
  ThreeLayersImpl() {
    l1 = register_module("l1", torch::nn::Linear(64, 64));
    l2 = register_module("l2", torch::nn::Linear(64, 64));
    l3 = register_module("l3", torch::nn::Linear(64, 1));
  }
};
TORCH_MODULE(ThreeLayers);
}  // namespace

// The last layer's bucket is all-reduced while the first layer's backward has yet to run, and rank
// 0's initial values reach every rank.
FSDP_RANK_WORKER(replicate_overlaps) {
  torch::manual_seed(fsdp::dist::rank());  // different on purpose: replicate broadcasts rank 0's
  ThreeLayers model;
  auto ddp = fsdp::replicate(model, fsdp::ReplicateOptions{std::nullopt, 64 * 65 * 4});
  TORCH_CHECK(ddp.num_buckets() == 3, "one bucket per layer, got ", ddp.num_buckets());
  auto w = model->l1->weight.detach().clone();
  fsdp::dist::world_comm()->broadcast(w, 0);
  TORCH_CHECK(w.equal(model->l1->weight.detach()), "replicate starts from rank 0's parameters");
  auto x = torch::randn({8, 64});
  auto h1 = model->l1(x).relu();
  uint64_t launched_before_l1 = 0;
  const auto before = fsdp::dist::world_comm()->stats().snapshot();
  h1.register_hook([&](const at::Tensor&) {
    launched_before_l1 = (fsdp::dist::world_comm()->stats().snapshot() - before)[fsdp::comm::OpKind::AllReduce].calls;
  });
  model->l3(model->l2(h1).relu()).sum().backward();
  TORCH_CHECK(launched_before_l1 >= 1, "no bucket was all-reduced before the first layer's backward");
  std::cout << "all-reduces issued before l1's backward: " << launched_before_l1 << " of 3" << std::endl;
}

TEST(Replicate, BucketsOverlapBackward) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  EXPECT_RANKS_PASS(2, "replicate_overlaps", o);
}
