// DeviceMesh::from_group / from_groups with real processes: meshes over process groups made by
// hand (the mesh's comms ARE those groups), a collective along each dim, fully_shard and
// parallelize_module over such a mesh training exactly like over init_device_mesh's, and the
// refused groups and meshes (one line naming the problem and the fix).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"
#include "tp_model.h"

namespace {

namespace tp = fsdp::tp;
using fsdp::DeviceMesh;
using fsdp::testing::expect_error;
using fsdp::testing::TPModel;
using fsdp::testing::TPModelConfig;

// The 2 x 2 groups of rank `me` made by hand: dp = the column {me % 2, me % 2 + 2}, tp = the row
// {2 (me / 2), 2 (me / 2) + 1} (what init_device_mesh({2, 2}, {"dp", "tp"}) would create).
struct HandGroups {
  std::shared_ptr<fsdp::comm::Comm> dp, tp;
};
HandGroups hand_groups(const std::string& prefix) {
  const int me = fsdp::dist::rank();
  HandGroups g;
  g.dp = fsdp::dist::new_group({me % 2, me % 2 + 2}, prefix + "_dp_" + std::to_string(me % 2));
  g.tp = fsdp::dist::new_group({me / 2 * 2, me / 2 * 2 + 1}, prefix + "_tp_" + std::to_string(me / 2));
  return g;
}

int64_t sum_over(const std::shared_ptr<fsdp::comm::Comm>& comm) {
  auto t = at::full({1}, fsdp::dist::rank(), at::kLong);
  comm->all_reduce(t);
  return t.item<int64_t>();
}

FSDP_RANK_WORKER(from_groups_2x2) {
  const int me = fsdp::dist::rank();
  auto g = hand_groups("hand");
  auto mesh = DeviceMesh::from_groups({g.dp, g.tp}, at::arange(4, at::kLong).view({2, 2}), {"dp", "tp"});
  std::cout << mesh.to_string() << std::endl;
  // The groups given, not copies: same objects on the mesh and its sub-meshes.
  TORCH_CHECK(mesh.comm("dp").get() == g.dp.get() && mesh.comm("tp").get() == g.tp.get(),
              "the mesh's comms are not the groups given");
  TORCH_CHECK(mesh["dp"].comm() == g.dp && mesh["tp"].comm() == g.tp);
  const DeviceMesh both = mesh.slice({"dp", "tp"});
  TORCH_CHECK(both.comm(0) == g.dp && both.comm(1) == g.tp);
  TORCH_CHECK(mesh.device_type() == "cpu" && mesh.size() == 4 && mesh.ndim() == 2);
  TORCH_CHECK(mesh.get_coordinate() == (std::vector<int64_t>{me / 2, me % 2}), "coordinate of rank ", me);
  TORCH_CHECK(mesh.get_local_rank("dp") == me / 2 && mesh.get_local_rank("tp") == me % 2);
  // A collective along each dim sums over that dim's ranks only, and runs on the given group.
  const auto tp_before = g.tp->stats().snapshot();
  const int64_t dp_sum = sum_over(mesh["dp"].comm()), tp_sum = sum_over(mesh.comm("tp"));
  std::cout << "rank " << me << ": sum over dp " << dp_sum << ", over tp " << tp_sum << std::endl;
  TORCH_CHECK(dp_sum == (me % 2) + (me % 2 + 2), "dp sum ", dp_sum);
  TORCH_CHECK(tp_sum == 2 * (me / 2 * 2) + 1, "tp sum ", tp_sum);
  TORCH_CHECK((g.tp->stats().snapshot() - tp_before)[fsdp::comm::OpKind::AllReduce].calls == 1);
  // The same groups under another layout: the transposed mesh takes them in the other order.
  auto t = DeviceMesh::from_groups({g.tp, g.dp}, at::arange(4, at::kLong).view({2, 2}).t(), {"a", "b"});
  TORCH_CHECK(t.get_coordinate() == (std::vector<int64_t>{me % 2, me / 2}) && t.comm("a") == g.tp &&
              t.comm("b") == g.dp);
  // Flattening a from_groups mesh makes a group over all four (its own).
  auto flat = mesh.flatten("all");
  TORCH_CHECK(flat.size() == 4 && flat.get_local_rank(0) == me && sum_over(flat.comm()) == 6);
  // 1-D: the world group and a hand-made row.
  auto world = DeviceMesh::from_group(fsdp::dist::world_comm(), "", "dp");
  TORCH_CHECK(world.comm() == fsdp::dist::world_comm() && world.size() == 4 && world.get_local_rank(0) == me &&
              world.dim_names() == std::vector<std::string>{"dp"});
  auto row = DeviceMesh::from_group(g.tp, "cpu");
  TORCH_CHECK(row.comm() == g.tp && row.dim_names() == std::vector<std::string>{"dim0"} &&
              row.get_local_rank(0) == me % 2);
  TORCH_CHECK(row.mesh().equal(at::tensor({me / 2 * 2, me / 2 * 2 + 1}, at::kLong)), "row mesh ", row.mesh());
}

// Every refusal names the problem and the fix; a valid call afterwards still works.
FSDP_RANK_WORKER(from_groups_errors) {
  const int me = fsdp::dist::rank();
  auto g = hand_groups("err");
  const at::Tensor grid = at::arange(4, at::kLong).view({2, 2});
  expect_error([&] { DeviceMesh::from_groups({g.dp}, grid); }, "1 groups for a 2-D mesh; pass one group per dimension");
  expect_error([&] { DeviceMesh::from_groups({g.dp, nullptr}, grid); }, "group 1 is null");
  expect_error([&] { DeviceMesh::from_group(nullptr); }, "from_group: the group is null");
  // The groups swapped: each is checked against the mesh's line along its dimension.
  expect_error(
      [&] {
        DeviceMesh::from_groups({g.tp, g.dp}, grid, {"dp", "tp"});
      },
      "but the mesh's line along \"dp\" through rank " + std::to_string(me));
  expect_error(
      [&] {
        DeviceMesh::from_groups({g.tp, g.dp}, grid, {"dp", "tp"});
      },
      "pass, for each dimension in order, the group of the ranks that differ from this one only along it");
  // The right ranks in another order: [[1, 0], [3, 2]] puts the tp row backwards.
  expect_error(
      [&] {
        DeviceMesh::from_groups({g.dp, g.tp}, grid.flip({1}), {"dp", "tp"});
      },
      "holds ranks [" + std::to_string(me / 2 * 2) + ", " + std::to_string(me / 2 * 2 + 1) +
          "] but the mesh's line along \"tp\"");
  expect_error(
      [&] {
        DeviceMesh::from_groups({g.dp, g.tp}, at::tensor({0, 1, 1, 3}, at::kLong).view({2, 2}));
      },
      "the mesh lists rank 1 twice");
  expect_error(
      [&] {
        DeviceMesh::from_groups({g.dp, g.tp}, at::tensor({0, 1, 2, 7}, at::kLong).view({2, 2}));
      },
      "lists rank 7, outside the world of 4 ranks");
  expect_error(
      [&] {
        DeviceMesh::from_groups({g.dp, g.tp}, at::arange(4, at::kFloat).view({2, 2}));
      },
      "the mesh holds Float values; pass integer global ranks");
  expect_error([&] { DeviceMesh::from_groups({}, at::empty({0}, at::kLong)); }, "the mesh is empty");
  expect_error([&] { DeviceMesh::from_groups({g.dp, g.tp}, grid, {"dp"}); }, "1 dimension names for a 2-D mesh");
  expect_error([&] { DeviceMesh::from_groups({g.dp, g.tp}, grid, {"x", "x"}); }, "\"x\" is used twice");
  expect_error([&] { DeviceMesh::from_groups({g.dp, g.tp}, grid, {}, "tpu"); }, "unknown device type 'tpu'");
  // A mesh of the other row's ranks: this process is not in it.
  const int other = 1 - me / 2;
  expect_error(
      [&] {
        DeviceMesh::from_groups({g.tp}, at::tensor({2 * other, 2 * other + 1}, at::kLong));
      },
      "(global rank " + std::to_string(me) + ") is not in the mesh");
  auto mesh = DeviceMesh::from_groups({g.dp, g.tp}, grid, {"dp", "tp"});
  TORCH_CHECK(sum_over(mesh.comm("tp")) == 2 * (me / 2 * 2) + 1);
}

constexpr int kSteps = 3;
constexpr int64_t kBatch = 4;

struct Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;  // this rank's local shards after the last step
};

