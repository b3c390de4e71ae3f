#include "fsdp/sharding/clip_grad.h"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

#include "fsdp/sharding/fully_shard.h"

namespace fsdp {

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type) {
  if (!(norm_type > 0)) throw std::invalid_argument("fsdp::clip_grad_norm_: norm_type must be positive or infinity");
  const bool inf = std::isinf(norm_type);
  // Partial results per process group of the shards (in order of first appearance: the same on
  // every rank), plus the replicated parameters' part, which every rank already has in full.
  std::vector<std::shared_ptr<comm::Comm>> comms;
  std::vector<double> sharded_part;
  double replicated_part = 0;
  auto combine = [&](double acc, double v) { return inf ? std::max(acc, v) : acc + v; };
  auto local_part = [&](const at::Tensor& g) -> double {
    if (!g.defined() || g.numel() == 0) return 0;
    at::Tensor a = g.detach().abs().to(at::kDouble);
    return inf ? a.max().item<double>() : a.pow(norm_type).sum().item<double>();
  };
  for (const auto& p : parameters) {
    const double part = local_part(p.grad());
    if (auto info = shard_info(p)) {
      auto comm = info->mesh.comm(0);
      size_t i = 0;
      while (i < comms.size() && comms[i] != comm) ++i;
      if (i == comms.size()) {
        comms.push_back(comm);
        sharded_part.push_back(0);
      }
      sharded_part[i] = combine(sharded_part[i], part);
    } else {
      replicated_part = combine(replicated_part, part);
    }
  }
  double total = replicated_part;
  for (size_t i = 0; i < comms.size(); ++i) {
    at::Tensor t = at::tensor({sharded_part[i]}, at::kDouble);
    // NCCL takes CUDA tensors only (the current device: the one this rank computes on).
    if (comms[i]->backend_kind() == comm::BackendKind::Nccl) t = t.to(at::Device(at::kCUDA));
    comms[i]->all_reduce(t, inf ? comm::ReduceOp::Max : comm::ReduceOp::Sum);
    total = combine(total, t.item<double>());
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
