// Frozen parameters (requires_grad false, fine-tuning) under fully_shard, and the state-dict
// options: ignore_frozen_params, submodules / keep_submodule_prefixes, get_state_dict /
// set_state_dict for model and optimizer together. Real processes at 2 ranks.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "cpu_layout.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/compat/optim.h"
#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
namespace ckpt = fsdp::checkpoint;
using fsdp::models::GPT;

namespace {

constexpr int64_t kBatch = 12;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v, name, " is not set");
  return v;
}

// `seed`: the model's init_seed (its initial weights).
GPT sharded(int seed, const std::function<void(GPT&)>& before_sharding = {}) {
  auto c = uneven_config();
  c.init_seed = static_cast<uint64_t>(seed);
  GPT model(c);
  if (before_sharding) before_sharding(model);
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  return model;
}

void freeze(torch::nn::Module& module) {
  for (auto& p : module.parameters()) p.set_requires_grad(false);
}

torch::optim::AdamW make_opt(GPT& model) {
  return torch::optim::AdamW(model->parameters(), torch::optim::AdamWOptions(3e-3).eps(1e-3).weight_decay(0.1));
}

void train_step(GPT& model, torch::optim::Optimizer& opt, int step) {
  const auto c = uneven_config();
  const int world = fsdp::dist::world_size(), rank = fsdp::dist::rank();
  opt.zero_grad();
  auto data = global_batch(c, kBatch, step, 0).narrow(0, rank * (kBatch / world), kBatch / world);
  fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size))
      .backward();
  opt.step();
}

uint64_t reduce_scatter_bytes_of_step(GPT& model, torch::optim::Optimizer& opt, int step, uint64_t* calls) {
  const auto before = fsdp::comm::process_comm_stats().snapshot();
  train_step(model, opt, step);
  const auto d = fsdp::comm::process_comm_stats().snapshot() - before;
  *calls = d[fsdp::comm::OpKind::ReduceScatter].calls;
  return d[fsdp::comm::OpKind::ReduceScatter].bytes_sent;
}

std::map<std::string, at::Tensor> snapshot(torch::nn::Module& m) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

bool is_frozen_name(const std::string& fqn) { return fqn.rfind("h.0.", 0) == 0 || fqn == "wpe.weight"; }

}  // namespace

