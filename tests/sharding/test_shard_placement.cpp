// FSDP2's shard_placement_fn (FullyShardOptions::shard_placement_fn): parameters split along a dim
// other than 0 ([Note: sharding along dim d > 0] in src/sharding/fsdp_param.h). The uneven GPT's
// matrices are sharded along their last dim (20-wide rows and the MLP's 80: uneven over 3 ranks),
// vectors along dim 0, and trained with AdamW for 10 steps against one process on the same global
// batch: the losses of every step and every final shard (its part along the chosen dim) must
// match. Cases: plain, with gradient accumulation (no-sync micro-batches), CPU offload, HSDP,
// reshard_after_forward = 2 (backward's all-gather within pairs of ranks), a checkpoint (model
// and optimizer) written from last-dim shards and read into dim-0 ones and a full state dict
// broadcast from rank 0 into last-dim shards, meta-device initialisation, and a dim that does
// not exist.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4
constexpr double kTolerance = 1e-6;

std::vector<fsdp::FSDPModule> shard(GPT& model, fsdp::FullyShardOptions options) {
  std::vector<fsdp::FSDPModule> units;
  for (auto& block : model->blocks) units.push_back(fsdp::fully_shard(block, options));
  units.push_back(fsdp::fully_shard(model, options));
  return units;
}

// Every matrix's shard is its part along the last dim: that dim's size is the shard's rows, and
// the shard is a view with permuted strides (not contiguous where it has more than one row).
void check_layout(GPT& model) {
  int64_t matrices = 0;
  for (const auto& p : model->named_parameters()) {
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not a shard");
    const int64_t want_dim = p.value().dim() >= 2 && fsdp::dist::world_size() > 1 ? p.value().dim() - 1 : 0;
    TORCH_CHECK(info->shard_dim == want_dim, p.key(), ": shard_dim ", info->shard_dim, ", want ", want_dim);
    if (want_dim == 0) continue;
    ++matrices;
    TORCH_CHECK(p.value().size(want_dim) == info->local_rows && p.value().size(0) == info->global_shape[0], p.key(),
                ": shard shape ", p.value().sizes());
    TORCH_CHECK(info->local_rows <= 1 || !p.value().is_contiguous(), p.key(), ": a dim-", want_dim,
                " shard should not be contiguous");
  }
  TORCH_CHECK(fsdp::dist::world_size() == 1 || matrices > 0, "no matrix was sharded along its last dim");
}

}  // namespace

