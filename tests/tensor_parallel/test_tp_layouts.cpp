// Layout conversion Shard(a) -> Shard(b) (DTensor's redistribute, one all-to-all over the tp
// group) with real processes: forward and gradients bitwise equal to gathering to Replicate and
// slicing again, the bytes counted as all-to-all, and PrepareModuleInput/Output converting a
// LayerNorm's input from feature-sharded to sequence-sharded and back, equal to one process.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <utility>
#include <vector>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"

namespace {

namespace tp = fsdp::tp;
using fsdp::comm::OpKind;
using fsdp::testing::expect_error;

// The full tensor, the same on every rank (divisible by 2 and 3 along every dim).
at::Tensor full_tensor(uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({6, 6, 12}, gen);
}

at::Tensor slice_of(const at::Tensor& full, int64_t dim, int rank, int n) {
  const int64_t d = dim < 0 ? dim + full.dim() : dim;
  const int64_t size = full.size(d) / n;
  return full.narrow(d, rank * size, size);
}

FSDP_RANK_WORKER(shard_to_shard) {
  auto mesh = fsdp::init_device_mesh({fsdp::dist::world_size()}, {"tp"});
  auto comm = mesh.comm();
  const int n = comm->size(), r = comm->rank();
  const at::Tensor full = full_tensor(11), weight = full_tensor(12);
  for (const auto& [a, b] : std::vector<std::pair<int64_t, int64_t>>{{1, 2}, {2, 1}, {0, 1}, {2, 0}, {1, -1}}) {
    // The conversion, and gathering to Replicate then slicing again, from the same local slice.
    at::Tensor x = slice_of(full, a, r, n).clone().requires_grad_(true);
    at::Tensor x_ref = x.detach().clone().requires_grad_(true);
    const auto before = comm->stats().snapshot();
    at::Tensor y = tp::shard_to_shard(x, a, b, comm);
    (y * slice_of(weight, b, r, n)).sum().backward();
    const auto moved = comm->stats().snapshot() - before;
    at::Tensor y_ref = tp::split_along_dim(tp::gather_replicated_along_dim(x_ref, a, comm), b, comm);
    (y_ref * slice_of(weight, b, r, n)).sum().backward();
    const auto moved_ref = comm->stats().snapshot() - before - moved;
    std::cout << "Shard(" << a << ") -> Shard(" << b << ") at " << n
              << " ranks, forward + backward: " << moved[OpKind::AllToAll].calls << " all-to-alls, "
              << moved.total_bytes() << " B sent; gather-then-reshard " << moved_ref.total_bytes() << " B ("
              << moved_ref.to_string() << ")" << std::endl;
    TORCH_CHECK(y.equal(y_ref), "Shard(", a, ") -> Shard(", b, "): forward differs from gather-then-reshard");
    TORCH_CHECK(y.equal(slice_of(full, b, r, n)), "Shard(", a, ") -> Shard(", b, "): not this rank's slice along ", b);
    TORCH_CHECK(x.grad().equal(x_ref.grad()), "Shard(", a, ") -> Shard(", b,
                "): gradient differs from gather-then-reshard");
    TORCH_CHECK(x.grad().equal(slice_of(weight, a, r, n)), "Shard(", a, ") -> Shard(", b, "): wrong gradient");
    // One all-to-all each way, counted like every collective: (n-1)/n of the local tensor.
    const uint64_t local_bytes = static_cast<uint64_t>(x.numel()) * 4;
    TORCH_CHECK(moved[OpKind::AllToAll].calls == 2 && moved.total_bytes() == moved[OpKind::AllToAll].bytes_sent,
                "expected two all-to-alls and nothing else: ", moved.to_string());
    TORCH_CHECK(moved[OpKind::AllToAll].bytes_sent == 2 * local_bytes * (n - 1) / n, "all-to-all bytes ",
                moved[OpKind::AllToAll].bytes_sent, " vs expected ", 2 * local_bytes * (n - 1) / n);
    TORCH_CHECK(moved.total_bytes() < moved_ref.total_bytes());
  }
  // Without autograd too, and a size the tp size does not divide.
  {
    at::NoGradGuard no_grad;
    TORCH_CHECK(tp::shard_to_shard(slice_of(full, 0, r, n), 0, 2, comm).equal(slice_of(full, 2, r, n)));
  }
  expect_error(
      [&] {
        tp::shard_to_shard(at::zeros({2, 4, 2 * n + 1}), 1, 2, comm);
      },
      "along dim 2 (the new sharded dim) is not divisible by the tp size");
}

struct RootImpl : torch::nn::Module {
  RootImpl() { ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({12}))); }
  torch::nn::LayerNorm ln{nullptr};
};
TORCH_MODULE(Root);

