#pragma once
// Fused CPU optimizers: LibTorch's AdamW, Adam and SGD (momentum, dampening, nesterov, weight
// decay) whose step makes one pass over memory per parameter, multi-threaded. For CPU training and
// for fully_shard's CPUOffloadPolicy, where the optimizer steps on the host over the fp32 shards:
// LibTorch's AdamW issues about thirteen ATen ops per parameter, each one a pass over memory (and
// some a fresh tensor as large as the parameter); these read p, grad and the state once and write
// p and the state once (docs/benchmarks.md, "Fused CPU optimizer").
//
// Each is a subclass of its LibTorch optimizer with the same options and per-parameter state
// classes (torch::optim::AdamWOptions / AdamWParamState, ...), so param_groups(), state(),
// set_lr through the options, save/load (torch::save) and fsdp::checkpoint's optimizer state are
// LibTorch's: a checkpoint saved with torch::optim::AdamW loads into FusedAdamW and back
// (fsdp/checkpoint/optimizer_state.h registers the same keys for both).
//
// The math is LibTorch 1.13's (torch/csrc/api/src/optim/{adamw,adam,sgd}.cpp), term by term in the
// same order and in fp32: AdamW decays the parameter first (p *= 1 - lr * wd), Adam adds the L2
// term to the gradient (g += wd * p); both then update the moments (amsgrad: the running maximum of
// the second), divide by sqrt(v) / sqrt(1 - beta2^t) + eps and step by lr / (1 - beta1^t). Each
// intermediate is rounded where an ATen op rounds it, with a fused multiply-add where ATen's CPU
// kernels use one: the results are LibTorch 1.13's bit for bit (x86-64), and within 2e-7
// relative of LibTorch 2.14's, whose kernels round a little differently (tests/optim allows 1e-6).
//
// Which parameters take the fused path: a CPU, float32, contiguous (strided, dense) parameter whose
// gradient and existing state tensors are CPU, float32, contiguous and of its size. Any other one
// (CUDA, another dtype, a non-contiguous view, a sparse gradient, state loaded in another layout)
// takes the base class's own step for that parameter, so it gets exactly LibTorch's result (and
// LibTorch's error for a sparse gradient). last_step() counts both kinds.
//
// Threads: at::parallel_for over element ranges of each parameter (LibTorch's intra-op threads,
// at::set_num_threads); the loops are plain C++ that the compiler vectorises (AVX-512, AVX + FMA
// or SSE2, chosen at run time).
//
// Example:
//   fsdp::optim::FusedAdamW opt(model->parameters(), torch::optim::AdamWOptions(3e-4).weight_decay(0.1));
//   opt.zero_grad();
//   loss.backward();
//   opt.step();  // the same update as torch::optim::AdamW::step, in one pass per parameter
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cstdint>
#include <vector>

namespace fsdp::optim {

// What the last step() did: parameters updated by the fused loop, and those handed to the base
// class's step (see above). Parameters without a gradient are in neither.
struct FusedStepCounts {
  int64_t fused = 0;
  int64_t fallback = 0;
};

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  at::Tensor step(LossClosure closure = nullptr) override;
  const FusedStepCounts& last_step() const { return last_step_; }

 private:
  FusedStepCounts last_step_;
};

class FusedAdam : public torch::optim::Adam {
 public:
  using torch::optim::Adam::Adam;
  at::Tensor step(LossClosure closure = nullptr) override;
  const FusedStepCounts& last_step() const { return last_step_; }

 private:
  FusedStepCounts last_step_;
};

class FusedSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  at::Tensor step(LossClosure closure = nullptr) override;
  const FusedStepCounts& last_step() const { return last_step_; }

 private:
  FusedStepCounts last_step_;
};

}  // namespace fsdp::optim