// Block 0 frozen before fully_shard, wpe frozen after it (on its shard): frozen parameters keep
// their values, get no gradient, no optimizer state and no reduce-scatter; they are saved and
// loaded like any other parameter; ignore_frozen_params leaves them out of state dicts.
FSDP_RANK_WORKER(frozen_params) {
  const fsdp::testing::FlatCpuCollectives flat;  // the byte count below is the flat layout's padded rows
  const int world = fsdp::dist::world_size();
  auto baseline = sharded(42);
  auto baseline_opt = make_opt(baseline);
  auto model = sharded(42, [](GPT& m) { freeze(*m->blocks[0]); });
  freeze(*model->wpe);  // after sharding: the shard's flag is what counts
  auto opt = make_opt(model);
  const auto initial = snapshot(*model);

  uint64_t base_calls = 0, frozen_calls = 0;
  const uint64_t base_bytes = reduce_scatter_bytes_of_step(baseline, baseline_opt, 0, &base_calls);
  const uint64_t frozen_bytes = reduce_scatter_bytes_of_step(model, opt, 0, &frozen_calls);
  // Exactly the frozen parameters' padded rows are missing from the reduce-scatters ((N-1)/N of
  // the full padded size, fp32); block 0's group, all frozen, runs none at all.
  uint64_t frozen_padded = 0;
  for (const auto& p : model->named_parameters()) {
    if (!is_frozen_name(p.key())) continue;
    TORCH_CHECK(!p.value().requires_grad(), p.key(), " should be frozen");
    const auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not sharded");
    int64_t row = 1;
    for (size_t d = 1; d < info->global_shape.size(); ++d) row *= info->global_shape[d];
    frozen_padded += static_cast<uint64_t>(info->padded_rows * row);
  }
  TORCH_CHECK(base_calls == 3 && frozen_calls == 2, "reduce-scatters per step: ", base_calls, " unfrozen, ",
              frozen_calls, " with block 0 frozen (expected 3 and 2)");
  TORCH_CHECK(base_bytes - frozen_bytes == (world - 1) * 4 * frozen_padded, "reduce-scatter bytes ", base_bytes, " -> ",
              frozen_bytes, ", expected a saving of ", (world - 1) * 4 * frozen_padded);
  for (int s = 1; s < 3; ++s) train_step(model, opt, s);

  for (const auto& p : model->named_parameters()) {
    const bool frozen = is_frozen_name(p.key());
    const bool has_state = opt.state().count(fsdp::compat::optimizer_state_key(p.value())) > 0;
    TORCH_CHECK(has_state != frozen, p.key(),
                frozen ? " is frozen but has optimizer state" : " has no optimizer state");
    if (frozen) {
      TORCH_CHECK(!p.value().grad().defined(), p.key(), " is frozen but has a gradient");
      TORCH_CHECK(at::equal(p.value(), initial.at(p.key())), p.key(), " is frozen but changed");
    } else if (p.value().dim() >= 2 && p.value().numel() > 0) {
      TORCH_CHECK(!at::equal(p.value(), initial.at(p.key())), p.key(), " did not train");
    }
  }

  // Saved and loaded: frozen parameters' weights are in the checkpoint, their optimizer state is not.
  const std::string dir = env("CKPT_DIR");
  ckpt::save(dir, ckpt::State{model.ptr(), &opt});
  const auto saved = ckpt::describe(dir);
  TORCH_CHECK(saved.count("model.h.0.attn.c_attn.weight") && saved.count("model.wpe.weight"),
              "frozen weights not saved");
  for (const auto& [key, meta] : saved)
    TORCH_CHECK(key.rfind("optim.h.0.", 0) != 0 && key.rfind("optim.wpe.", 0) != 0, key,
                ": optimizer state of a frozen parameter");
  auto loaded = sharded(5, [](GPT& m) { freeze(*m->blocks[0]); });
  freeze(*loaded->wpe);
  auto loaded_opt = make_opt(loaded);
  ckpt::load(dir, ckpt::State{loaded.ptr(), &loaded_opt});
  for (const auto& p : loaded->named_parameters())
    TORCH_CHECK(at::equal(p.value(), model->named_parameters()[p.key()]), p.key(), " differs after the load");
  train_step(model, opt, 3);
  train_step(loaded, loaded_opt, 3);
  for (const auto& p : loaded->named_parameters())
    TORCH_CHECK(at::equal(p.value(), model->named_parameters()[p.key()]), p.key(), " differs one step after the load");

  // ignore_frozen_params: get leaves them out; set neither needs nor loads them.
  auto full = ckpt::get_model_state_dict(*model, {.full_state_dict = true, .ignore_frozen_params = true});
  auto all = ckpt::get_model_state_dict(*model, {.full_state_dict = true});
  TORCH_CHECK(!full.count("wpe.weight") && !full.count("h.0.ln_1.weight") && full.count("h.1.ln_1.weight"));
  TORCH_CHECK(all.size() - full.size() == model->blocks[0]->parameters().size() + 1, all.size(), " vs ", full.size());
  auto target = sharded(9, [](GPT& m) { freeze(*m->blocks[0]); });
  freeze(*target->wpe);
  const auto target_before = snapshot(*target);
  auto r = ckpt::set_model_state_dict(*target, all, {.full_state_dict = true, .ignore_frozen_params = true});
  TORCH_CHECK(r.missing_keys.empty() && r.unexpected_keys.empty(), "frozen keys should be ignored");
  for (const auto& p : target->named_parameters()) {
    const bool same_as_model = at::equal(p.value(), model->named_parameters()[p.key()]);
    const bool untouched = at::equal(p.value(), target_before.at(p.key()));
    if (p.value().numel() == 0) continue;
    TORCH_CHECK(is_frozen_name(p.key()) ? untouched : same_as_model, p.key(), " wrongly (not) loaded");
  }
}

