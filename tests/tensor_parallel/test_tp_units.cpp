// Tensor-parallel pieces with real processes: loss_parallel against the gathered cross-entropy,
// the refused plans and meshes (one line naming the problem and the fix), DeviceMesh slicing of
// several dimensions and flattening.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"
#include "tp_model.h"

namespace {

namespace F = torch::nn::functional;
namespace tp = fsdp::tp;
using fsdp::testing::expect_error;

// loss_parallel over vocabulary shards equals cross_entropy of the whole logits (value and
// gradient, within 1e-6), with ignored targets, and moves no logits (no all-gather).
FSDP_RANK_WORKER(loss_parallel_matches) {
  auto mesh = fsdp::init_device_mesh({fsdp::dist::world_size()}, {"tp"});
  const int n = fsdp::dist::world_size(), r = fsdp::dist::rank();
  const int64_t V = 12, vl = V / n;
  auto gen = at::detail::createCPUGenerator(5);
  at::Tensor full = at::randn({3, 5, V}, gen) * 4;
  at::Tensor targets = at::randint(V, {3, 5}, gen, at::kLong);
  targets[1][2] = -100;  // ignored
  targets[2][0] = -100;
  at::Tensor full_leaf = full.clone().requires_grad_(true);
  at::Tensor want =
      F::cross_entropy(full_leaf.view({-1, V}), targets.view(-1), F::CrossEntropyFuncOptions().ignore_index(-100));
  want.backward();
  at::Tensor local = full.narrow(-1, r * vl, vl).clone().requires_grad_(true);
  auto before = fsdp::comm::process_comm_stats().snapshot();
  at::Tensor got = tp::loss_parallel(local, targets, mesh);
  auto moved = fsdp::comm::process_comm_stats().snapshot() - before;
  got.backward();
  const double d = std::abs(got.item<double>() - want.item<double>());
  const double g = (local.grad() - full_leaf.grad().narrow(-1, r * vl, vl)).abs().max().item<double>();
  std::cout << "loss_parallel " << got.item<double>() << " gathered " << want.item<double>() << " |diff| " << d
            << " grad |diff| " << g << " comm " << moved.to_string() << std::endl;
  TORCH_CHECK(d <= 1e-6, "loss differs by ", d);
  TORCH_CHECK(g <= 1e-6, "gradient differs by ", g);
  TORCH_CHECK(moved[fsdp::comm::OpKind::AllGather].calls == 0, "loss_parallel gathered something");
  TORCH_CHECK(moved[fsdp::comm::OpKind::AllReduce].calls == 2, "expected 2 all-reduces, got ",
              moved[fsdp::comm::OpKind::AllReduce].calls);
  expect_error([&] { tp::loss_parallel(local, targets.view(-1).narrow(0, 0, 4), mesh); }, "do not match");
}

std::vector<int64_t> shape_of(fsdp::testing::TPModel& m, const std::string& name) {
  return m->named_parameters()[name].sizes().vec();
}

// Every refusal is one line naming the problem and the fix, and changes nothing.
FSDP_RANK_WORKER(plan_errors) {
  auto mesh2 = fsdp::init_device_mesh({1, 2}, {"dp", "tp"});
  auto mesh = mesh2["tp"];
  fsdp::testing::TPModelConfig c;
  fsdp::testing::TPModel model(c);
  auto q_shape = shape_of(model, "blocks.0.attn.q.weight");
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh, {{"blocks.*.attn.qq", tp::ColwiseParallel{}}});
      },
      "plan entry \"blocks.*.attn.qq\" matches no module");
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh, {{"blocks.*.attn.qq", tp::ColwiseParallel{}}});
      },
      "names look like \"blocks.0.attn.q\"");
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh, {{"blocks.0.ln1", tp::ColwiseParallel{}}});
      },
      "takes Linear or Embedding modules");
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh2, {{"head", tp::ColwiseParallel{}}});
      },
      "pass the 1-D tensor-parallel sub-mesh");
  expect_error(
      [&] {
        tp::parallelize_module(
            model, mesh, {{"blocks.0.attn.q", tp::ColwiseParallel{}}, {"blocks.*.attn.q", tp::RowwiseParallel{}}});
      },
      "is matched by both");
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh, {{"head", tp::ColwiseParallel{.output_layouts = tp::Shard(0)}}});
      },
      "output_layouts Shard(0) is not supported");
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh,
                               {{"blocks.0.attn", tp::PrepareModuleInput{.input_layouts = {tp::Shard(1)}}}});
      },
      "1 input_layouts but 0 desired_input_layouts");
  // A valid entry before a refused one: nothing is applied.
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh,
                               {{"blocks.*.attn.q", tp::ColwiseParallel{}}, {"nope", tp::ColwiseParallel{}}});
      },
      "matches no module");
  TORCH_CHECK(shape_of(model, "blocks.0.attn.q.weight") == q_shape, "a refused plan changed a parameter");
  TORCH_CHECK(!tp::tp_placement(model->named_parameters()["blocks.0.attn.q.weight"]));

  fsdp::testing::TPModelConfig odd;
  odd.vocab = 33;
  fsdp::testing::TPModel odd_model(odd);
  expect_error(
      [&] {
        tp::parallelize_module(odd_model, mesh, {{"head", tp::ColwiseParallel{}}});
      },
      "has 33 output features, which the tp size 2 does not divide");
  expect_error(
      [&] {
        tp::parallelize_module(odd_model, mesh, {{"embed.wte", tp::RowwiseParallel{}}});
      },
      "has 33 vocabulary rows");

  tp::parallelize_module(model, mesh, {{"blocks.*.attn.q", tp::ColwiseParallel{}}});
  expect_error(
      [&] {
        tp::parallelize_module(model, mesh, {{"blocks.0.attn.q", tp::RowwiseParallel{}}});
      },
      "is already parallelized");
  auto p = tp::tp_placement(model->named_parameters()["blocks.1.attn.q.weight"]);
  TORCH_CHECK(p && p->dim == 0 && p->offset == fsdp::dist::rank() * 8 && p->size == 8 &&
              p->global_shape == std::vector<int64_t>({16, 16}));
  // fully_shard over a mesh with the tp dimension: pass the dp part.
  expect_error([&] { fsdp::fully_shard(model, {.mesh = mesh2}); }, "has a \"tp\" dimension");
  // A PrepareModuleInput whose layouts do not match the call.
  fsdp::testing::TPModel m2(c);
  tp::parallelize_module(
      m2, mesh,
      {{"blocks.0.attn", tp::PrepareModuleInput{.input_layouts = {tp::Shard(1), tp::Shard(1)},
                                                .desired_input_layouts = {tp::Replicate(), tp::Replicate()}}}});
  expect_error(
      [&] {
        fsdp::call(m2->typed_blocks[0]->attn, at::randn({2, 4, 16}));
      },
      "was called with 1 tensor arguments");
}

