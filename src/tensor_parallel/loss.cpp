#include "fsdp/tensor_parallel/loss.h"

#include <torch/torch.h>

#include <stdexcept>

#include "comm_handle.h"

namespace fsdp::tp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct ParallelCrossEntropy : torch::autograd::Function<ParallelCrossEntropy> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& targets,
                               int64_t handle, int64_t ignore_index) {
    auto comm = detail::comm_from_handle(handle);
    at::NoGradGuard no_grad;
    const int64_t vl = logits.size(-1);
    const int64_t first = static_cast<int64_t>(comm->rank()) * vl;
    // Reduce in float32 at least (as cross_entropy does for half inputs).
    const auto acc = (logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16)
                         ? at::kFloat
                         : logits.scalar_type();
    at::Tensor x = logits.reshape({-1, vl}).to(acc);
    at::Tensor t = targets.reshape({-1});
    // 1. The global max per token, for a stable log-sum-exp.
    at::Tensor m = std::get<0>(x.max(-1));
    comm->all_reduce(m, comm::ReduceOp::Max);
    at::Tensor e = (x - m.unsqueeze(1)).exp();
    // 2. The sum of exponentials and the target's logit (held by one rank, zero elsewhere), in
    // one all-reduce.
    at::Tensor valid = t != ignore_index;
    at::Tensor mine = (t >= first).logical_and(t < first + vl).logical_and(valid);
    at::Tensor local_t = (t - first).masked_fill(mine.logical_not(), 0);
    at::Tensor picked = (x.gather(1, local_t.unsqueeze(1)).squeeze(1) - m).masked_fill(mine.logical_not(), 0);
    at::Tensor sums = at::stack({e.sum(-1), picked});
    comm->all_reduce(sums, comm::ReduceOp::Sum);
    at::Tensor sumexp = sums[0], target_logit = sums[1];
    const at::Tensor count = valid.sum().clamp_min(1).to(acc);
    at::Tensor per_token = (sumexp.log() - target_logit).masked_fill(valid.logical_not(), 0);
    at::Tensor loss = per_token.sum() / count;
    ctx->save_for_backward({e / sumexp.unsqueeze(1), local_t, mine, valid, count});
    ctx->saved_data["dtype"] = static_cast<int64_t>(logits.scalar_type());
    ctx->saved_data["shape"] = logits.sizes().vec();
    return {loss.to(logits.scalar_type())};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor softmax = saved[0], local_t = saved[1], mine = saved[2], valid = saved[3], count = saved[4];
    // d loss / d logits = (softmax - one_hot(target)) / count on valid tokens, for this slice.
    at::Tensor g = softmax.clone();
    g.scatter_add_(1, local_t.unsqueeze(1), -mine.to(g.scalar_type()).unsqueeze(1));
    g = g * (valid.to(g.scalar_type()) / count).unsqueeze(1) * grads[0].to(g.scalar_type());
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    g = g.to(dtype).view(ctx->saved_data["shape"].toIntVector());
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor loss_parallel(const at::Tensor& local_logits, const at::Tensor& targets, const DeviceMesh& tp_mesh,
                         int64_t ignore_index) {
  if (tp_mesh.ndim() != 1) {
    throw std::invalid_argument("fsdp::tp::loss_parallel: the mesh " + tp_mesh.to_string() +
                                " is not 1-D; pass the tensor-parallel sub-mesh, e.g. mesh[\"tp\"]");
  }
  if (local_logits.dim() < 1 || targets.numel() * local_logits.size(-1) != local_logits.numel()) {
    throw std::invalid_argument("fsdp::tp::loss_parallel: logits of shape " + c10::str(local_logits.sizes()) +
                                " and targets of shape " + c10::str(targets.sizes()) +
                                " do not match; targets hold one id per row of logits ([..., V/tp] and [...])");
  }
  if (targets.scalar_type() != at::kLong) {
    throw std::invalid_argument("fsdp::tp::loss_parallel: targets must be int64 ids, got " +
                                std::string(c10::toString(targets.scalar_type())));
  }
  const int64_t handle = detail::comm_handle(tp_mesh.comm(0));
  return ParallelCrossEntropy::apply(local_logits, targets, handle, ignore_index)[0];
}

}  // namespace fsdp::tp
