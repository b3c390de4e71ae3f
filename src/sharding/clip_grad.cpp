#include "fsdp/sharding/clip_grad.h"

#include <torch/torch.h>

#include <cmath>
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
  using Key = std::pair<std::shared_ptr<comm::Comm>, std::shared_ptr<comm::Comm>>;
  std::vector<Key> keys;
  std::vector<double> parts;
  double replicated_part = 0;
  auto combine = [&](double acc, double v) { return inf ? std::max(acc, v) : acc + v; };
  auto local_part = [&](const at::Tensor& g) -> double {
    if (!g.defined() || g.numel() == 0) return 0;
    at::Tensor a = g.detach().abs().to(at::kDouble);
    return inf ? a.max().item<double>() : a.pow(norm_type).sum().item<double>();
  };
  for (const auto& p : parameters) {
    const double part = local_part(p.grad());
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
      parts.push_back(0);
    }
    parts[i] = combine(parts[i], part);
  }
  double total = replicated_part;
  for (size_t i = 0; i < keys.size(); ++i) {
    at::Tensor t = at::tensor({parts[i]}, at::kDouble);
    for (const auto& comm : {keys[i].first, keys[i].second}) {
      if (!comm) continue;
      // NCCL takes CUDA tensors only (the current device: the one this rank computes on).
      if (comm->backend_kind() == comm::BackendKind::Nccl) t = t.to(at::Device(at::kCUDA));
      comm->all_reduce(t, inf ? comm::ReduceOp::Max : comm::ReduceOp::Sum);
    }
    total = combine(total, t.to(at::kCPU).item<double>());
  }
  const double norm = inf ? total : std::pow(total, 1.0 / norm_type);
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
