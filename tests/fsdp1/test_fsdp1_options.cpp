// FSDPOptions that change what ranks hold: sync_module_states, mixed_precision, the prefetch
// switches, clip_grad_norm_ against one process, and HYBRID_SHARD's default mesh.
#include <gtest/gtest.h>

#include <iostream>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
using fsdp::models::BlockImpl;
using fsdp::models::GPT;

namespace {

fsdp::FSDPOptions blocks() {
  fsdp::FSDPOptions o;
  o.auto_wrap_policy = fsdp::transformer_auto_wrap_policy<BlockImpl>();
  return o;
}

// Rank 1's model starts from other values (as an unseeded initialisation would).
GPT diverged_model(const fsdp::models::GPTConfig& c) {
  auto model = parity_model(c);
  if (fsdp::dist::rank() == 1) {
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.add_(1.0);
  }
  return model;
}

// Largest |summoned - reference| over every parameter.
double distance_to(fsdp::FullyShardedDataParallelBase& wrapped, GPT& reference) {
  auto full = wrapped.summon_full_params(/*writeback=*/false);
  double worst = 0;
  for (const auto& item : reference->named_parameters()) {
    worst = std::max(worst, (full.parameter(item.key()) - item.value()).abs().max().item<double>());
  }
  return worst;
}

}  // namespace

FSDP_RANK_WORKER(fsdp1_options) {
  const auto config = uneven_config();
  auto reference = parity_model(config);

  // sync_module_states: rank 0's values on every rank; without it rank 1's shards stay its own.
  auto synced = diverged_model(config);
  fsdp::FSDPOptions sync_options = blocks();
  sync_options.sync_module_states = true;
  fsdp::FSDP w_synced(synced, sync_options);
  TORCH_CHECK(distance_to(w_synced, reference) == 0.0, "sync_module_states did not broadcast rank 0's values");
  auto unsynced = diverged_model(config);
  fsdp::FSDP w_unsynced(unsynced, blocks());
  TORCH_CHECK(distance_to(w_unsynced, reference) >= 0.5, "without sync_module_states rank 1's rows should differ");

  // mixed_precision: units gather and compute in param_dtype; writeback would round, so it is refused.
  auto mp_model = parity_model(config);
  fsdp::FSDPOptions mp = blocks();
  mp.mixed_precision = fsdp::MixedPrecision{.param_dtype = at::kBFloat16, .reduce_dtype = at::kFloat};
  fsdp::FSDP w_mp(mp_model, mp);
  {
    auto full = w_mp.summon_full_params(/*writeback=*/false);
    TORCH_CHECK(full.parameter("h.0.mlp.c_fc.weight").scalar_type() == at::kBFloat16, "param_dtype not applied");
  }
  TORCH_CHECK(mp_model->named_parameters()["h.0.mlp.c_fc.weight"].scalar_type() == at::kFloat, "shards not fp32");
  bool refused = false;
  try {
    auto full = w_mp.summon_full_params(/*writeback=*/true);
  } catch (const std::invalid_argument& e) {
    refused = std::string(e.what()).find("writeback under mixed precision") != std::string::npos;
  }
  TORCH_CHECK(refused, "writeback under mixed precision was not refused");

  // forward_prefetch on, backward_prefetch NONE, then clip_grad_norm_: the same gradients and norm
  // as one process.
  auto model = parity_model(config);
  fsdp::FSDPOptions o = blocks();
  o.forward_prefetch = true;
  o.backward_prefetch = fsdp::BackwardPrefetch::NONE;
  fsdp::FSDP wrapped(model, o);
  const int n = fsdp::dist::world_size(), rank = fsdp::dist::rank();
  auto data = global_batch(config, 4, 0, 0);
  for (int step = 0; step < 2; ++step) {  // the second step runs with the recorded order
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    for (auto& p : reference->parameters()) p.mutable_grad() = at::Tensor();
    auto local = data.narrow(0, rank * (4 / n), 4 / n);
    fsdp::models::gpt_loss(wrapped(local.narrow(1, 0, config.block_size)), local.narrow(1, 1, config.block_size))
        .backward();
    fsdp::models::gpt_loss(reference(data.narrow(1, 0, config.block_size)), data.narrow(1, 1, config.block_size))
        .backward();
    const double got = wrapped.clip_grad_norm_(0.01);
    const double want = torch::nn::utils::clip_grad_norm_(reference->parameters(), 0.01);
    TORCH_CHECK(std::abs(got - want) <= 1e-5 * want, "step ", step, ": norm ", got, " vs one process ", want);
    for (const auto& item : model->named_parameters()) {
      auto info = *fsdp::shard_info(item.value());
      at::Tensor ref = reference->named_parameters()[item.key()].grad();
      at::Tensor rows = ref.dim() == 0 ? ref.reshape({1}) : ref;
      TORCH_CHECK(at::allclose(item.value().grad(), rows.narrow(0, info.dim0_offset, info.local_rows), 1e-4, 1e-6),
                  item.key(), ": clipped gradient differs");
    }
    if (rank == 0 && step == 1) std::cout << "clip_grad_norm_: " << got << " (one process " << want << ")" << std::endl;
  }
  // HYBRID_SHARD without device_mesh shards within a host and replicates across hosts (FSDP1's
  // default): the ranks here are one host, so one replica of every rank.
  auto hybrid_model = parity_model(config);
  fsdp::FSDPOptions h = blocks();
  h.sharding_strategy = fsdp::ShardingStrategy::HYBRID_SHARD;
  fsdp::FSDP w_hybrid(hybrid_model, h);
  const auto hinfo = *fsdp::shard_info(hybrid_model->lm_head->named_parameters()["weight"]);
  TORCH_CHECK(hinfo.num_replicas == 1 && hinfo.mesh.size() == fsdp::dist::local_world_size(),
              "HYBRID_SHARD's default mesh: ", hinfo.num_replicas, " replicas of ", hinfo.mesh.size(),
              " ranks, want 1 of ", fsdp::dist::local_world_size());
  if (rank == 0) std::cout << "sync_module_states, mixed_precision, prefetch switches, hybrid mesh: ok" << std::endl;
}

TEST(Fsdp1, OptionsTakeEffect) {
  auto r = run_ranks(2, "fsdp1_options");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}