// Several dimensions at once, flattening, 3-D meshes.
FSDP_RANK_WORKER(mesh_slicing) {
  const int me = fsdp::dist::rank();
  auto mesh = fsdp::init_device_mesh({2, 2}, {"dp", "tp"});
  auto both = mesh[{"dp", "tp"}];
  TORCH_CHECK(both.ndim() == 2 && both.size() == 4 && both.get_coordinate() == mesh.get_coordinate());
  auto flat = mesh.flatten();
  TORCH_CHECK(flat.ndim() == 1 && flat.dim_names()[0] == "dp_tp" && flat.size() == 4 && flat.get_local_rank(0) == me);
  auto t = at::full({1}, me, at::kLong);
  flat.comm()->all_reduce(t);
  TORCH_CHECK(t.item<int64_t>() == 6, "flattened group sum ", t.item<int64_t>());
  expect_error([&] { (void)mesh[{"tp", "dp"}]; }, "in the mesh's order");
  expect_error([&] { (void)mesh[{"dp", "pp"}]; }, "no dimension named \"pp\"");

  auto cube = fsdp::init_device_mesh({1, 2, 2}, {"replicate", "shard", "tp"});
  auto dp = cube[{"replicate", "shard"}];
  TORCH_CHECK(dp.ndim() == 2 && dp.size() == 2 && dp.size(0) == 1 && dp.size(1) == 2);
  const std::vector<int> shard_ranks = {me % 2, me % 2 + 2};
  TORCH_CHECK(dp.comm(1)->global_ranks() == shard_ranks, "shard group of rank ", me);
  auto dp_flat = dp.flatten("dp");
  TORCH_CHECK(dp_flat.size() == 2 && dp_flat.get_local_rank(0) == me / 2);
  t.fill_(me);
  dp_flat.comm()->all_reduce(t);
  TORCH_CHECK(t.item<int64_t>() == shard_ranks[0] + shard_ranks[1]);
  // The same flatten again reuses its group (no new one: every rank would have to create it).
  auto again = dp.flatten("dp");
  TORCH_CHECK(again.comm() == dp_flat.comm());
  TORCH_CHECK(cube["tp"].comm()->global_ranks() == (std::vector<int>{me / 2 * 2, me / 2 * 2 + 1}));
}

