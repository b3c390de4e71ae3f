// The flat reduce-scatter into the sharded gradients (CpuCollectiveOptions::reduce_into_grads,
// [Note: the reduce-scatter into the sharded gradients] in src/sharding/collectives.h): only the
// peers' rows are packed, this rank's go straight into the gradients. The uneven GPT (every unit
// flat: its shards are far below min_piece_bytes) is trained twice per case, with the option off
// (FSDP2's input of every rank's rows) and on, and once by one process on the global batch: both
// sharded runs must match the single process (losses of every step, every final shard), the two
// must match each other to rounding, and the flight recorder must show which reduce-scatter each
// made. Each case steers the gradients into one of the destinations:
//   grads     zeroed in place before each step: the reduction adds into the buffer the first step
//             left them in;
//   none      set to none before each step (LibTorch 2.x's zero_grad): a fresh buffer each step,
//             reduced into, its rows become the gradients with no copy (the flat path copies its
//             result there: counted); at 2 ranks bit for bit the flat path's result;
//   replaced  replaced by tensors of the test's own: a scratch buffer, added into them;
//   half      every other gradient none, the rest zeroed: the same scratch path;
//   divide    zeroed, set_gradient_divide_factor(N): sums scaled by 1/N instead of averages;
//   accumulate  two synced micro-batches a step: the second adds into what the first wrote.
//   frozen    zeroed; block 0's attention and wpe frozen (units partly without gradients), block
//             1 frozen whole (a unit that reduces nothing): the single process freezes the same.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <set>
#include <tuple>

#include "fsdp/debug/cpu_collectives.h"
#include "fsdp/debug/flight_recorder.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "op_counts.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 6;
constexpr int64_t kBatch = 12;
constexpr double kTolerance = 1e-6;

// The reduce-scatters the flight recorder saw since record `since`: (flat, pieces).
std::pair<int, int> reduce_scatters_since(uint64_t since) {
  int flat = 0, pieces = 0;
  for (const auto& rec : fsdp::comm::FlightRecorder::process().snapshot()) {
    if (rec.id < since) continue;
    if (std::strcmp(rec.op, "reduce_scatter_tensor") == 0) ++flat;
    if (std::strcmp(rec.op, "reduce_scatter_pieces") == 0) ++pieces;
  }
  return {flat, pieces};
}

}  // namespace

