#pragma once
// --optimizer: the LibTorch optimizer train_gpt trains with (adamw | adam | sgd | adagrad |
// rmsprop), or fsdp::optim's fused one (fused-adamw | fused-adam | fused-sgd: the same update in one
// pass over memory per parameter on the CPU, fsdp/optim/fused.h), over the local shards. Every one
// of them is saved and resumed with its state and its param groups' hyperparameters
// (fsdp/checkpoint/optimizer_state.h); a fused one and its LibTorch twin read each other's
// checkpoints.
#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "options.h"

namespace train_gpt {

// adamw: betas (0.9, 0.95) and --weight-decay; adam: betas (0.9, 0.95), no weight decay;
// sgd: momentum 0.9; adagrad, rmsprop: LibTorch's defaults; fused-X: as X. All at --lr (the
// schedule's peak).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Options& o, const std::vector<at::Tensor>& params);

// Sets every param group's learning rate.
void set_lr(torch::optim::Optimizer& opt, double lr);

// Bytes of this rank's optimizer state (every state tensor, plus 8 bytes per scalar).
int64_t optimizer_state_bytes(torch::optim::Optimizer& opt);

}  // namespace train_gpt
