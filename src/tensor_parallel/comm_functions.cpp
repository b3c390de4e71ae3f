#include "fsdp/tensor_parallel/comm_functions.h"

#include <torch/torch.h>

#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "comm_handle.h"
#include "fsdp/debug/profiler.h"

namespace fsdp::tp {

namespace detail {

namespace {
std::mutex g_handles_mu;
std::unordered_map<int64_t, std::weak_ptr<comm::Comm>>& handles() {
  static std::unordered_map<int64_t, std::weak_ptr<comm::Comm>> map;
  return map;
}
}  // namespace

int64_t comm_handle(const std::shared_ptr<comm::Comm>& comm) {
  if (!comm) throw std::invalid_argument("fsdp::tp: no process group given (null Comm)");
  const int64_t key = reinterpret_cast<int64_t>(comm.get());
  std::lock_guard<std::mutex> lock(g_handles_mu);
  handles()[key] = comm;
  return key;
}

std::shared_ptr<comm::Comm> comm_from_handle(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_handles_mu);
  auto it = handles().find(handle);
  auto comm = it == handles().end() ? nullptr : it->second.lock();
  if (!comm) {
    throw std::logic_error(
        "fsdp::tp: the tp process group was destroyed before backward; keep the DeviceMesh alive "
        "until the backward pass has run");
  }
  return comm;
}

int64_t normalize_dim(int64_t dim, int64_t ndim) {
  const int64_t d = dim < 0 ? dim + ndim : dim;
  if (d < 0 || d >= ndim) {
    throw std::invalid_argument("fsdp::tp: dimension " + std::to_string(dim) + " is out of range for a tensor of " +
                                std::to_string(ndim) + " dimensions");
  }
  return d;
}

at::Tensor all_gather_dim(const at::Tensor& x, int64_t dim, comm::Comm& comm) {
  const int64_t d = normalize_dim(dim, x.dim());
  at::Tensor front = x.movedim(d, 0).contiguous();
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] *= comm.size();
  at::Tensor out = at::empty(shape, front.options());
  comm.all_gather_into_tensor(out, front);
  return out.movedim(0, d).contiguous();
}

namespace {
void check_divisible(const at::Tensor& x, int64_t d, int n, const char* what) {
  if (x.size(d) % n != 0) {
    throw std::invalid_argument(std::string("fsdp::tp::") + what + ": size " + std::to_string(x.size(d)) +
                                " along dim " + std::to_string(d) + " is not divisible by the tp size " +
                                std::to_string(n) + "; choose sizes (e.g. the sequence length) the tp size divides");
  }
}
}  // namespace

at::Tensor reduce_scatter_dim(const at::Tensor& x, int64_t dim, comm::Comm& comm) {
  const int64_t d = normalize_dim(dim, x.dim());
  check_divisible(x, d, comm.size(), "reduce_scatter_along_dim");
  at::Tensor front = x.movedim(d, 0).contiguous();
  std::vector<int64_t> shape = front.sizes().vec();
  shape[0] /= comm.size();
  at::Tensor out = at::empty(shape, front.options());
  comm.reduce_scatter_tensor(out, front, comm::ReduceOp::Sum);
  return out.movedim(0, d).contiguous();
}

at::Tensor local_slice(const at::Tensor& x, int64_t dim, const comm::Comm& comm) {
  const int64_t d = normalize_dim(dim, x.dim());
  check_divisible(x, d, comm.size(), "split_along_dim");
  const int64_t n = x.size(d) / comm.size();
  return x.narrow(d, comm.rank() * n, n).contiguous();
}

at::Tensor all_reduce_sum(const at::Tensor& x, comm::Comm& comm) {
  at::Tensor out = x.contiguous().clone();
  comm.all_reduce(out, comm::ReduceOp::Sum);
  return out;
}

at::Tensor all_to_all_dims(const at::Tensor& x, int64_t from_dim, int64_t to_dim, comm::Comm& comm) {
  const profiler::Range range("fsdp::tp_collective", "all_to_all");
  const int64_t a = normalize_dim(from_dim, x.dim()), b = normalize_dim(to_dim, x.dim());
  if (a == b) return x;
  const int64_t n = comm.size();
  if (x.size(b) % n != 0) {
    throw std::invalid_argument("fsdp::tp::shard_to_shard: size " + std::to_string(x.size(b)) + " along dim " +
                                std::to_string(b) + " (the new sharded dim) is not divisible by the tp size " +
                                std::to_string(n) + "; choose sizes the tp size divides, or go through Replicate()");
  }
  // Chunk j along b goes to rank j: [n, ..., size(b) / n, ...], chunk-major.
  std::vector<int64_t> chunked = x.sizes().vec();
  chunked[static_cast<size_t>(b)] /= n;
  chunked.insert(chunked.begin() + b, n);
  at::Tensor in = x.reshape(chunked).movedim(b, 0).contiguous();
  at::Tensor out = at::empty_like(in);
  comm.all_to_all(out, in);
  // out[i]: rank i's slice along a of this rank's chunk along b; rank order along a.
  return out.movedim(0, a).flatten(a, a + 1).contiguous();
}

}  // namespace detail

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using namespace detail;

