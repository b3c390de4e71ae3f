#pragma once
// Policies of fully_shard, in FSDP2's terms. Their fields exist now; mixed precision and CPU
// offload behaviour come with the next issue, and fully_shard refuses them until then rather than
// silently ignoring them.
#include <c10/core/ScalarType.h>
#include <c10/util/Optional.h>

#include <optional>

namespace fsdp {

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
struct CPUOffloadPolicy {
  bool pin_memory = true;
};

}  // namespace fsdp
