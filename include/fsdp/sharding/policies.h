#pragma once
// Policies of fully_shard, in FSDP2's terms (FullyShardOptions::mp_policy and ::offload_policy),
// both implemented: mixed precision casts the unsharded parameters, the all-gather and the
// compute to param_dtype and reduces gradients in reduce_dtype, keeping fp32 sharded master
// parameters; CPU offload keeps shards and gradients in (pinned, on a GPU) host memory, where the
// optimizer steps.
//
// Example:
//   fsdp::FullyShardOptions opts;
//   opts.mp_policy.param_dtype = at::kBFloat16;      // gather and compute in bf16
//   opts.mp_policy.reduce_dtype = at::kFloat;        // reduce-scatter gradients in fp32
//   opts.offload_policy = fsdp::CPUOffloadPolicy{};  // shards, gradients and the optimizer on the CPU
//   fsdp::fully_shard(block, opts);
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <optional>

namespace fsdp {

// Example: MixedPrecisionPolicy mp; mp.param_dtype = at::kBFloat16; mp.reduce_dtype = at::kFloat;
struct MixedPrecisionPolicy {
  // dtype of the unsharded parameters, the all-gather and the compute (unset: the original dtype)
  std::optional<at::ScalarType> param_dtype;
  // dtype of the gradient reduce-scatter and of local accumulation while sync is off
  std::optional<at::ScalarType> reduce_dtype;
  // cast floating-point outputs of the unit
  std::optional<at::ScalarType> output_dtype;
  // cast floating-point inputs to param_dtype
  bool cast_forward_inputs = true;

  bool is_default() const { return !param_dtype && !reduce_dtype && !output_dtype; }
};

// Sharded parameters and gradients live on the CPU; the optimizer steps there.
// Example: FullyShardOptions o; o.offload_policy = CPUOffloadPolicy{.pin_memory = false};
struct CPUOffloadPolicy {
  bool pin_memory = true;
};

}  // namespace fsdp
