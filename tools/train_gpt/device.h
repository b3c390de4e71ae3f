#pragma once
// --device: where train_gpt computes. One GPU per rank, chosen by LOCAL_RANK.
#include <torch/types.h>

#include <string>

namespace train_gpt {

// "cpu", "cuda" or "auto" (cuda when this LibTorch has CUDA and a GPU is visible, else cpu).
// More local ranks than visible GPUs is an error naming both numbers and the fix, unless
// `share_gpu` (several ranks per GPU; the collectives then go through Gloo, NCCL refuses that).
// Makes the chosen GPU this process's current device. Throws std::invalid_argument (one line).
torch::Device pick_device(const std::string& device, int local_rank, int local_world_size, bool share_gpu);

}  // namespace train_gpt
