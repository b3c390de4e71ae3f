#include "fsdp/sharding/clip_grad.h"

#include <torch/torch.h>

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
  auto local_part = [&](const at::Tensor& g) -> at::Tensor {
    if (!g.defined() || g.numel() == 0) return at::zeros({}, opts);
    // A float or double gradient: its norm in its own dtype by one reduction that reads it in place,
    // as LibTorch's and FSDP2's clip_grad_norm_ take each (local) gradient's norm, then raised to the
    // power and summed across gradients and ranks in float64. No gradient-sized temporary: the three
    // that abs, a cast and pow made (65 MB a step on bench's GPT) had their heap pages faulted in again
    // by the next forward. Other dtypes (bf16, half): one float64 copy, worked in place.
    const at::Tensor d = g.detach();
    if (d.scalar_type() == at::kFloat || d.scalar_type() == at::kDouble) {
      const at::Tensor n = at::linalg_vector_norm(d, norm_type).to(at::kDouble);
      return (inf ? n : n.pow(norm_type)).to(*device);
    }
    at::Tensor a = d.to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);  // never g itself
    if (inf) return a.abs_().max().to(*device);
    return a.abs_().pow_(norm_type).sum().to(*device);
  };
  for (const auto& p : parameters) {
    const at::Tensor part = local_part(p.grad());
    Key key;
    if (auto info = shard_info(p)) {
      key.first = info->mesh.comm(0);
      if (info->tp) key.second = info->tp->mesh.comm(0);
    } else if (auto placement = tp::tp_placement(p)) {
      key.second = placement->mesh.comm(0);
    }
    if (!key.first && !key.second) {
      replicated_part = combine(replicated_part, part);
      continue;
    }
    size_t i = 0;
    while (i < keys.size() && keys[i] != key) ++i;
    if (i == keys.size()) {
      keys.push_back(key);
      parts.push_back(at::zeros({}, opts));
    }
    parts[i] = combine(parts[i], part);
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
    for (const auto& p : parameters) {
      if (p.grad().defined()) p.grad().mul_(coef);
    }
  }
  return norm;
}

}  // namespace fsdp
