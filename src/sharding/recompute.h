#pragma once
// Whether activation checkpointing is recomputing a checkpointed function on this thread (during
// backward). Set by the activation layer (src/activation), read by FSDP's pre/post-forward.

namespace fsdp::detail {

// Activation checkpointing's recompute (set by the activation layer while a checkpointed function
// runs again during backward): sharded units entered meanwhile behave as in backward (no forward
// prefetch, no reshard before their backward), see FSDPState::pre_forward.
bool in_recompute();
struct RecomputeScope {
  RecomputeScope();
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

}  // namespace fsdp::detail
