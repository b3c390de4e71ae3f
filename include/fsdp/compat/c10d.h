#pragma once
// Every LibTorch version difference in c10d lives here, guarded by TORCH_VERSION_MAJOR/MINOR.
//
//  - 1.13: backends (ProcessGroupGloo, ...) derive from c10d::ProcessGroup and are used directly.
//  - 2.x : backends derive from c10d::Backend; ProcessGroup became a dispatcher. We hold the
//          backend directly (same collective method names and signatures).
//  - 2.x : TCPStoreOptions::useLibUV defaults to true and throws where LibTorch lacks libuv; the
//          C++ API does not read USE_LIBUV, so we set it from the variable (default off).
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

#include <cstdlib>
#include <string>

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

inline c10d::TCPStoreOptions tcp_store_options() {
  c10d::TCPStoreOptions opts;
#if FSDP_TORCH_AT_LEAST(2, 2)
  const char* uv = std::getenv("USE_LIBUV");
  opts.useLibUV = uv != nullptr && std::string(uv) == "1";
#endif
  return opts;
}

// What the backend can do natively in this LibTorch version. The Comm layer falls back for the rest.
struct GlooCapabilities {
  // 1.13 throws "no support for _allgather_base"; 2.2+ has a native one.
  static constexpr bool all_gather_base = FSDP_TORCH_AT_LEAST(2, 2);
  // Gloo's reduce-scatter (where present) is allreduce + slice: twice a ring's bytes. We always use
  // all_to_all + local sum instead, so this stays false on purpose.
  static constexpr bool reduce_scatter_base = false;
  // GENERATE_ALL_TYPES gained BFloat16 in 2.2 (PR #113557).
  static constexpr bool bfloat16 = FSDP_TORCH_AT_LEAST(2, 2);
  // Gloo rejects ReduceOp::AVG in every version.
  static constexpr bool avg = false;
};

}  // namespace fsdp::compat
