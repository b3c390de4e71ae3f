// The fused optimizers' loops: plain loops over float* that GCC vectorises (compiled with
// -fno-math-errno, so sqrt is one instruction, -fopenmp-simd, and -ffp-contract=off;
// src/CMakeLists.txt). Each entry point is built three times, AVX-512, AVX + FMA and SSE2, and the
// loader picks the one the CPU runs (target_clones); no intrinsics.
//
// Rounding as ATen's: each ATen op rounds its result to float, and the ops LibTorch's optimizers
// call compute `a + alpha * b` (add with alpha) and `self + s * t1 * t2` (addcmul) as one fused
// multiply-add (measured against LibTorch 1.13's CPU kernels, vector and scalar paths alike). So
// the compiler may not contract anything here (-ffp-contract=off) and std::fma stands exactly where
// ATen fuses; the results are then LibTorch's bit for bit where the same kernels run. (The SSE2
// build has no FMA instruction: std::fma is a library call there, correct but slow.)
#include "optim/fused_kernels.h"

#include <cmath>

namespace fsdp::optim::detail {

namespace {

// One parameter's range, for one combination of the loop-invariant switches (inlined into each
// target clone below, where it is vectorised for that target).
template <bool kL2, bool kAmsgrad>
inline __attribute__((always_inline)) void adam_loop(const AdamArgs& a, int64_t begin, int64_t end) {
  float* __restrict p = a.param;
  const float* __restrict g = a.grad;
  float* __restrict m = a.exp_avg;
  float* __restrict v = a.exp_avg_sq;
  float* __restrict vmax = a.max_exp_avg_sq;
  const float scale = a.param_scale, decay = a.grad_decay, beta1 = a.beta1, omb1 = a.one_minus_beta1;
  const float beta2 = a.beta2, omb2 = a.one_minus_beta2, sbc2 = a.sqrt_bias_correction2, eps = a.eps;
  const float step = a.neg_step_size;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float pi = p[i] * scale;  // AdamW: p.mul_(1 - lr * wd) (Adam: scale 1, exact)
    float gi = g[i];
    if constexpr (kL2) gi = std::fma(pi, decay, gi);         // Adam: grad.add(p, wd)
    const float mi = std::fma(gi, omb1, m[i] * beta1);       // exp_avg.mul_(beta1).add_(grad, 1 - beta1)
    const float vi = std::fma(omb2 * gi, gi, v[i] * beta2);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
    m[i] = mi;
    v[i] = vi;
    float d = vi;
    if constexpr (kAmsgrad) {
      const float old = vmax[i];  // at::max_out(vmax, v, vmax): NaN from either side propagates
      d = (vi != vi || vi > old) ? vi : old;
      vmax[i] = d;
    }
    p[i] = pi + (step * mi) / (std::sqrt(d) / sbc2 + eps);  // p.addcdiv_(m, sqrt(v) / sqrt(bc2) + eps, -step)
  }
}

template <bool kWeightDecay, bool kMomentum>
inline __attribute__((always_inline)) void sgd_loop(const SgdArgs& a, int64_t begin, int64_t end) {
  float* __restrict p = a.param;
  const float* __restrict g = a.grad;
  float* __restrict buf = a.momentum_buffer;
  const float wd = a.weight_decay, mom = a.momentum, omd = a.one_minus_dampening, lr = a.neg_lr;
  // The first step makes the buffer d itself; later ones b * momentum + (1 - dampening) * d. As
  // selects on loop invariants (vectorised as blends): both sides are cheap.
  const bool first = a.first_step, nesterov = a.nesterov;
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float pi = p[i];
    float di = g[i];
    if constexpr (kWeightDecay) di = std::fma(pi, wd, di);  // d_p.add(p, weight_decay)
    if constexpr (kMomentum) {
      const float bi = first ? di : std::fma(di, omd, buf[i] * mom);  // buf.mul_(momentum).add_(d_p, 1 - dampening)
      buf[i] = bi;
      di = nesterov ? std::fma(bi, mom, di) : bi;  // d_p.add(buf, momentum) or buf
    }
    p[i] = std::fma(di, lr, pi);  // p.add_(d_p, -lr)
  }
}

}  // namespace

__attribute__((target_clones("avx512f", "fma", "default"))) void adam_update(const AdamArgs& a, int64_t begin,
                                                                             int64_t end) {
  if (a.max_exp_avg_sq) {
    if (a.l2)
      adam_loop<true, true>(a, begin, end);
    else
      adam_loop<false, true>(a, begin, end);
  } else {
    if (a.l2)
      adam_loop<true, false>(a, begin, end);
    else
      adam_loop<false, false>(a, begin, end);
  }
}

__attribute__((target_clones("avx512f", "fma", "default"))) void sgd_update(const SgdArgs& a, int64_t begin,
                                                                            int64_t end) {
  if (a.momentum_buffer) {
    if (a.weight_decay_on)
      sgd_loop<true, true>(a, begin, end);
    else
      sgd_loop<false, true>(a, begin, end);
  } else {
    if (a.weight_decay_on)
      sgd_loop<true, false>(a, begin, end);
    else
      sgd_loop<false, false>(a, begin, end);
  }
}

}  // namespace fsdp::optim::detail
