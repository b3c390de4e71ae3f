# Which c10d backends this LibTorch offers. Gloo is always there on CPU builds; NCCL only in a
# CUDA build of LibTorch that ships ProcessGroupNCCL (Debian 12's 1.13 is CPU-only).
# FSDP_HAS_CUDA: a CUDA build of LibTorch (the stream code of the sharding runtime is compiled in;
# it still runs only for parameters on a CUDA device).
set(FSDP_HAS_NCCL OFF)
set(FSDP_HAS_CUDA OFF)
if(TORCH_CUDA_LIBRARIES OR CUDA_FOUND)
  set(FSDP_HAS_CUDA ON)
  find_file(FSDP_NCCL_HEADER torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  # The torch pip package keeps NCCL in site-packages/nvidia/nccl (put it on CMAKE_PREFIX_PATH).
  find_path(FSDP_NCCL_INCLUDE nccl.h)
  if(FSDP_NCCL_HEADER AND FSDP_NCCL_INCLUDE)
    set(FSDP_HAS_NCCL ON)
  endif()
endif()
message(STATUS "fsdp: LibTorch ${Torch_VERSION}, CUDA: ${FSDP_HAS_CUDA}, NCCL backend: ${FSDP_HAS_NCCL}"
               " (nccl.h: ${FSDP_NCCL_INCLUDE})")
