// fsdp_build_info: what this build of the library can do, in one line, then the devices it sees.
//   torch=2.11.0 cuda=yes nccl=yes
//   cuda_devices=1 (NVIDIA H200)
// scripts/cuda-build-check.sh and scripts/gpu-check.sh use it to check that the CUDA paths were
// compiled in, and whether a GPU is visible.
#include <torch/cuda.h>
#include <torch/version.h>

#include <cstdio>

#include "fsdp/comm/backend.h"

int main() {
#ifdef FSDP_HAS_CUDA
  const bool cuda = true;
#else
  const bool cuda = false;
#endif
  std::printf("torch=%s cuda=%s nccl=%s\n", TORCH_VERSION, cuda ? "yes" : "no",
              fsdp::comm::nccl_available() ? "yes" : "no");
  std::printf("cuda_devices=%d\n", static_cast<int>(torch::cuda::device_count()));
  return 0;
}
