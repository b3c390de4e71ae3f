#pragma once
// Gradient clipping for sharded parameters: the norm is taken over the full gradients (every rank's
// shards), so clipping acts exactly as torch::nn::utils::clip_grad_norm_ would in one process.
//
// Example: double norm = fsdp::clip_grad_norm_(model->parameters(), 1.0);   // before optimizer.step()
#include <ATen/ATen.h>

#include <limits>
#include <vector>

namespace fsdp {

// `parameters` may mix shards (from a fully_shard-ed module's parameters()) and ordinary
// parameters whose gradients are the same on every rank (counted once). Every rank of the mesh
// must call it with the same parameters. Tensor-parallel parameters (tp::parallelize_module, with
// or without fully_shard over dp) count every element once across the dp and tp ranks. norm_type: 2.0, 1.0, any p > 0,
// or infinity. Returns the total norm before clipping.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type = 2.0);

}  // namespace fsdp
