#pragma once
// NCCL's c10d API where LibTorch versions differ; CUDA builds only (FSDP_HAS_NCCL). Each piece is
// detected by feature (a requires-expression on the member), not by version: the CUDA LibTorch we
// build against (Python's torch 2.11) and later ones differ in which of these they have.
//   - the group's bound device, known before the first collective: Backend::setBoundDeviceId
//     (2.11 has it there) or, in the releases that had it, Options::bound_device_id.
//   - eagerConnectSingleDevice (2.3+): makes the communicator now (else lazily, inside the first
//     collective, on the device of its tensors).
//   - shutdown() (2.4+): destroys the communicators cleanly (else only abort(), with c10d's
//     warning that the group was not destroyed, or nothing at exit).
#ifdef FSDP_HAS_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <optional>

namespace fsdp::compat {

// Binds the group to `device` (with an index) before its backend exists; false where the
// Options cannot carry it (then nccl_bind_backend, after construction).
template <typename O = c10d::ProcessGroupNCCL::Options>
inline bool nccl_bind_options(O& opts, const c10::Device& device) {
  if constexpr (requires { opts.bound_device_id = device; }) {
    opts.bound_device_id = device;
    return true;
  } else {
    return false;
  }
}

// Binds the constructed group to `device`; false where this LibTorch cannot.
template <typename P = c10d::ProcessGroupNCCL>
inline bool nccl_bind_backend(P& pg, const c10::Device& device) {
  if constexpr (requires { pg.setBoundDeviceId(std::optional<c10::Device>(device)); }) {
    pg.setBoundDeviceId(std::optional<c10::Device>(device));
    return true;
  } else {
    return false;
  }
}

// Makes the group's communicator on `device` now; false where this LibTorch cannot.
template <typename P = c10d::ProcessGroupNCCL>
inline bool nccl_connect_eagerly(P& pg, const c10::Device& device) {
  if constexpr (requires { pg.eagerConnectSingleDevice(device); }) {
    pg.eagerConnectSingleDevice(device);
    return true;
  } else {
    return false;
  }
}

// Destroys the group's communicators; false where this LibTorch has no clean shutdown.
template <typename P = c10d::ProcessGroupNCCL>
inline bool nccl_shutdown(P& pg) {
  if constexpr (requires { pg.shutdown(); }) {
    pg.shutdown();
    return true;
  } else {
    return false;
  }
}

}  // namespace fsdp::compat
#endif
