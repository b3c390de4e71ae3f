#pragma once
// The data movement around FSDP's collectives (FSDP2's _fsdp_collectives.py), apart from the
// state machine that decides when they run (fsdp_param_group.cpp):
//
//   copy-in        every padded shard of a group side by side in one flat all-gather input
//                  [total], cast to the compute dtype;
//   copy-out       the all-gather output, viewed as [N, total], into each unsharded parameter
//                  (rank r's rows of parameter i sit at [r, offsets[i]]);
//   reduce-scatter input
//                  each unsharded gradient split by rank (padding rows zeroed) into [N, total]
//                  in the reduce dtype;
//   post-forward copy-in
//                  integer reshard_after_forward: the padded shards of the shard ranks this rank
//                  stands for, taken from the unsharded parameters, as [count, total].
#include <ATen/ATen.h>

#include <memory>
#include <utility>
#include <vector>

#include "fsdp_param.h"

namespace fsdp::detail {

using FSDPParams = std::vector<std::unique_ptr<FSDPParam>>;

// input: [total] (flat), in the compute dtype, on the compute device.
void copy_in_all_gather_input(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& input);

// Allocates every unsharded parameter and copies its rows out of `output` ([N * total], flat).
void copy_out_all_gather_output(const FSDPParams& params, const std::vector<int64_t>& offsets,
                                const at::Tensor& output, int64_t total);

// out: [count, total]; out[i] gets shard rank (first_rank + i)'s padded rows of every parameter.
void copy_in_post_forward(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& out,
                          int first_rank);

// The reduce-scatter input of the gradients in `grads` (consumed: each unsharded gradient is freed
// once it is in the input, as FSDP2 does; `grads` is left empty), [n, total] in `dtype`, from the
// buffer pool; `placed` gets each parameter with its column.
at::Tensor build_reduce_scatter_input(std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int n,
                                      at::ScalarType dtype, std::vector<std::pair<FSDPParam*, int64_t>>& placed);

}  // namespace fsdp::detail
