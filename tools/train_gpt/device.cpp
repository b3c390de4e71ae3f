#include "device.h"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <stdexcept>

namespace train_gpt {

torch::Device pick_device(const std::string& device, int local_rank, int local_world_size, bool share_gpu) {
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (device == "cpu" || (device == "auto" && gpus == 0)) return torch::kCPU;
  if (device != "cuda" && device != "auto") {
    throw std::invalid_argument("--device " + device + ": use cpu, cuda or auto");
  }
  if (gpus == 0) {
    throw std::invalid_argument(
        "--device cuda: no GPU is visible to this process (or this LibTorch has no CUDA); use --device cpu");
  }
  if (local_world_size > gpus && !share_gpu) {
    throw std::invalid_argument(std::to_string(local_world_size) + " ranks on this node but " + std::to_string(gpus) +
                                " GPU(s) visible; start at most " + std::to_string(gpus) +
                                " (fsdprun --nproc-per-node " + std::to_string(gpus) +
                                "), or pass --share-gpu to put several ranks on one GPU (collectives over Gloo)");
  }
  const torch::Device chosen(torch::kCUDA, static_cast<c10::DeviceIndex>(local_rank % gpus));
  c10::impl::VirtualGuardImpl(torch::kCUDA).setDevice(chosen);
  return chosen;
}

}  // namespace train_gpt
