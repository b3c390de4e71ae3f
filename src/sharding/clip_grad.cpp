#include "fsdp/sharding/clip_grad.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "fsdp/sharding/fully_shard.h"
#include "fsdp/tensor_parallel/placement.h"

namespace fsdp {

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  if (!(norm_type > 0)) throw std::invalid_argument("fsdp::clip_grad_norm_: norm_type must be positive or infinity");
  const bool inf = std::isinf(norm_type);
  // Partial results per pair of process groups a parameter is split over (the FSDP shard group,
  // the tensor-parallel group; either may be absent), in order of first appearance: the same on
  // every rank. A part is reduced over each of its groups, so every element counts once across
  // dp and tp; parameters split over neither (replicated: every rank holds the same values) count
  // once from the local part.
  // Every part stays a 0-dim float64 tensor on the device of the first gradient (a GPU's parts
  // never visit the host): the host reads the result once, at the end, as PyTorch's
  // clip_grad_norm_ with foreach reads none until the caller does.
  using Key = std::pair<std::shared_ptr<comm::Comm>, std::shared_ptr<comm::Comm>>;
  std::optional<at::Device> device;
  for (const auto& p : parameters) {
    if (p.grad().defined() && p.grad().numel() > 0) {
      device = p.grad().device();
      break;
    }
  }
  if (!device) device = at::Device(at::kCPU);
  const auto opts = at::TensorOptions().dtype(at::kDouble).device(*device);
  std::vector<Key> keys;
  std::vector<at::Tensor> parts;
  at::Tensor replicated_part = at::zeros({}, opts);
  auto combine = [&](const at::Tensor& acc, const at::Tensor& v) { return inf ? at::maximum(acc, v) : acc + v; };
  // Float and double gradients: each one's norm in its own dtype by one reduction that reads it in
  // place, as LibTorch's and FSDP2's clip_grad_norm_ take each (local) gradient's norm, then raised
  // to the power and summed across gradients and ranks in float64. No gradient-sized temporary: the
  // three that abs, a cast and pow made (65 MB a step on bench's GPT) had their heap pages faulted
  // in again by the next forward. They are gathered per group, dtype and device, and normed by one
  // at::_foreach_norm (one multi-tensor kernel on CUDA, where a norm each was three kernels and a
  // part each: PyTorch's clip_grad_norm_ with foreach does the same).
  auto batched_part = [&](const std::vector<at::Tensor>& grads) -> at::Tensor {
    const at::Tensor n = at::stack(at::_foreach_norm(grads, norm_type)).to(at::kDouble);
    return (inf ? n.max() : n.pow(norm_type).sum()).to(*device);
  };
  // Other dtypes (bf16, half): one float64 copy each, worked in place.
  auto local_part = [&](const at::Tensor& g) -> at::Tensor {
    at::Tensor a = g.detach().to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);  // never g itself
    if (inf) return a.abs_().max().to(*device);
    return a.abs_().pow_(norm_type).sum().to(*device);
  };
  // Per part (replicated: index -1), per dtype and device: the gradients normed together.
  struct Batch {
    int part;
    at::ScalarType dtype;
    at::Device device;
    std::vector<at::Tensor> grads;
  };
  std::vector<Batch> batches;
  for (const auto& p : parameters) {
    const at::Tensor& g = p.grad();
    Key key;
    if (auto info = shard_info(p)) {
      key.first = info->mesh.comm(0);
      if (info->tp) key.second = info->tp->mesh.comm(0);
    } else if (auto placement = tp::tp_placement(p)) {
      key.second = placement->mesh.comm(0);
    }
    int part = -1;
    if (key.first || key.second) {
      size_t i = 0;
      while (i < keys.size() && keys[i] != key) ++i;
      if (i == keys.size()) {
        keys.push_back(key);
        parts.push_back(at::zeros({}, opts));
      }
      part = static_cast<int>(i);
    }
    // Registered above even without a gradient here: every rank reduces the same parts in the same
    // order, and a rank may hold no rows of a parameter that others hold.
    if (!g.defined() || g.numel() == 0) continue;
    at::Tensor& acc = part < 0 ? replicated_part : parts[static_cast<size_t>(part)];
    if (g.scalar_type() != at::kFloat && g.scalar_type() != at::kDouble) {
      acc = combine(acc, local_part(g));
      continue;
    }
    auto b = std::find_if(batches.begin(), batches.end(), [&](const Batch& x) {
      return x.part == part && x.dtype == g.scalar_type() && x.device == g.device();
    });
    if (b == batches.end()) b = batches.insert(batches.end(), Batch{part, g.scalar_type(), g.device(), {}});
    b->grads.push_back(g.detach());
  }
  for (const Batch& b : batches) {
    at::Tensor& acc = b.part < 0 ? replicated_part : parts[static_cast<size_t>(b.part)];
    acc = combine(acc, batched_part(b.grads));
  }
  at::Tensor total = replicated_part;
  for (size_t i = 0; i < keys.size(); ++i) {
    at::Tensor t = parts[i].reshape({1});
    for (const auto& comm : {keys[i].first, keys[i].second}) {
      if (!comm) continue;
      // NCCL takes CUDA tensors only (the current device: the one this rank computes on).
      if (comm->backend_kind() == comm::BackendKind::Nccl && !t.is_cuda()) t = t.to(at::Device(at::kCUDA));
      comm->all_reduce(t, inf ? comm::ReduceOp::Max : comm::ReduceOp::Sum);
    }
    total = combine(total, t.to(*device).reshape({}));
  }
  const double total_value = total.item<double>();  // the one host synchronisation
  const double norm = inf ? total_value : std::pow(total_value, 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);  // as torch::nn::utils::clip_grad_norm_
  if (coef < 1) {
    torch::NoGradGuard no_grad;
    std::vector<at::Tensor> grads;
    for (const auto& p : parameters) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    if (!grads.empty()) at::_foreach_mul_(grads, coef);  // one multi-tensor kernel per dtype on CUDA
  }
  return norm;
}

}  // namespace fsdp