// kSteps AdamW steps of the TP test model: TP over tp_mesh (when given), FSDP over dp_mesh, each
// data-parallel rank on its slice of the global batch; the loss averaged over dp.
Run train(const DeviceMesh& dp_mesh, const std::optional<DeviceMesh>& tp_mesh) {
  TPModelConfig c;
  TPModel model(c);
  if (tp_mesh) tp::parallelize_module(model, *tp_mesh, fsdp::testing::tp_plan(false, false));
  fsdp::FullyShardOptions opts{.mesh = dp_mesh};
  for (auto& b : model->typed_blocks) fsdp::fully_shard(b, opts);
  fsdp::fully_shard(model, opts);
  auto opt = fsdp::testing::make_optimizer(*model);
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    at::Tensor batch = fsdp::testing::global_batch(c, s, kBatch, 3000);
    at::Tensor global =
        fsdp::testing::train_step(model, opt, batch, dp_mesh.get_local_rank(0), dp_mesh.size()).clone().reshape({1});
    dp_mesh.comm()->all_reduce(global, fsdp::comm::ReduceOp::Avg);
    run.losses.push_back(global.item<double>());
  }
  run.params = fsdp::testing::snapshot(model);
  return run;
}

// The one-process run on the whole batch.
std::vector<double> reference_losses() {
  TPModelConfig c;
  TPModel ref(c);
  auto opt = fsdp::testing::make_optimizer(*ref);
  std::vector<double> out;
  for (int s = 0; s < kSteps; ++s) {
    out.push_back(fsdp::testing::train_step(ref, opt, fsdp::testing::global_batch(c, s, kBatch, 3000)).item<double>());
  }
  return out;
}

