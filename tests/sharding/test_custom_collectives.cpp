// FSDP2's custom collectives (FSDPModule::set_custom_all_gather / set_custom_reduce_scatter,
// fsdp/sharding/custom_collectives.h): N ranks whose units gather and reduce through the test's own
// objects, which allocate the buffers themselves and move the bytes by another route (all-reduces
// of a zeroed buffer instead of an all-gather; an all-reduce and this rank's rows instead of a
// reduce-scatter), against one process on the same global batch, float32 AdamW for 10 steps with
// the uneven GPT. Losses of every step and every final shard must match, and every all-gather and
// reduce-scatter of the units must have gone through the objects, on the buffers they allocated.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <set>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kBatch = 6;  // divisible by 1, 2 and 3
constexpr double kTolerance = 1e-6;

// Remembers the buffers it handed out, so that a call can check it got one of them.
struct Allocations {
  std::set<const void*> made;
  at::Tensor make(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) {
    at::Tensor t =
        at::full(sizes, 7.0, at::TensorOptions().dtype(dtype).device(device));  // not zeros: FSDP writes it all
    made.insert(t.data_ptr());
    return t;
  }
  void check(const at::Tensor& t, const char* what) const {
    TORCH_CHECK(made.count(t.data_ptr()) == 1, what, " is not a buffer this object allocated");
  }
};

// Every rank adds its row into a zeroed output: the sum is each rank's row exactly.
struct SumGather : fsdp::AllGather {
  at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) override {
    return buffers.make(sizes, dtype, device);
  }
  fsdp::comm::Work operator()(const at::Tensor& output, const at::Tensor& input, fsdp::comm::Comm& group,
                              bool async_op) override {
    ++calls;
    buffers.check(output, "the all-gather output");
    const int64_t n = input.numel();
    TORCH_CHECK(
        output.numel() == n * group.size() && input.data_ptr() == output.narrow(0, group.rank() * n, n).data_ptr(),
        "the input must be this rank's row of the output");
    at::Tensor own = input.clone();
    output.zero_();
    output.narrow(0, group.rank() * n, n).copy_(own);
    return group.all_reduce(output, fsdp::comm::ReduceOp::Sum, async_op);
  }
  Allocations buffers;
  int64_t calls = 0;
};

// The whole input reduced everywhere, then this rank's rows kept.
struct AllReduceScatter : fsdp::ReduceScatter {
  at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) override {
    return buffers.make(sizes, dtype, device);
  }
  fsdp::comm::Work operator()(const at::Tensor& output, const at::Tensor& input, fsdp::comm::Comm& group,
                              fsdp::comm::ReduceOp op, bool /*async_op*/) override {
    ++calls;
    ops.insert(op);
    buffers.check(output, "the reduce-scatter output");
    buffers.check(input, "the reduce-scatter input");
    TORCH_CHECK(input.numel() == output.numel() * group.size(), "input ", input.numel(), " vs output ", output.numel());
    at::Tensor sum = input.clone();
    group.all_reduce(sum, op);
    output.copy_(sum.narrow(0, group.rank() * output.numel(), output.numel()));
    return fsdp::comm::Work();  // done
  }
  Allocations buffers;
  int64_t calls = 0;
  std::set<fsdp::comm::ReduceOp> ops;
};

// An allocate that returns the wrong size.
struct ShortGather : SumGather {
  at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) override {
    return at::empty({sizes[0] - 1}, at::TensorOptions().dtype(dtype).device(device));
  }
};

}  // namespace