// PLACEMENT: plain | accumulate | offload | hsdp | hpz | checkpoint | meta | bad_dim.
FSDP_RANK_WORKER(shard_placement) {
  const auto config = uneven_config();
  const std::string mode = env("PLACEMENT", "plain");
  const int n = fsdp::dist::world_size();
  fsdp::FullyShardOptions options;
  options.shard_placement_fn = last_dim_of_matrices;
  if (mode == "bad_dim") {
    GPT model = parity_model(config);
    options.shard_placement_fn = [](const std::string&, const at::Tensor& p) -> std::optional<int64_t> {
      return p.dim();
    };
    try {
      fsdp::fully_shard(model, options);
    } catch (const std::invalid_argument& e) {
      const std::string what = e.what();
      TORCH_CHECK(
          what.find("shard_placement_fn returned dim") != std::string::npos &&
              what.find("return a dim in [-dim, dim) of the parameter, or nullopt for dim 0") != std::string::npos,
          "unexpected error: ", what);
      return;
    }
    TORCH_CHECK(false, "a dim past the parameter's last was not refused");
  }
  if (mode == "meta") {
    // Materialised shards along the last dim hold what the model built whole holds there.
    auto c = config;
    c.device = torch::kMeta;
    GPT model(c);
    shard(model, options);
    fsdp::to_empty(*model, torch::kCPU);
    model->reset_parameters();
    check_layout(model);
    c.device = torch::kCPU;
    GPT whole(c);
    auto want = whole->named_parameters();
    for (const auto& p : model->named_parameters()) {
      auto info = fsdp::shard_info(p.value());
      at::Tensor full = want[p.key()];
      at::Tensor rows = full.dim() == 0 ? full.reshape({1}) : full;
      TORCH_CHECK(p.value().equal(rows.narrow(info->shard_dim, info->dim0_offset, info->local_rows)), p.key(),
                  ": the materialised shard differs from the whole model's part");
    }
    if (fsdp::dist::rank() == 0) std::cout << "meta at " << n << " ranks: every shard as the whole model's part\n";
    return;
  }
  if (mode == "offload") options.offload_policy = fsdp::CPUOffloadPolicy{};
  if (mode == "hsdp") options.mesh = fsdp::init_device_mesh({2, n / 2}, {"replicate", "shard"});
  if (mode == "hpz") options.reshard_after_forward = 2;  // backward gathers within pairs of ranks
  const int micro_batches = mode == "accumulate" ? 2 : 1;
  ShardedRun run;
  std::vector<fsdp::FSDPModule> units;
  run.shard = [&](GPT& model) { units = shard(model, options); };
  if (micro_batches > 1) {
    // The first micro-batch without sync: its gradients wait, unreduced, for the second's.
    run.before_micro_batch = [&](int micro, int count, GPT&) {
      for (auto& unit : units) unit.set_requires_gradient_sync(micro == count - 1, /*recurse=*/false);
    };
  }
  auto want = train_reference(config, kSteps, kBatch, micro_batches);
  auto got = train_sharded(config, kSteps, kBatch, micro_batches, run);
  check_layout(got.model);
  check_losses_match(got.losses, want.losses, kTolerance);
  double worst = check_shards_match(got.model, want.parameters, kTolerance);
  // The full state dict gathers along each parameter's dim.
  auto full = fsdp::checkpoint::get_model_state_dict(*got.model, {.full_state_dict = true});
  for (const auto& [key, value] : full) {
    const at::Tensor& ref = want.parameters.at(key);
    TORCH_CHECK(value.sizes() == ref.sizes(), key, ": full state dict shape ", value.sizes());
    const double diff = ((value - ref).abs() / ref.abs().clamp_min(1.0)).max().item<double>();
    TORCH_CHECK(diff <= kTolerance, key, ": full state dict differs by ", diff);
  }
  if (mode == "checkpoint") {
    // Written from shards along the last dim (the model and AdamW's state, one more step taken
    // so that the state is there), read into a model sharded along dim 0: the same full model
    // and optimizer state, each rank its rows.
    const std::string dir = env("CKPT_DIR", "");
    TORCH_CHECK(!dir.empty(), "CKPT_DIR is not set");
    // A full state dict (as from a Hugging Face file) read by rank 0 alone, broadcast, and cut
    // along each parameter's dim into a fresh last-dim-sharded model.
    GPT from_full = parity_model(config);
    shard(from_full, options);
    fsdp::checkpoint::set_model_state_dict(*from_full, fsdp::dist::rank() == 0 ? full : fsdp::checkpoint::StateDict{},
                                           {.full_state_dict = true, .broadcast_from_rank0 = true});
    worst = std::max(worst, check_shards_match(from_full, want.parameters, kTolerance));
    auto opt = parity_optimizer(*got.model);
    const int64_t local = kBatch / n;
    auto data = global_batch(config, kBatch, kSteps, 0).narrow(0, fsdp::dist::rank() * local, local);
    fsdp::models::gpt_loss(fsdp::call(got.model, data.narrow(1, 0, config.block_size)),
                           data.narrow(1, 1, config.block_size))
        .backward();
    opt.step();
    fsdp::checkpoint::save(dir, fsdp::checkpoint::State{.model = got.model.ptr(), .optimizer = &opt});
    GPT fresh = parity_model(config);
    shard(fresh, fsdp::FullyShardOptions{});
    auto fresh_opt = parity_optimizer(*fresh);
    fsdp::checkpoint::load(dir, fsdp::checkpoint::State{.model = fresh.ptr(), .optimizer = &fresh_opt});
    for (const auto& p : fresh->named_parameters()) TORCH_CHECK(fsdp::shard_info(p.value())->shard_dim == 0);
    const fsdp::checkpoint::StateDictOptions whole{.full_state_dict = true};
    auto saved = fsdp::checkpoint::get_model_state_dict(*got.model, whole);
    auto loaded = fsdp::checkpoint::get_model_state_dict(*fresh, whole);
    auto saved_opt = fsdp::checkpoint::get_optimizer_state_dict(*got.model, opt, whole);
    auto loaded_opt = fsdp::checkpoint::get_optimizer_state_dict(*fresh, fresh_opt, whole);
    saved.insert(saved_opt.begin(), saved_opt.end());
    loaded.insert(loaded_opt.begin(), loaded_opt.end());
    TORCH_CHECK(saved.size() == loaded.size() && saved_opt.size() > saved.size() / 2, "keys: saved ", saved.size(),
                ", loaded ", loaded.size());
    for (const auto& [key, value] : saved) {
      TORCH_CHECK(loaded.count(key) && loaded.at(key).equal(value), key, ": loaded differs from saved");
    }
  }
  if (fsdp::dist::rank() == 0) {
    std::cout << mode << " at " << n << " ranks: " << kSteps << " steps, last loss " << got.losses.back()
              << " (single process " << want.losses.back() << "), worst shard difference " << worst << std::endl;
  }
}

struct PlacementCase {
  std::string mode;
  int world;
};

class ShardPlacement : public ::testing::TestWithParam<PlacementCase> {};

TEST_P(ShardPlacement, MatchesSingleProcess) {
  TempDir dir("shard_placement");
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  o.env["PLACEMENT"] = GetParam().mode;
  o.env["CKPT_DIR"] = dir / "ckpt";
  auto r = run_ranks(GetParam().world, "shard_placement", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

// A world of one keeps dim 0 (nothing is split).
INSTANTIATE_TEST_SUITE_P(Placement, ShardPlacement,
                         ::testing::Values(PlacementCase{"plain", 2}, PlacementCase{"plain", 3},
                                           PlacementCase{"plain", 1}, PlacementCase{"accumulate", 3},
                                           PlacementCase{"offload", 2}, PlacementCase{"hsdp", 4},
                                           PlacementCase{"hpz", 4}, PlacementCase{"checkpoint", 3},
                                           PlacementCase{"meta", 3}, PlacementCase{"bad_dim", 2}),
                         [](const auto& info) {
                           return info.param.mode + "_" + std::to_string(info.param.world) + "ranks";
                         });
