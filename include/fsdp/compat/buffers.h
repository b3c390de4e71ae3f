#pragma once
// LibTorch version differences in how FSDP's CPU buffers may be released.
#include "fsdp/compat/c10d.h"

namespace fsdp::compat {

// Whether a finished collective's CPU buffer may have its memory taken back from its storage at
// wait() (fsdp::detail::release_buffer), while Gloo's worker thread still holds the storage and
// drops it later. On LibTorch 1.13 this is what keeps FSDP's buffers within 5 units (measured,
// whole suite green). On 2.14 test_mesh_from_groups' training died of SIGSEGV in 3 of 14 runs with
// it and 1 of 24 without (so it is not the whole cause; not found yet): 2.x keeps releasing the
// buffer when its storage dies, as before, until the crash is understood.
inline constexpr bool kEarlyBufferRelease = !FSDP_TORCH_AT_LEAST(2, 0);

}  // namespace fsdp::compat
