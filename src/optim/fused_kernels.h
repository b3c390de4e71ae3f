#pragma once
// The fused optimizers' loops (fused_kernels.cpp): one pass over elements [begin, end) of one
// parameter, every scalar already converted to float as ATen converts an op's double argument for
// a float tensor. Callers split a parameter into ranges with at::parallel_for. Below, each `=` is
// one ATen op's rounding; `a + s * b` is one fused multiply-add where ATen's kernel fuses it.
#include <cstdint>

namespace fsdp::optim::detail {

// Adam and AdamW (LibTorch's order of operations, per element):
//   p = p * param_scale                                  AdamW's decoupled decay (1: none)
//   g = g + grad_decay * p          if l2                Adam's L2 term
//   m = m * beta1 + one_minus_beta1 * g
//   v = v * beta2 + (one_minus_beta2 * g) * g
//   vmax = max(vmax, v)             if max_exp_avg_sq    amsgrad: the denominator uses vmax
//   p = p + (neg_step_size * m) / (sqrt(v) / sqrt_bias_correction2 + eps)
struct AdamArgs {
  float* param = nullptr;
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  float* max_exp_avg_sq = nullptr;  // null: no amsgrad
  bool l2 = false;
  float param_scale = 1.0f;
  float grad_decay = 0.0f;
  float beta1 = 0, one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float sqrt_bias_correction2 = 1.0f;
  float eps = 0;
  float neg_step_size = 0;
};
void adam_update(const AdamArgs& a, int64_t begin, int64_t end);

// SGD (LibTorch's order, per element):
//   d = g + weight_decay * p        if weight_decay_on
//   b = b * momentum + one_minus_dampening * d, or b = d on the first step     if momentum_buffer
//   d = nesterov ? d + momentum * b : b                                        if momentum_buffer
//   p = p + neg_lr * d
struct SgdArgs {
  float* param = nullptr;
  const float* grad = nullptr;
  float* momentum_buffer = nullptr;  // null: momentum 0
  bool weight_decay_on = false;
  bool first_step = false;  // the buffer is made here: b = d
  bool nesterov = false;
  float weight_decay = 0;
  float momentum = 0;
  float one_minus_dampening = 1.0f;
  float neg_lr = 0;
};
void sgd_update(const SgdArgs& a, int64_t begin, int64_t end);

}  // namespace fsdp::optim::detail
