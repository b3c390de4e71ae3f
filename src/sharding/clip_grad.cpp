#include "fsdp/sharding/clip_grad.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>

#include "fsdp/sharding/fully_shard.h"
#include "fsdp/tensor_parallel/placement.h"

namespace fsdp {

namespace {

// The process groups a parameter is split over: the FSDP shard group, the tensor-parallel group
// (either may be absent).
using PartKey = std::pair<std::shared_ptr<comm::Comm>, std::shared_ptr<comm::Comm>>;

PartKey part_key(const at::Tensor& p) {
  PartKey key;
  if (auto info = shard_info(p)) {
    key.first = info->mesh.comm(0);
    if (info->tp) key.second = info->tp->mesh.comm(0);
  } else if (auto placement = tp::tp_placement(p)) {
    key.second = placement->mesh.comm(0);
  }
  return key;
}

// The device of the first non-empty gradient, else the CPU.
at::Device first_grad_device(const std::vector<at::Tensor>& parameters) {
  for (const auto& p : parameters) {
    if (p.grad().defined() && p.grad().numel() > 0) return p.grad().device();
  }
  return at::Device(at::kCPU);
}

// Partial results per pair of process groups a parameter is split over, in order of first
// appearance: the same on every rank. A part is reduced over each of its groups, so every element
// counts once across dp and tp; parameters split over neither (replicated: every rank holds the
// same values) count once from the local part.
// Every part stays a 0-dim float64 tensor on the device of the first gradient (a GPU's parts
// never visit the host): the host reads the result once, at the end, as PyTorch's
// clip_grad_norm_ with foreach reads none until the caller does.
class NormParts {
 public:
  NormParts(double norm_type, at::Device device)
      : norm_type_(norm_type),
        inf_(std::isinf(norm_type)),
        device_(device),
        opts_(at::TensorOptions().dtype(at::kDouble).device(device)),
        replicated_part_(at::zeros({}, opts_)) {}

  void add(const at::Tensor& p) {
    const at::Tensor& g = p.grad();
    const int part = part_index(part_key(p));
    // Registered above even without a gradient here: every rank reduces the same parts in the same
    // order, and a rank may hold no rows of a parameter that others hold.
    if (!g.defined() || g.numel() == 0) return;
    if (g.scalar_type() != at::kFloat && g.scalar_type() != at::kDouble) {
      at::Tensor& acc = part_at(part);
      acc = combine(acc, local_part(g));
      return;
    }
    auto b = std::find_if(batches_.begin(), batches_.end(), [&](const Batch& x) {
      return x.part == part && x.dtype == g.scalar_type() && x.device == g.device();
    });
    if (b == batches_.end()) b = batches_.insert(batches_.end(), Batch{part, g.scalar_type(), g.device(), {}});
    b->grads.push_back(g.detach());
  }

  // Norms the batched gradients, reduces each part over its groups and sums (or maxes) the parts:
  // the total before the root, still on the device.
  at::Tensor total() {
    for (const Batch& b : batches_) {
      at::Tensor& acc = part_at(b.part);
      acc = combine(acc, batched_part(b.grads));
    }
    at::Tensor total = replicated_part_;
    for (size_t i = 0; i < keys_.size(); ++i) {
      at::Tensor t = parts_[i].reshape({1});
      for (const auto& comm : {keys_[i].first, keys_[i].second}) {
        if (!comm) continue;
        // NCCL takes CUDA tensors only (the current device: the one this rank computes on).
        if (comm->backend_kind() == comm::BackendKind::Nccl && !t.is_cuda()) t = t.to(at::Device(at::kCUDA));
        comm->all_reduce(t, inf_ ? comm::ReduceOp::Max : comm::ReduceOp::Sum);
      }
      total = combine(total, t.to(device_).reshape({}));
    }
    return total;
  }

 private:
  // Per part (replicated: index -1), per dtype and device: the gradients normed together.
  struct Batch {
    int part;
    at::ScalarType dtype;
    at::Device device;
    std::vector<at::Tensor> grads;
  };

  // The part of a parameter split over `key`'s groups (registered on first sight), -1 if none.
  int part_index(const PartKey& key) {
    if (!key.first && !key.second) return -1;
    size_t i = 0;
    while (i < keys_.size() && keys_[i] != key) ++i;
    if (i == keys_.size()) {
      keys_.push_back(key);
      parts_.push_back(at::zeros({}, opts_));
    }
    return static_cast<int>(i);
  }

  at::Tensor& part_at(int part) { return part < 0 ? replicated_part_ : parts_[static_cast<size_t>(part)]; }

  at::Tensor combine(const at::Tensor& acc, const at::Tensor& v) const { return inf_ ? at::maximum(acc, v) : acc + v; }

  // Float and double gradients: each one's norm in its own dtype by one reduction that reads it in
  // place, as LibTorch's and FSDP2's clip_grad_norm_ take each (local) gradient's norm, then raised
  // to the power and summed across gradients and ranks in float64. No gradient-sized temporary: the
  // three that abs, a cast and pow made had their heap pages faulted in again by the next forward.
  // They are gathered per group, dtype and device, and normed by one at::_foreach_norm (one
  // multi-tensor kernel on CUDA, where a norm each was three kernels and a part each: PyTorch's
  // clip_grad_norm_ with foreach does the same).
  at::Tensor batched_part(const std::vector<at::Tensor>& grads) const {
    const at::Tensor n = at::stack(at::_foreach_norm(grads, norm_type_)).to(at::kDouble);
    return (inf_ ? n.max() : n.pow(norm_type_).sum()).to(device_);
  }

  // Other dtypes (bf16, half): one float64 copy each, worked in place.
  at::Tensor local_part(const at::Tensor& g) const {
    at::Tensor a = g.detach().to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);  // never g itself
    if (inf_) return a.abs_().max().to(device_);
    return a.abs_().pow_(norm_type_).sum().to(device_);
  }

  double norm_type_;
  bool inf_;
  at::Device device_;
  at::TensorOptions opts_;
  std::vector<PartKey> keys_;
  std::vector<at::Tensor> parts_;
  at::Tensor replicated_part_;
  std::vector<Batch> batches_;
};

void scale_grads(const std::vector<at::Tensor>& parameters, double coef) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const auto& p : parameters) {
    if (p.grad().defined()) grads.push_back(p.grad());
  }
  if (!grads.empty()) at::_foreach_mul_(grads, coef);  // one multi-tensor kernel per dtype on CUDA
}

}  // namespace

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  if (!(norm_type > 0)) throw std::invalid_argument("fsdp::clip_grad_norm_: norm_type must be positive or infinity");
  const bool inf = std::isinf(norm_type);
  NormParts parts(norm_type, first_grad_device(parameters));
  for (const auto& p : parameters) parts.add(p);
  const double total_value = parts.total().item<double>();  // the one host synchronisation
  const double norm = inf ? total_value : std::pow(total_value, 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);  // as torch::nn::utils::clip_grad_norm_
  if (coef < 1) scale_grads(parameters, coef);
  return norm;
}

}  // namespace fsdp