// CASE: grads | none | replaced | half | divide | accumulate | frozen.
FSDP_RANK_WORKER(reduce_into_grads) {
  const auto config = uneven_config();
  const std::string mode = env("CASE", "grads");
  const int n = fsdp::dist::world_size();
  const int micro_batches = mode == "accumulate" ? 2 : 1;
  const auto freeze = [&](GPT& model) {
    if (mode != "frozen") return;
    for (auto& p : model->blocks[0]->attn->parameters()) p.set_requires_grad(false);
    for (auto& p : model->blocks[1]->parameters()) p.set_requires_grad(false);
    for (auto& p : model->wpe->parameters()) p.set_requires_grad(false);
  };
  std::vector<fsdp::FSDPModule> units;
  ShardedRun run;
  run.shard = [&](GPT& model) {
    freeze(model);
    units.clear();
    for (auto& block : model->blocks) units.push_back(fsdp::fully_shard(block));
    units.push_back(fsdp::fully_shard(model));
    if (mode == "divide") {
      for (auto& unit : units) unit.set_gradient_divide_factor(static_cast<double>(n));
    }
  };
  run.zero_grad = [&](GPT& model) {
    int i = 0;
    for (auto& p : model->parameters()) {
      at::Tensor& grad = p.mutable_grad();
      const bool none = mode == "none" || (mode == "half" && i++ % 2 == 0);
      if (none) {
        grad = at::Tensor();
      } else if (grad.defined()) {
        grad.zero_();
        if (mode == "replaced") grad = at::zeros_like(grad);
      }
    }
  };
  auto want = train_reference(config, kSteps, kBatch, micro_batches, freeze);
  // One sharded run with the option set: its result, the reduce-scatters it recorded (flat, into the
  // gradients) and the copies at the end of its reductions (fsdp::reduce_scatter_wait, where the
  // result goes into the gradients).
  const auto run_with = [&](bool reduce_into_grads) {
    fsdp::CpuCollectiveOptions o = fsdp::cpu_collective_options();
    o.reduce_into_grads = reduce_into_grads;
    fsdp::set_cpu_collective_options(o);
    RangeOpCounter counter;
    const uint64_t start = fsdp::comm::FlightRecorder::process().recorded();
    auto result = train_sharded(config, kSteps, kBatch, micro_batches, run);
    const auto ops = reduce_scatters_since(start);
    return std::make_tuple(std::move(result), ops, counter.copies("fsdp::reduce_scatter_wait"));
  };
  auto [flat, flat_ops, flat_copies] = run_with(false);
  auto [into, into_ops, into_copies] = run_with(true);
  // One reduce-scatter per unit (that has gradients) and micro-batch: the flat run's all flat, the
  // other's all into the gradients (pieces of one exchange).
  const int reducing_units = static_cast<int>(units.size()) - (mode == "frozen" ? 1 : 0);
  const int expected = kSteps * micro_batches * reducing_units;
  TORCH_CHECK(flat_ops.first == expected && flat_ops.second == 0, "option off: ", flat_ops.first, " flat and ",
              flat_ops.second, " into-gradients reduce-scatters, expected ", expected, " flat");
  TORCH_CHECK(into_ops.first == 0 && into_ops.second == expected, "option on: ", into_ops.first, " flat and ",
              into_ops.second, " into-gradients reduce-scatters, expected ", expected, " into the gradients");

  // Without gradients (none), the flat path copies its reduced row once into the gradients' memory
  // per unit and step; the reduction into the gradients reduces into that memory: no copy.
  if (mode == "none") {
    TORCH_CHECK(flat_copies == expected && into_copies == 0, "copies at the end of the reductions: ", flat_copies,
                " flat (expected ", expected, "), ", into_copies, " into the gradients (expected 0)");
  }
  check_losses_match(flat.losses, want.losses, kTolerance);
  check_losses_match(into.losses, want.losses, kTolerance);
  double worst = check_shards_match(into.model, want.parameters, kTolerance);
  check_shards_match(flat.model, want.parameters, kTolerance);
  // The two sharded runs against each other: rounding only (exactly the same at 2 ranks where
  // every step starts without gradients).
  double apart = 0;
  auto flat_params = flat.model->named_parameters();
  for (const auto& p : into.model->named_parameters()) {
    const at::Tensor& a = p.value();
    const at::Tensor& b = flat_params[p.key()];
    if (a.numel() == 0) continue;
    apart = std::max(apart, ((a - b).abs() / b.abs().clamp_min(1.0)).max().item<double>());
  }
  TORCH_CHECK(apart <= kTolerance, "the two sharded runs differ by ", apart);
  if (mode == "none" && n == 2) TORCH_CHECK(apart == 0, "at 2 ranks without gradients: differ by ", apart);
  // The gradients are rows of one buffer per unit (grads, none, divide, accumulate), or the test's
  // own tensors, added into (replaced). half: the zeroed ones stay in the buffer the first step
  // (no gradients yet) left them, one per unit; in a unit where some have gradients, each of the
  // none ones gets a tensor of its own (write_grads' accumulate, FSDP2's).
  std::map<const void*, size_t> unit_of;
  for (size_t b = 0; b < into.model->blocks.size(); ++b) {
    for (const auto& p : into.model->blocks[b]->parameters()) unit_of[p.unsafeGetTensorImpl()] = b;
  }
  std::set<const void*> storages;
  std::set<size_t> units_zeroed;
  int64_t with_grad = 0, index = 0, set_none = 0;
  for (const auto& p : into.model->parameters()) {
    const bool set_to_none = index++ % 2 == 0;  // as zero_grad's half
    if (!p.grad().defined()) continue;
    ++with_grad;
    storages.insert(p.grad().storage().unsafeGetStorageImpl());
    const auto unit = unit_of.find(p.unsafeGetTensorImpl());
    if (set_to_none) {
      ++set_none;
    } else {
      units_zeroed.insert(unit == unit_of.end() ? into.model->blocks.size() : unit->second);
    }
  }
  const size_t want_storages = mode == "replaced" ? static_cast<size_t>(with_grad)
                               : mode == "half"   ? units_zeroed.size() + static_cast<size_t>(set_none)
                                                  : static_cast<size_t>(reducing_units);
  TORCH_CHECK(with_grad > 0 && storages.size() == want_storages, mode, ": the gradients lie in ", storages.size(),
              " storages, expected ", want_storages);
  if (fsdp::dist::rank() == 0) {
    std::cout << mode << " at " << n << " ranks: " << into_ops.second
              << " reduce-scatters into the gradients, last loss " << into.losses.back() << " (flat "
              << flat.losses.back() << ", single process " << want.losses.back() << "), worst shard difference "
              << worst << ", between the two " << apart << std::endl;
  }
}

struct IntoGradsCase {
  std::string mode;
  int world;
};
class ReduceIntoGrads : public ::testing::TestWithParam<IntoGradsCase> {};

TEST_P(ReduceIntoGrads, MatchesFlatAndSingleProcess) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  o.env["CASE"] = GetParam().mode;
  auto r = run_ranks(GetParam().world, "reduce_into_grads", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, ReduceIntoGrads,
    ::testing::Values(IntoGradsCase{"grads", 2}, IntoGradsCase{"grads", 3}, IntoGradsCase{"none", 2},
                      IntoGradsCase{"none", 3}, IntoGradsCase{"replaced", 2}, IntoGradsCase{"half", 3},
                      IntoGradsCase{"divide", 3}, IntoGradsCase{"accumulate", 2}, IntoGradsCase{"frozen", 3}),
    [](const auto& info) { return info.param.mode + "_" + std::to_string(info.param.world) + "ranks"; });