// Forward op / backward op, chosen per function.
enum class Op { Identity, AllReduce, AllGather, ReduceScatter, Slice };

at::Tensor run(Op op, const at::Tensor& x, int64_t dim, comm::Comm& comm) {
  switch (op) {
    case Op::Identity: return x;
    case Op::AllReduce: {
      const profiler::Range range("fsdp::tp_collective", "all_reduce");
      return all_reduce_sum(x, comm);
    }
    case Op::AllGather: {
      const profiler::Range range("fsdp::tp_collective", "all_gather");
      return all_gather_dim(x, dim, comm);
    }
    case Op::ReduceScatter: {
      const profiler::Range range("fsdp::tp_collective", "reduce_scatter");
      return reduce_scatter_dim(x, dim, comm);
    }
    case Op::Slice: return local_slice(x, dim, comm);
  }
  return x;
}

template <Op Fwd, Op Bwd>
struct Mapping : torch::autograd::Function<Mapping<Fwd, Bwd>> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t handle, int64_t dim) {
    ctx->saved_data["comm"] = handle;
    ctx->saved_data["dim"] = dim;
    auto comm = comm_from_handle(handle);
    at::NoGradGuard no_grad;
    return {run(Fwd, x, dim, *comm)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto comm = comm_from_handle(ctx->saved_data["comm"].toInt());
    const int64_t dim = ctx->saved_data["dim"].toInt();
    at::Tensor g = grads[0].defined() ? run(Bwd, grads[0], dim, *comm) : at::Tensor();
    return {g, at::Tensor(), at::Tensor()};
  }
};

template <Op Fwd, Op Bwd>
at::Tensor apply(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm) {
  const int64_t handle = comm_handle(comm);
  if (comm->size() == 1) return x;  // a group of one: every mapping is the identity
  if (!x.requires_grad() || !torch::GradMode::is_enabled()) {
    at::NoGradGuard no_grad;
    return run(Fwd, x, dim, *comm);
  }
  return Mapping<Fwd, Bwd>::apply(x, handle, dim)[0];
}

}  // namespace

at::Tensor copy_to_tp_region(const at::Tensor& x, const std::shared_ptr<comm::Comm>& comm) {
  return apply<Op::Identity, Op::AllReduce>(x, 0, comm);
}
at::Tensor reduce_from_tp_region(const at::Tensor& x, const std::shared_ptr<comm::Comm>& comm) {
  return apply<Op::AllReduce, Op::Identity>(x, 0, comm);
}
at::Tensor gather_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm) {
  return apply<Op::AllGather, Op::ReduceScatter>(x, dim, comm);
}
at::Tensor reduce_scatter_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm) {
  return apply<Op::ReduceScatter, Op::AllGather>(x, dim, comm);
}
at::Tensor split_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm) {
  return apply<Op::Slice, Op::AllGather>(x, dim, comm);
}
at::Tensor gather_replicated_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm) {
  return apply<Op::AllGather, Op::Slice>(x, dim, comm);
}

namespace {

// Shard(a) -> Shard(b) forward, Shard(b) -> Shard(a) backward: the all-to-all permutes blocks
// between the ranks, and the adjoint of a permutation is its inverse, the all-to-all back.
struct ShardToShard : torch::autograd::Function<ShardToShard> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, int64_t handle, int64_t from, int64_t to) {
    ctx->saved_data["comm"] = handle;
    ctx->saved_data["from"] = from;
    ctx->saved_data["to"] = to;
    auto comm = detail::comm_from_handle(handle);
    at::NoGradGuard no_grad;
    return {detail::all_to_all_dims(x, from, to, *comm)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto comm = detail::comm_from_handle(ctx->saved_data["comm"].toInt());
    const int64_t from = ctx->saved_data["from"].toInt(), to = ctx->saved_data["to"].toInt();
    at::Tensor g = grads[0].defined() ? detail::all_to_all_dims(grads[0], to, from, *comm) : at::Tensor();
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor shard_to_shard(const at::Tensor& x, int64_t from_dim, int64_t to_dim,
                          const std::shared_ptr<comm::Comm>& comm) {
  const int64_t handle = detail::comm_handle(comm);
  const int64_t a = detail::normalize_dim(from_dim, x.dim()), b = detail::normalize_dim(to_dim, x.dim());
  if (comm->size() == 1 || a == b) return x;
  if (!x.requires_grad() || !torch::GradMode::is_enabled()) {
    at::NoGradGuard no_grad;
    return detail::all_to_all_dims(x, a, b, *comm);
  }
  return ShardToShard::apply(x, handle, a, b)[0];
}

}  // namespace fsdp::tp
