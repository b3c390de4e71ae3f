#pragma once
// The collectives of tensor and sequence parallelism as autograd functions over our Comm: each
// collective in forward is paired with its conjugate in backward (Megatron-LM's mappings). They
// run on the tp group and are counted in its byte counters like every Comm operation.
//
//   forward                         backward                  used by
//   copy_to_tp_region:  identity     all-reduce (sum)          ColwiseParallel, Replicate input
//   reduce_from_tp_region: all-reduce identity                 RowwiseParallel, Replicate output
//   gather_along_dim:   all-gather   reduce-scatter            ColwiseParallel, Shard(d) input (SP)
//   reduce_scatter_along_dim: reduce-scatter  all-gather       RowwiseParallel, Shard(d) output (SP)
//   split_along_dim:    local slice  all-gather                Replicate -> Shard(d) (PrepareModule*)
//   gather_replicated_along_dim: all-gather  local slice       Shard(d) -> Replicate (PrepareModule*,
//                                                              ColwiseParallel Replicate output)
//   shard_to_shard:     all-to-all   all-to-all back           Shard(a) -> Shard(b) (PrepareModule*)
//
// Slices along `dim` are in rank order and equal: the size along `dim` (full, for the splits and
// the reduce-scatter) must be divisible by the group size.
//
// shard_to_shard (DTensor's redistribute Shard(a) -> Shard(b)): x is this rank's slice along
// from_dim; the result is its slice along to_dim of the same full tensor. One all-to-all moves
// (n-1)/n of the local tensor, against the all-gather of the whole tensor that gathering to
// Replicate and slicing again would move. x.size(to_dim) must be divisible by the group size.
#include <ATen/ATen.h>

#include <memory>

#include "fsdp/comm/comm.h"

namespace fsdp::tp {

at::Tensor copy_to_tp_region(const at::Tensor& x, const std::shared_ptr<comm::Comm>& comm);
at::Tensor reduce_from_tp_region(const at::Tensor& x, const std::shared_ptr<comm::Comm>& comm);
at::Tensor gather_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm);
at::Tensor reduce_scatter_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm);
at::Tensor split_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm);
at::Tensor gather_replicated_along_dim(const at::Tensor& x, int64_t dim, const std::shared_ptr<comm::Comm>& comm);
at::Tensor shard_to_shard(const at::Tensor& x, int64_t from_dim, int64_t to_dim,
                          const std::shared_ptr<comm::Comm>& comm);

}  // namespace fsdp::tp