// A LayerNorm between feature-sharded activations: PrepareModuleInput Shard(2) -> Shard(1) gives
// it whole feature rows (a slice of the sequence), PrepareModuleOutput Shard(1) -> Shard(2) hands
// back features, SequenceParallel all-reduces its parameters' gradients. Equal to one process.
FSDP_RANK_WORKER(prepare_module_shard_to_shard) {
  auto mesh = fsdp::init_device_mesh({fsdp::dist::world_size()}, {"tp"});
  auto comm = mesh.comm();
  const int n = comm->size(), r = comm->rank();
  const at::Tensor full = full_tensor(21), weight = full_tensor(22);
  torch::manual_seed(3);
  Root ref, model;
  {
    at::NoGradGuard no_grad;
    ref->ln->weight.uniform_(0.5, 1.5);
    ref->ln->bias.uniform_(-0.5, 0.5);
    model->ln->weight.copy_(ref->ln->weight);
    model->ln->bias.copy_(ref->ln->bias);
  }
  at::Tensor x_ref = full.clone().requires_grad_(true);
  at::Tensor y_ref = ref->ln(x_ref);
  (y_ref * weight).sum().backward();

  tp::parallelize_module(
      model, mesh,
      {
          {"ln", tp::SequenceParallel{}},
          {"ln", tp::PrepareModuleInput{.input_layouts = {tp::Shard(2)}, .desired_input_layouts = {tp::Shard(1)}}},
          {"ln", tp::PrepareModuleOutput{.output_layouts = {tp::Shard(1)}, .desired_output_layouts = {tp::Shard(-1)}}},
      });
  at::Tensor x = slice_of(full, 2, r, n).clone().requires_grad_(true);
  const auto before = comm->stats().snapshot();
  at::Tensor y = fsdp::call(model->ln, x);
  (y * slice_of(weight, 2, r, n)).sum().backward();
  const auto moved = comm->stats().snapshot() - before;
  const double dy = (y - slice_of(y_ref, 2, r, n)).abs().max().item<double>();
  const double dx = (x.grad() - slice_of(x_ref.grad(), 2, r, n)).abs().max().item<double>();
  const double dw = (model->ln->weight.grad() - ref->ln->weight.grad()).abs().max().item<double>();
  const double db = (model->ln->bias.grad() - ref->ln->bias.grad()).abs().max().item<double>();
  std::cout << "LayerNorm through Shard(2) -> Shard(1) -> Shard(2) at " << n << " ranks: |dy| " << dy << " |dx grad| "
            << dx << " |weight grad| " << dw << " |bias grad| " << db << "; " << moved.to_string() << std::endl;
  TORCH_CHECK(y.sizes() == slice_of(full, 2, r, n).sizes(), "output shape ", y.sizes());
  TORCH_CHECK(dy <= 1e-6 && dx <= 1e-5 && dw <= 1e-5 && db <= 1e-5, "differs from one process");
  // Two all-to-alls forward, two back (the conjugates); the parameters' gradients all-reduced.
  TORCH_CHECK(moved[OpKind::AllToAll].calls == 4 && moved[OpKind::AllGather].calls == 0, moved.to_string());
  TORCH_CHECK(moved[OpKind::AllToAll].bytes_sent == 4 * static_cast<uint64_t>(x.numel()) * 4 * (n - 1) / n,
              moved.to_string());
  TORCH_CHECK(moved[OpKind::AllReduce].calls == 2, moved.to_string());
}

}  // namespace

TEST(TensorParallelLayouts, ShardToShardEqualsGatherThenReshardTwoRanks) { EXPECT_RANKS_PASS(2, "shard_to_shard"); }
TEST(TensorParallelLayouts, ShardToShardEqualsGatherThenReshardThreeRanks) { EXPECT_RANKS_PASS(3, "shard_to_shard"); }
TEST(TensorParallelLayouts, PrepareModuleInputOutputShardToShardTwoRanks) {
  EXPECT_RANKS_PASS(2, "prepare_module_shard_to_shard");
}
