// Checkpoints of tensor-parallel models (issue 14): a chain through every layout, each link
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

using fsdp::testing::TPModel;
using fsdp::testing::TPModelConfig;
namespace F = torch::nn::functional;
namespace tp = fsdp::tp;

constexpr int kStepsPerLink = 3;
constexpr int64_t kBatch = 12;  // divisible by every data-parallel size of the chain (1, 2, 3)
constexpr double kTol = 1e-5;

at::Tensor global_batch(const TPModelConfig& c, int step) {
  auto gen = at::detail::createCPUGenerator(2000 + static_cast<uint64_t>(step));
  return at::randint(c.vocab, {kBatch, c.seq + 1}, gen, at::kLong);
}

torch::optim::AdamW make_optimizer(torch::nn::Module& m) {
  return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-3));
}

double rel_diff(double got, double want) { return std::abs(got - want) / std::max(1.0, std::abs(want)); }

// Largest |local - its slice of the reference| over every parameter (FSDP shard rows of the
// TP-local tensor, TP-local tensors, whole ones).
double max_param_diff(TPModel& model, TPModel& reference) {
  std::map<std::string, at::Tensor> want_all;
  for (const auto& item : reference->named_parameters()) want_all[item.key()] = item.value().detach();
  double worst = 0;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    at::Tensor want = want_all.at(item.key());
    std::optional<tp::TPPlacement> placement;
    int64_t first = 0, rows = -1;
    if (auto info = fsdp::shard_info(p)) {
      placement = info->tp;
      first = info->dim0_offset;
      rows = info->local_rows;
    } else {
      placement = tp::tp_placement(p);
    }
    if (placement) want = want.narrow(placement->dim, placement->offset, placement->size);
    if (rows >= 0) want = want.narrow(0, first, rows);
    TORCH_CHECK(p.sizes() == want.sizes(), item.key(), ": local shape ", p.sizes(), " vs expected ", want.sizes());
    if (p.numel() > 0) worst = std::max(worst, (p.detach() - want).abs().max().item<double>());
  }
  return worst;
}

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
  auto ref_step = [&](int s) {
    at::Tensor batch = global_batch(c, s);
    ref_opt.zero_grad();
    at::Tensor loss = F::cross_entropy(ref->forward(batch.narrow(1, 0, c.seq)).view({-1, c.vocab}),
                                       batch.narrow(1, 1, c.seq).reshape(-1));
    loss.backward();
    fsdp::clip_grad_norm_(ref->parameters(), 0.5);
    ref_opt.step();
    return loss.item<double>();
  };
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
    fsdp::checkpoint::load(root + "/link" + std::to_string(link - 1),
                           fsdp::checkpoint::State{model.ptr(), &opt, {}});
    const double d = max_param_diff(model, ref);
    std::cout << "link " << link << " (dp " << dp << " x tp " << tp_size << "): loaded, largest parameter difference "
              << d << std::endl;
    TORCH_CHECK(d <= kTol, "loaded parameters differ from the uninterrupted run's by ", d);
  }
  auto dp_comm = mesh["dp"].comm();
  const int dp_rank = mesh.get_local_rank("dp");
  for (int s = first_step; s < first_step + kStepsPerLink; ++s) {
    const double want = ref_step(s);
    at::Tensor batch = global_batch(c, s);
    const int64_t b = kBatch / dp;
    at::Tensor lx = batch.narrow(1, 0, c.seq).narrow(0, dp_rank * b, b);
    at::Tensor ly = batch.narrow(1, 1, c.seq).narrow(0, dp_rank * b, b).contiguous();
    opt.zero_grad();
    at::Tensor loss = F::cross_entropy(fsdp::call(model, lx).view({-1, c.vocab}), ly.reshape(-1));
    loss.backward();
    fsdp::clip_grad_norm_(model->parameters(), 0.5);
    opt.step();
    at::Tensor global = loss.detach().clone().reshape({1});
    dp_comm->all_reduce(global, fsdp::comm::ReduceOp::Avg);
    std::cout << "link " << link << " step " << s << " loss " << global.item<double>() << " (uninterrupted " << want
              << ")" << std::endl;
    TORCH_CHECK(rel_diff(global.item<double>(), want) <= kTol, "step ", s, ": loss ", global.item<double>(),
                " vs uninterrupted ", want);
  }
  const double d = max_param_diff(model, ref);
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