// Bitwise the same run: same losses, same local parameters.
void expect_same_runs(const Run& a, const Run& b, const std::vector<double>& reference, const std::string& what) {
  for (int s = 0; s < kSteps; ++s) {
    std::cout << what << " step " << s << " loss " << a.losses[s] << " (init_device_mesh " << b.losses[s]
              << ", one process " << reference[s] << ")" << std::endl;
    TORCH_CHECK(a.losses[s] == b.losses[s], what, " step ", s, ": loss ", a.losses[s], " vs init_device_mesh's ",
                b.losses[s]);
    TORCH_CHECK(fsdp::testing::rel_diff(a.losses[s], reference[s]) <= 1e-5, what, " step ", s, ": loss ", a.losses[s],
                " vs one process ", reference[s]);
  }
  TORCH_CHECK(a.params.size() == b.params.size());
  for (const auto& [name, p] : a.params) {
    TORCH_CHECK(p.equal(b.params.at(name)), what, ": ", name, " differs from init_device_mesh's run");
  }
}

FSDP_RANK_WORKER(from_groups_train) {
  const auto reference = reference_losses();
  // FSDP over 4 ranks: a 1-D mesh over a Gloo group of all ranks made by hand (not the world's).
  auto all = fsdp::dist::new_cpu_group({0, 1, 2, 3}, "hand_all");
  auto flat = DeviceMesh::from_group(all, "cpu", "dp");
  TORCH_CHECK(flat.comm() == all && all != fsdp::dist::world_comm());
  const auto before = all->stats().snapshot();
  const Run fsdp_groups = train(flat, std::nullopt);
  TORCH_CHECK((all->stats().snapshot() - before)[fsdp::comm::OpKind::ReduceScatter].calls > 0,
              "fully_shard did not use the group given");
  const Run fsdp_init = train(fsdp::init_device_mesh({4}, {"dp"}), std::nullopt);
  expect_same_runs(fsdp_groups, fsdp_init, reference, "FSDP 4");
  // dp 2 x tp 2: parallelize_module over the hand-made rows, fully_shard over the columns.
  auto g = hand_groups("train");
  auto mesh = DeviceMesh::from_groups({g.dp, g.tp}, at::arange(4, at::kLong).view({2, 2}), {"dp", "tp"});
  const auto tp_before = g.tp->stats().snapshot(), dp_before = g.dp->stats().snapshot();
  const Run both_groups = train(mesh["dp"], mesh["tp"]);
  TORCH_CHECK((g.tp->stats().snapshot() - tp_before).total_bytes() > 0 &&
                  (g.dp->stats().snapshot() - dp_before).total_bytes() > 0,
              "training did not run on the groups given");
  auto init = fsdp::init_device_mesh({2, 2}, {"dp", "tp"});
  const Run both_init = train(init["dp"], init["tp"]);
  expect_same_runs(both_groups, both_init, reference, "dp 2 x tp 2");
}

}  // namespace

TEST(DeviceMeshFromGroups, TwoByTwoFromHandMadeGroups) { EXPECT_RANKS_PASS(4, "from_groups_2x2"); }

TEST(DeviceMeshFromGroups, ErrorsNameTheProblemAndTheFix) { EXPECT_RANKS_PASS(4, "from_groups_errors"); }

TEST(DeviceMeshFromGroups, FullyShardAndParallelizeTrainLikeInitDeviceMesh) {
  fsdp::testing::RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  EXPECT_RANKS_PASS(4, "from_groups_train", o);
}

// Without a runtime: a group of one (local collectives).
TEST(DeviceMeshFromGroups, GroupOfOneWithoutARuntime) {
  auto one = fsdp::comm::Comm::single_process("solo");
  auto mesh = DeviceMesh::from_group(one, "", "shard");
  EXPECT_EQ(mesh.comm().get(), one.get());
  EXPECT_EQ(mesh.size(), 1);
  EXPECT_EQ(mesh.device_type(), "cpu");
  EXPECT_ERROR_CONTAINS(DeviceMesh::from_groups({one}, at::full({1}, 1, at::kLong)),
                        "the mesh lists rank 1, outside the world of 1 ranks");
}
