#pragma once
// Why a GPU test cannot run here (empty when it can): the GPU test binaries' one skip rule.
#include <torch/cuda.h>
#include <torch/version.h>

#include <string>

#include "fsdp/comm/backend.h"

namespace fsdp_gpu_test {

// needs_nccl: the test also needs LibTorch's NCCL backend.
inline std::string gpu_skip_reason(bool needs_nccl = false) {
#ifndef FSDP_HAS_CUDA
  (void)needs_nccl;
  return "this LibTorch (" + std::string(TORCH_VERSION) +
         ") is a CPU build: rebuild against a CUDA LibTorch (scripts/cuda-build-check.sh)";
#else
  if (!torch::cuda::is_available()) return "no GPU visible (torch::cuda::is_available() is false)";
  if (needs_nccl && !fsdp::comm::nccl_available()) return "this LibTorch has no NCCL backend";
  return "";
#endif
}

}  // namespace fsdp_gpu_test
