#pragma once
// Internal helpers of the tensor-parallel layer: process groups passed through autograd
// contexts (as an integer handle, validated through a weak reference), and collectives along a
// dimension.
#include <ATen/ATen.h>

#include <memory>

#include "fsdp/comm/comm.h"

namespace fsdp::tp::detail {

int64_t comm_handle(const std::shared_ptr<comm::Comm>& comm);
std::shared_ptr<comm::Comm> comm_from_handle(int64_t handle);  // throws when the group is gone
int64_t normalize_dim(int64_t dim, int64_t ndim);
at::Tensor all_gather_dim(const at::Tensor& x, int64_t dim, comm::Comm& comm);
at::Tensor reduce_scatter_dim(const at::Tensor& x, int64_t dim, comm::Comm& comm);
at::Tensor local_slice(const at::Tensor& x, int64_t dim, const comm::Comm& comm);
at::Tensor all_reduce_sum(const at::Tensor& x, comm::Comm& comm);
// Shard(from_dim) -> Shard(to_dim) with one all-to-all (comm_functions.h, shard_to_shard).
at::Tensor all_to_all_dims(const at::Tensor& x, int64_t from_dim, int64_t to_dim, comm::Comm& comm);

}  // namespace fsdp::tp::detail
