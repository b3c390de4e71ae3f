# Which c10d backends this LibTorch offers. Gloo is always there on CPU builds; NCCL only in a
# CUDA build of LibTorch that ships ProcessGroupNCCL (Debian 12's 1.13 is CPU-only).
set(FSDP_HAS_NCCL OFF)
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND)
  find_file(FSDP_NCCL_HEADER torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  find_path(FSDP_NCCL_INCLUDE nccl.h)
  if(FSDP_NCCL_HEADER AND FSDP_NCCL_INCLUDE)
    set(FSDP_HAS_NCCL ON)
  endif()
endif()
message(STATUS "fsdp: LibTorch ${Torch_VERSION}, NCCL backend: ${FSDP_HAS_NCCL}")
