#pragma once
// Every LibTorch version difference in c10d lives here, guarded by TORCH_VERSION_MAJOR/MINOR.
// Checked against Debian 12's LibTorch 1.13.1 and Debian sid's 2.14.1 (scripts/libtorch2-check.sh).
//
//  - 1.13: backends (ProcessGroupGloo, ...) derive from c10d::ProcessGroup and are used directly.
//  - 2.x : backends derive from c10d::Backend; ProcessGroup became a dispatcher. We hold the
//          backend directly (same collective method names and signatures).
//  - 2.x : TCPStoreOptions::useLibUV defaults to true and throws where LibTorch lacks libuv; the
//          C++ API does not read USE_LIBUV, so we set it from the variable (default off).
//  - 2.14: Backend gained the torchcomms names all_gather_single / all_to_all_single /
//          reduce_scatter_single; _allgather_base / alltoall_base / _reduce_scatter_base remain as
//          forwarding aliases (deprecated on ProcessGroup). Call through the helpers below.
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif
// (Gloo's own header, ProcessGroupGloo.hpp, only where a Gloo backend is made: src/comm/backend.cpp.)

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#ifndef TORCH_VERSION_MAJOR
#error "torch/version.h did not define TORCH_VERSION_MAJOR"
#endif

#define FSDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace fsdp::compat {

#if FSDP_TORCH_AT_LEAST(2, 0)
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

// Work::wait's "no timeout" (wait only as the backend's own semantics say: on NCCL a stream wait,
// no host wait). A global constant in c10d's Work.hpp (1.13 through 2.11), not in namespace c10d.
inline constexpr std::chrono::milliseconds kNoWaitTimeout = ::kNoTimeout;

// TCPStore options with this LibTorch's defaults fixed up. Use it for every TCPStore (library,
// launcher and tests alike): a bare TCPStoreOptions{} throws on 2.x builds without libuv.
inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions opts;
#if FSDP_TORCH_AT_LEAST(2, 2)
  const char* uv = std::getenv("USE_LIBUV");
  opts.useLibUV = uv != nullptr && std::string(uv) == "1";
#endif
  return opts;
}

// The flat-tensor collectives under whichever name this LibTorch's Backend has. The new names
// arrived in a 2.x minor release we cannot pin from the headers we have (2.13 or 2.14), so their
// presence is tested directly (templates: a requires-expression on a missing member must be a
// substitution failure, not an error); the version guard keeps 1.13 on the old names.
template <typename B = Backend>
inline WorkPtr all_gather_single(B& backend, at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& opts) {
#if FSDP_TORCH_AT_LEAST(2, 0)
  if constexpr (requires { backend.all_gather_single(out, in, opts); }) {
    return backend.all_gather_single(out, in, opts);
  } else {
    return backend._allgather_base(out, in, opts);
  }
#else
  return backend._allgather_base(out, in, opts);
#endif
}

template <typename B = Backend>
inline WorkPtr all_to_all_single(B& backend, at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                                 std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& opts) {
#if FSDP_TORCH_AT_LEAST(2, 0)
  if constexpr (requires { backend.all_to_all_single(out, in, out_splits, in_splits, opts); }) {
    return backend.all_to_all_single(out, in, out_splits, in_splits, opts);
  } else {
    return backend.alltoall_base(out, in, out_splits, in_splits, opts);
  }
#else
  return backend.alltoall_base(out, in, out_splits, in_splits, opts);
#endif
}

template <typename B = Backend>
inline WorkPtr reduce_scatter_single(B& backend, at::Tensor& out, at::Tensor& in,
                                     const c10d::ReduceScatterOptions& opts) {
#if FSDP_TORCH_AT_LEAST(2, 0)
  if constexpr (requires { backend.reduce_scatter_single(out, in, opts); }) {
    return backend.reduce_scatter_single(out, in, opts);
  } else {
    return backend._reduce_scatter_base(out, in, opts);
  }
#else
  return backend._reduce_scatter_base(out, in, opts);
#endif
}

// What Gloo can do natively in this LibTorch. The Comm layer falls back for the rest. Each flag
// was checked by running the collective on both LibTorch versions (tests/comm covers the paths).
struct GlooCapabilities {
  // 1.13 throws "no support for _allgather_base"; 2.2+ has a native one (2.14: checked).
  static constexpr bool all_gather_base = FSDP_TORCH_AT_LEAST(2, 2);
  // Gloo's reduce-scatter (where present) is allreduce + slice: twice a ring's bytes. We always use
  // all_to_all + local sum instead, so this stays false on purpose.
  static constexpr bool reduce_scatter_base = false;
  // Upstream added BFloat16 (2.2, PR #113557) and always had Half, but which 16-bit floats a Gloo
  // build takes depends on the build, not the version: Debian 12's 1.13 takes Half but not
  // BFloat16, Debian sid's 2.14 takes neither ("Invalid scalar type", every collective), and on
  // 1.13 that error kills the process instead of failing the Work, so it cannot be probed. The
  // fallbacks move the same bytes (16-bit patterns as uint8, reductions in float32), so we only
  // go native where we checked it.
  static constexpr bool bfloat16 = false;
  static constexpr bool float16 = !FSDP_TORCH_AT_LEAST(2, 0);
  // 1.13 rejects ReduceOp::AVG (and the error kills the process); 2.x accepts it but runs SUM then
  // divides, which is what our fallback does: stays false.
  static constexpr bool avg = false;
};

}  // namespace fsdp::compat
