// The thread's activation-checkpointing recompute flag (recompute.h); call wrappers themselves
// live in the module-hook registry (fsdp/hooks/forward_hooks.h).
#include "recompute.h"

namespace fsdp::detail {

namespace {
thread_local int t_recompute_depth = 0;
}  // namespace

bool in_recompute() { return t_recompute_depth > 0; }
RecomputeScope::RecomputeScope() { ++t_recompute_depth; }
RecomputeScope::~RecomputeScope() { --t_recompute_depth; }

}  // namespace fsdp::detail
