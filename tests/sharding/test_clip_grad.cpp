// clip_grad_norm_ on shards equals torch::nn::utils::clip_grad_norm_ on the full gradients of one
// process (same model, same global batch), for the 2-norm and the inf-norm, with a mix of sharded
// parameters and replicated ones (ln_f, left out of sharding and all-reduced by hand, as DDP would).
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <limits>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

FSDP_RANK_WORKER(clip_grad_norm) {
  const auto c = uneven_config();
  const int64_t batch = 6;
  auto data = global_batch(c, batch, 0, 0);
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    // The reference: one process, full gradients.
    torch::manual_seed(42);
    GPT ref(c);
    fsdp::models::gpt_loss(ref->forward(data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size)).backward();
    const double max_norm = 0.05;
    const double want = torch::nn::utils::clip_grad_norm_(ref->parameters(), max_norm, norm_type);

    torch::manual_seed(42);
    GPT model(c);
    fsdp::FullyShardOptions o;
    o.ignored_params = {model->ln_f->weight, model->ln_f->bias};
    for (auto& b : model->blocks) fsdp::fully_shard(b);
    fsdp::fully_shard(model, o);
    auto world = fsdp::dist::world_comm();
    const int64_t local = batch / world->size();
    auto mine = data.narrow(0, world->rank() * local, local);
    fsdp::models::gpt_loss(fsdp::call(model, mine.narrow(1, 0, c.block_size)), mine.narrow(1, 1, c.block_size))
        .backward();
    for (auto& t : o.ignored_params) world->all_reduce(t.grad(), fsdp::comm::ReduceOp::Avg);
    const double got = fsdp::clip_grad_norm_(model->parameters(), max_norm, norm_type);
    TORCH_CHECK(std::abs(got - want) <= 1e-6 * want, "total norm ", got, " vs single process ", want, " (norm_type ",
                norm_type, ")");
    TORCH_CHECK(got > max_norm, "the test must actually clip");
    // The clipped shards equal the clipped full gradients.
    std::map<std::string, at::Tensor> want_grads;
    for (const auto& p : ref->named_parameters()) want_grads[p.key()] = p.value().grad();
    for (const auto& p : model->named_parameters()) {
      at::Tensor full = want_grads.at(p.key());
      at::Tensor expect = full;
      if (auto info = fsdp::shard_info(p.value())) expect = full.narrow(0, info->dim0_offset, info->local_rows);
      const double diff = (p.value().grad() - expect).abs().max().item<double>();
      const double scale = std::max(expect.abs().max().item<double>(), 1e-12);
      TORCH_CHECK(diff <= 1e-6 * scale + 1e-9, p.key(), ": clipped gradient differs by ", diff);
    }
    if (world->rank() == 0)
      std::cout << "norm_type " << norm_type << ": total norm " << got << " (single process " << want << ")"
                << std::endl;
  }
}

TEST(ClipGradNorm, MatchesSingleProcess) {
  for (int world : {2, 3}) {
    auto r = run_ranks(world, "clip_grad_norm");
    EXPECT_TRUE(r.all_ok()) << r.report();
    if (r.all_ok()) std::cout << r.ranks[0].output;
  }
}

// Each gradient's norm is read in place (float, double) or from a float64 copy (other dtypes): the
// gradients keep their values when nothing is clipped, and every norm type gives the float64 value
// (to float's rounding for a float gradient).
TEST(ClipGradNorm, LeavesGradientsAloneWhenNotClipping) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    for (double norm_type : {1.0, 2.0, 3.0, std::numeric_limits<double>::infinity()}) {
      torch::manual_seed(7);
      at::Tensor p = torch::randn({33, 5}, at::TensorOptions().dtype(dtype)).requires_grad_();
      p.mutable_grad() = torch::randn({33, 5}, at::TensorOptions().dtype(dtype)) - 0.5;
      const at::Tensor before = p.grad().clone();
      const at::Tensor g = before.to(at::kDouble);
      const double want = std::isinf(norm_type) ? g.abs().max().item<double>()
                                                : std::pow(g.abs().pow(norm_type).sum().item<double>(), 1 / norm_type);
      const double got = fsdp::clip_grad_norm_({p}, 1e9, norm_type);
      EXPECT_NEAR(got, want, (dtype == at::kFloat ? 1e-6 : 1e-12) * want)
          << "norm_type " << norm_type << ", dtype " << dtype;
      EXPECT_TRUE(at::equal(p.grad(), before)) << "norm_type " << norm_type << ", dtype " << dtype;
    }
  }
}