// Tensor parallel's hooks run under fsdp::call_method as under fsdp::call (one hook mechanism,
// fsdp/hooks/forward_hooks.h): a column-wise Linear with a replicated output, called through a
// method, returns the whole output, equal to the unsharded Linear's.
struct HolderImpl : torch::nn::Module {
  HolderImpl() : lin(register_module("lin", torch::nn::Linear(6, 8))) {}
  torch::nn::Linear lin;
};
TORCH_MODULE(Holder);

FSDP_RANK_WORKER(hooks_under_call_method) {
  auto mesh = fsdp::init_device_mesh({fsdp::dist::world_size()}, {"tp"});
  torch::manual_seed(3);
  Holder m;
  torch::nn::Linear reference(6, 8);
  {
    torch::NoGradGuard no_grad;
    reference->weight.copy_(m->lin->weight);
    reference->bias.copy_(m->lin->bias);
  }
  tp::parallelize_module(m, mesh, {{"lin", tp::ColwiseParallel{.output_layouts = tp::Replicate()}}});
  const at::Tensor x = at::randn({3, 6}, at::detail::createCPUGenerator(4));
  const at::Tensor want = reference(x);
  const at::Tensor via_call = fsdp::call(m->lin, x);
  const at::Tensor via_method = fsdp::call_method(m->lin, &torch::nn::LinearImpl::forward, x);
  TORCH_CHECK(via_call.sizes() == want.sizes(), "fsdp::call gave ", via_call.sizes(), ", want ", want.sizes());
  TORCH_CHECK(via_method.sizes() == want.sizes(), "fsdp::call_method skipped the TP hooks: ", via_method.sizes(),
              " (the local shard), want ", want.sizes());
  TORCH_CHECK(at::allclose(via_method, want, 1e-5, 1e-6), "call_method's output differs from the unsharded Linear");
  TORCH_CHECK(at::allclose(via_call, want, 1e-5, 1e-6), "call's output differs from the unsharded Linear");
}

}  // namespace

TEST(TensorParallelUnits, LossParallelEqualsGatheredCrossEntropy) { EXPECT_RANKS_PASS(2, "loss_parallel_matches"); }
TEST(TensorParallelUnits, RefusedPlansNameTheProblemAndChangeNothing) { EXPECT_RANKS_PASS(2, "plan_errors"); }
TEST(TensorParallelUnits, MeshSlicingFlatteningAndThreeDims) { EXPECT_RANKS_PASS(4, "mesh_slicing"); }
TEST(TensorParallelUnits, HooksRunUnderCallMethod) { EXPECT_RANKS_PASS(2, "hooks_under_call_method"); }
