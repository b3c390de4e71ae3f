// DeviceMesh with real processes: 1-D and 2-D meshes, sub-meshes with their own groups, errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "multiprocess.h"

namespace {
template <typename F>
void expect_invalid(F&& f, const std::string& needle) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(std::string(e.what()).find(needle) != std::string::npos, "message '", e.what(), "' lacks '", needle,
                "'");
    return;
  }
  TORCH_CHECK(false, "expected an error mentioning '", needle, "'");
}
}  // namespace

FSDP_RANK_WORKER(mesh_1d) {
  const int world = fsdp::dist::world_size(), me = fsdp::dist::rank();
  auto mesh = fsdp::init_device_mesh({world}, {"shard"});
  TORCH_CHECK(mesh.ndim() == 1 && mesh.size() == world && mesh.size("shard") == world);
  TORCH_CHECK(mesh.get_local_rank("shard") == me);
  TORCH_CHECK(mesh.get_coordinate() == std::vector<int64_t>{me});
  auto t = at::ones({2});
  mesh.comm("shard")->all_reduce(t);
  TORCH_CHECK(t.eq(world).all().item<bool>());
  TORCH_CHECK(mesh["shard"].size() == world);
  std::cout << mesh.to_string() << std::endl;
}

// 2x2 over 4 ranks: rank = replicate * 2 + shard.
FSDP_RANK_WORKER(mesh_2d) {
  const int me = fsdp::dist::rank();
  auto mesh = fsdp::init_device_mesh({2, 2}, {"replicate", "shard"});
  TORCH_CHECK(mesh.ndim() == 2 && mesh.size() == 4);
  TORCH_CHECK(mesh.get_coordinate() == (std::vector<int64_t>{me / 2, me % 2}), "coordinate of rank ", me);
  TORCH_CHECK(mesh.get_local_rank("replicate") == me / 2 && mesh.get_local_rank("shard") == me % 2);
  auto shard = mesh["shard"];
  auto replicate = mesh["replicate"];
  TORCH_CHECK(shard.ndim() == 1 && shard.size() == 2 && shard.dim_names()[0] == "shard");
  const std::vector<int> shard_ranks = {me / 2 * 2, me / 2 * 2 + 1};
  const std::vector<int> replicate_ranks = {me % 2, me % 2 + 2};
  TORCH_CHECK(shard.comm()->global_ranks() == shard_ranks, "shard group of rank ", me);
  TORCH_CHECK(replicate.comm()->global_ranks() == replicate_ranks, "replicate group of rank ", me);
  TORCH_CHECK(shard.get_local_rank() == me % 2 && replicate.get_local_rank() == me / 2);
  // PyTorch's spelling: get_group is the same group as comm, by index and by name.
  TORCH_CHECK(mesh.get_group("shard") == mesh.comm("shard") && mesh.get_group(1) == mesh.comm(1));
  TORCH_CHECK(mesh.get_group("replicate")->global_ranks() == replicate_ranks);
  // Each sub-mesh's group reduces only over its own ranks.
  auto t = at::full({1}, me, at::kLong);
  shard.comm()->all_reduce(t);
  TORCH_CHECK(t.item<int64_t>() == shard_ranks[0] + shard_ranks[1], "shard sum ", t.item<int64_t>());
  t.fill_(me);
  mesh.comm("replicate")->all_reduce(t);
  TORCH_CHECK(t.item<int64_t>() == replicate_ranks[0] + replicate_ranks[1], "replicate sum ", t.item<int64_t>());
  // A second mesh of the same shape gets groups of its own.
  auto again = fsdp::init_device_mesh({2, 2}, {"replicate", "shard"});
  auto g = at::ones({3});
  again["shard"].comm()->all_gather_into_tensor(at::empty({6}), g);
  expect_invalid([&] { (void)mesh["tensor"]; },
                 "no dimension named \"tensor\"; this mesh has \"replicate\", \"shard\"");
}

FSDP_RANK_WORKER(mesh_errors) {
  const int world = fsdp::dist::world_size();
  expect_invalid([&] { fsdp::init_device_mesh({2, 2}); }, "holds 4 ranks but the world has 3");
  expect_invalid([&] { fsdp::init_device_mesh({world, 1}, {"a", "a"}); }, "\"a\" is used twice");
  expect_invalid([&] { fsdp::init_device_mesh({world}, {"a", "b"}); }, "one name per dimension");
  expect_invalid([&] { fsdp::init_device_mesh({world, 0}); }, "at least one rank");
  expect_invalid([&] { fsdp::init_device_mesh({world}, {}, "tpu"); }, "unknown device type 'tpu'");
  // Still usable after the refused calls.
  auto mesh = fsdp::init_device_mesh({1, world}, {"replicate", "shard"});
  TORCH_CHECK(mesh["replicate"].size() == 1 && mesh["shard"].size() == world);
  auto t = at::ones({1});
  mesh["replicate"].comm()->all_reduce(t);  // a group of one: local
  TORCH_CHECK(t.item<float>() == 1.0f);
}

TEST(DeviceMesh, OneDimensional) {
  EXPECT_RANKS_PASS(2, "mesh_1d");
  EXPECT_RANKS_PASS(3, "mesh_1d");
}

TEST(DeviceMesh, TwoByTwo) { EXPECT_RANKS_PASS(4, "mesh_2d"); }

TEST(DeviceMesh, ErrorsNameTheProblem) { EXPECT_RANKS_PASS(3, "mesh_errors"); }

TEST(DeviceMesh, WorldOfOne) {
  auto mesh = fsdp::init_device_mesh({1}, {"shard"});
  EXPECT_EQ(mesh.size(), 1);
  EXPECT_EQ(mesh.comm()->backend_kind(), fsdp::comm::BackendKind::Local);
  fsdp::dist::destroy_distributed();
}