// CUSTOM: all_gather | reduce_scatter | both | force_sum (the custom reduce-scatter with
// set_force_sum_reduction_for_comms: it must be given Sum, FSDP dividing afterwards) |
// bad_allocate.
FSDP_RANK_WORKER(custom_collectives) {
  const auto config = uneven_config();
  const std::string mode = env("CUSTOM", "both");
  if (mode == "bad_allocate") {
    GPT model = parity_model(config);
    for (auto& block : model->blocks) fsdp::fully_shard(block).set_custom_all_gather(std::make_shared<ShortGather>());
    fsdp::fully_shard(model);
    at::Tensor x = global_batch(config, kBatch, 0, 0).narrow(1, 0, config.block_size);
    try {
      fsdp::call(model, x);
    } catch (const std::exception& e) {
      const std::string what = e.what();
      TORCH_CHECK(
          what.find("unit 'h.0': the custom all-gather's allocate returned") != std::string::npos &&
              what.find("return a contiguous tensor of the sizes, dtype and device it is given") != std::string::npos,
          "unexpected error: ", what);
      return;
    }
    TORCH_CHECK(false, "an allocate of the wrong size was not refused");
  }
  const bool gather = mode == "all_gather" || mode == "both";
  const bool force_sum = mode == "force_sum";
  const bool reduce = mode == "reduce_scatter" || mode == "both" || force_sum;
  TORCH_CHECK(gather || reduce, "unknown CUSTOM ", mode);
  auto gathers = std::make_shared<SumGather>();
  auto reduces = std::make_shared<AllReduceScatter>();
  ShardedRun run;
  run.shard = [&](GPT& model) {
    std::vector<fsdp::FSDPModule> units;
    for (auto& block : model->blocks) units.push_back(fsdp::fully_shard(block));
    units.push_back(fsdp::fully_shard(model));
    for (auto& unit : units) {
      if (gather) unit.set_custom_all_gather(gathers);
      if (reduce) unit.set_custom_reduce_scatter(reduces);
      if (force_sum) unit.set_force_sum_reduction_for_comms(true);
    }
  };
  auto want = train_reference(config, kSteps, kBatch, /*micro_batches=*/1);
  auto got = train_sharded(config, kSteps, kBatch, /*micro_batches=*/1, run);
  check_losses_match(got.losses, want.losses, kTolerance);
  const double worst = check_shards_match(got.model, want.parameters, kTolerance);
  // Per step: forward gathers 2 blocks + the root, backward the 2 blocks again (the root keeps its
  // parameters); every unit reduces once.
  const int64_t blocks = static_cast<int64_t>(got.model->blocks.size());
  TORCH_CHECK(gathers->calls == (gather ? (2 * blocks + 1) * kSteps : 0), "the custom all-gather ran ", gathers->calls,
              " times");
  TORCH_CHECK(reduces->calls == (reduce ? (blocks + 1) * kSteps : 0), "the custom reduce-scatter ran ", reduces->calls,
              " times");
  // Averaged by the collective, unless sums are forced (or nothing is reduced: a world of one).
  const auto want_op = force_sum ? fsdp::comm::ReduceOp::Sum : fsdp::comm::ReduceOp::Avg;
  TORCH_CHECK(
      !reduce || fsdp::dist::world_size() == 1 || (reduces->ops.size() == 1 && *reduces->ops.begin() == want_op),
      "the reduce-scatter was given other ops than ", force_sum ? "Sum" : "Avg");
  if (fsdp::dist::rank() == 0) {
    std::cout << mode << " at " << fsdp::dist::world_size() << " ranks: " << kSteps << " steps, last loss "
              << got.losses.back() << " (single process " << want.losses.back() << "), worst shard difference " << worst
              << "; custom all-gathers " << gathers->calls << ", reduce-scatters " << reduces->calls << std::endl;
  }
}

struct CustomCase {
  std::string mode;
  int world;
};

class CustomCollectives : public ::testing::TestWithParam<CustomCase> {};

TEST_P(CustomCollectives, MatchSingleProcess) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  o.env["CUSTOM"] = GetParam().mode;
  auto r = run_ranks(GetParam().world, "custom_collectives", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

// A world of one: the custom objects are called although FSDP itself would move nothing.
INSTANTIATE_TEST_SUITE_P(Custom, CustomCollectives,
                         ::testing::Values(CustomCase{"all_gather", 2}, CustomCase{"reduce_scatter", 3},
                                           CustomCase{"both", 3}, CustomCase{"both", 1}, CustomCase{"force_sum", 3},
                                           CustomCase{"bad_allocate", 2}),
                         [](const auto& info) {
                           return info.param.mode + "_" + std::to_string(info.param.world) + "ranks";
                         });
