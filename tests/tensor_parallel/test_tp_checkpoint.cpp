// Checkpoints of tensor-parallel models: a chain through every layout, each link
// loading the previous one's checkpoint and training on:
//   dp=2 x tp=2 (4 ranks) -> FSDP at 3 ranks -> one process -> dp=1 x tp=2 (2 ranks)
// Every link starts from parameters equal to an uninterrupted one-process run's (1e-5) and its
// losses and final parameters equal that run's (1e-5): what a checkpoint holds (parameter boxes
// along dim 0, dim 1 and both, AdamW state by parameter name) survives every reshard.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"
#include "tp_model.h"

namespace {

using fsdp::testing::global_batch;
using fsdp::testing::make_optimizer;
using fsdp::testing::max_param_diff;
using fsdp::testing::rel_diff;
using fsdp::testing::snapshot;
using fsdp::testing::train_step;
using fsdp::testing::TPModel;
using fsdp::testing::TPModelConfig;
namespace tp = fsdp::tp;

constexpr int kStepsPerLink = 3;
constexpr int64_t kBatch = 12;  // divisible by every data-parallel size of the chain (1, 2, 3)
constexpr double kTol = 1e-5;

// One link: TP_SIZE, LINK (0..3), CKPT_ROOT; loads CKPT_ROOT/link<LINK-1> (LINK > 0), trains
// kStepsPerLink steps, saves CKPT_ROOT/link<LINK>.
void chain_link() {
  const int world = fsdp::dist::world_size();
  const int tp_size = std::atoi(std::getenv("TP_SIZE"));
  const int link = std::atoi(std::getenv("LINK"));
  const std::string root = std::getenv("CKPT_ROOT");
  const int dp = world / tp_size;
  const int first_step = link * kStepsPerLink;
  TPModelConfig c;

  // The uninterrupted one-process run, up to this link's start.
  TPModel ref(c);
  auto ref_opt = make_optimizer(*ref);
  auto ref_step = [&](int s) { return train_step(ref, ref_opt, global_batch(c, s, kBatch, 2000)).item<double>(); };
  for (int s = 0; s < first_step; ++s) ref_step(s);

  // This link's layout: TP over "tp" when tp_size > 1, fully_shard over "dp" when dp > 1.
  auto mesh = fsdp::init_device_mesh({dp, tp_size}, {"dp", "tp"});
  TPModel model(c);
  if (tp_size > 1) tp::parallelize_module(model, mesh["tp"], fsdp::testing::tp_plan(false, false));
  if (dp > 1) {
    fsdp::FullyShardOptions opts{.mesh = mesh["dp"]};
    for (auto& b : model->typed_blocks) fsdp::fully_shard(b, opts);
    fsdp::fully_shard(model, opts);
  }
  auto opt = make_optimizer(*model);
  if (link > 0) {
    fsdp::checkpoint::load(root + "/link" + std::to_string(link - 1), fsdp::checkpoint::State{model.ptr(), &opt, {}});
    const double d = max_param_diff(model, snapshot(ref), kTol);
    std::cout << "link " << link << " (dp " << dp << " x tp " << tp_size << "): loaded, largest parameter difference "
              << d << std::endl;
    TORCH_CHECK(d <= kTol, "loaded parameters differ from the uninterrupted run's by ", d);
  }
  auto dp_comm = mesh["dp"].comm();
  const int dp_rank = mesh.get_local_rank("dp");
  for (int s = first_step; s < first_step + kStepsPerLink; ++s) {
    const double want = ref_step(s);
    at::Tensor global = train_step(model, opt, global_batch(c, s, kBatch, 2000), dp_rank, dp).clone().reshape({1});
    dp_comm->all_reduce(global, fsdp::comm::ReduceOp::Avg);
    std::cout << "link " << link << " step " << s << " loss " << global.item<double>() << " (uninterrupted " << want
              << ")" << std::endl;
    TORCH_CHECK(rel_diff(global.item<double>(), want) <= kTol, "step ", s, ": loss ", global.item<double>(),
                " vs uninterrupted ", want);
  }
  const double d = max_param_diff(model, snapshot(ref), kTol);
  TORCH_CHECK(d <= kTol, "parameters after link ", link, " differ from the uninterrupted run's by ", d);
  fsdp::checkpoint::save(root + "/link" + std::to_string(link), fsdp::checkpoint::State{model.ptr(), &opt, {}});
}

FSDP_RANK_WORKER(tp_ckpt_link) { chain_link(); }

fsdp::testing::RanksOptions link_opts(int tp_size, int link, const std::string& root) {
  fsdp::testing::RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  o.env = {{"TP_SIZE", std::to_string(tp_size)}, {"LINK", std::to_string(link)}, {"CKPT_ROOT", root}};
  return o;
}

}  // namespace

TEST(TensorParallelCheckpoint, ChainTwoByTwoToFsdpThreeToOneProcessToTpTwo) {
  fsdp::testing::TempDir dir("fsdp_tp_ckpt");
  EXPECT_RANKS_PASS(4, "tp_ckpt_link", link_opts(2, 0, dir.path));  // dp 2 x tp 2
  EXPECT_RANKS_PASS(3, "tp_ckpt_link", link_opts(1, 1, dir.path));  // FSDP 3
  EXPECT_RANKS_PASS(1, "tp_ckpt_link", link_opts(1, 2, dir.path));  // one process
  EXPECT_RANKS_PASS(2, "tp_ckpt_link", link_opts(2, 3, dir.path));  // dp 1 x tp 2
}