// submodules / keep_submodule_prefixes, and an unknown submodule name.
FSDP_RANK_WORKER(submodule_state_dicts) {
  auto model = sharded(42);
  auto h0 = ckpt::get_model_state_dict(*model, {.full_state_dict = true, .submodules = {"h.0"}});
  TORCH_CHECK(!h0.empty());
  for (const auto& [k, t] : h0) TORCH_CHECK(k.rfind("h.0.", 0) == 0, k, " is not in h.0");
  TORCH_CHECK(h0.size() == model->blocks[0]->parameters().size() + model->blocks[0]->buffers().size());
  auto relative = ckpt::get_model_state_dict(
      *model, {.full_state_dict = true, .submodules = {"h.0"}, .keep_submodule_prefixes = false});
  TORCH_CHECK(relative.size() == h0.size() && relative.count("attn.c_attn.weight"), "relative keys");
  for (const auto& [k, t] : relative) TORCH_CHECK(at::equal(t, h0.at("h.0." + k)), k);
  // Relative keys of h.0 set into h.1: block 1 becomes a copy of block 0, nothing else changes.
  const auto before = ckpt::get_model_state_dict(*model, {.full_state_dict = true});
  ckpt::set_model_state_dict(*model, relative,
                             {.full_state_dict = true, .submodules = {"h.1"}, .keep_submodule_prefixes = false});
  const auto after = ckpt::get_model_state_dict(*model, {.full_state_dict = true});
  for (const auto& [k, t] : after) {
    const std::string source = k.rfind("h.1.", 0) == 0 ? "h.0." + k.substr(4) : k;
    TORCH_CHECK(at::equal(t, before.at(source)), k, source == k ? " changed" : " not copied from h.0");
  }
  // Two submodules, prefixes kept; sharded (local) dicts too.
  auto both = ckpt::get_model_state_dict(*model, {.submodules = {"h.0", "ln_f"}});
  TORCH_CHECK(both.size() == h0.size() + 2 && both.count("ln_f.weight"), both.size());
  expect_error([&] { ckpt::get_model_state_dict(*model, {.submodules = {"h.7"}}); },
               "'h.7' is not a submodule of the model");
  expect_error(
      [&] {
        ckpt::get_model_state_dict(*model, {.submodules = {"h.0", "h.1"}, .keep_submodule_prefixes = false});
      },
      "both become");
}

// get_state_dict / set_state_dict: model and optimizer together, full dicts on every rank.
FSDP_RANK_WORKER(model_and_optimizer_together) {
  auto model = sharded(42);
  auto opt = make_opt(model);
  for (int s = 0; s < 2; ++s) train_step(model, opt, s);
  auto [model_sd, optim_sd] = ckpt::get_state_dict(*model, opt, {.full_state_dict = true});
  TORCH_CHECK(model_sd.count("wte.weight") && optim_sd.count("wte.weight.exp_avg") &&
              optim_sd.count("param_groups.0.lr"));
  auto fresh = sharded(3);
  auto fresh_opt = torch::optim::AdamW(fresh->parameters(), torch::optim::AdamWOptions(0.5));
  auto r = ckpt::set_state_dict(*fresh, fresh_opt, {model_sd, optim_sd}, {.full_state_dict = true});
  TORCH_CHECK(r.missing_keys.empty() && r.unexpected_keys.empty());
  auto [model_again, optim_again] = ckpt::get_state_dict(*fresh, fresh_opt, {.full_state_dict = true});
  for (const auto& [k, t] : model_sd) TORCH_CHECK(at::equal(model_again.at(k), t), k);
  for (const auto& [k, t] : optim_sd) TORCH_CHECK(at::equal(optim_again.at(k), t), k);
  train_step(model, opt, 2);
  train_step(fresh, fresh_opt, 2);
  for (const auto& p : fresh->named_parameters())
    TORCH_CHECK(at::equal(p.value(), model->named_parameters()[p.key()]), p.key(),
                " differs a step after set_state_dict");
  // A wrong key is reported with the optimizer prefix.
  optim_sd["no.such.exp_avg"] = at::zeros({1});
  auto loose =
      ckpt::set_state_dict(*fresh, fresh_opt, {model_sd, optim_sd}, {.full_state_dict = true, .strict = false});
  TORCH_CHECK(loose.unexpected_keys.size() == 1 && loose.unexpected_keys[0] == "optim.no.such.exp_avg");
}

TEST(FrozenParams, NoGradientNoStateNoReduceScatterSavedAndLoaded) {
  TempDir dir("fsdp_frozen");
  RanksOptions o;
  o.timeout = std::chrono::seconds(240);
  o.env["CKPT_DIR"] = dir / "ckpt";
  EXPECT_RANKS_PASS(2, "frozen_params", o);
}

TEST(StateDictOptions, SubmodulesAndPrefixes) {
  RanksOptions o;
  o.timeout = std::chrono::seconds(180);
  EXPECT_RANKS_PASS(2, "submodule_state_dicts", o);
}

TEST(StateDictOptions, ModelAndOptimizerTogether) {
  RanksOptions o;
  o.timeout = std::chrono::seconds(180);
  EXPECT_RANKS_PASS(2, "model_and_optimizer_together", o);
}
