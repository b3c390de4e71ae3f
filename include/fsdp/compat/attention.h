#pragma once
// Fused causal attention where this LibTorch has it.
//  - 2.0+: at::scaled_dot_product_attention (softmax(QK^T/sqrt(d) + mask) V in one op: FlashAttention
//          or memory-efficient kernels on GPUs, a fused flash kernel on CPUs, no T x T matrix kept
//          for backward where the kernel allows).
//  - 1.13: absent (only the private, differently shaped _scaled_dot_product_attention); callers
//          keep the written-out matmul / mask / softmax / matmul.
// Detected by feature, not version: an unqualified call with a dependent argument is looked up
// by ADL when the template is instantiated (at::Tensor lives in namespace at), so a missing
// function is a false requirement here, not a compile error.
#include <ATen/ATen.h>

#include <stdexcept>

namespace fsdp::compat {

namespace detail {
template <typename T>
concept HasScaledDotProductAttention = requires(const T& q) {
  {scaled_dot_product_attention(q, q, q, {}, 0.0, /*is_causal=*/true)};
};
}  // namespace detail

// True when at::scaled_dot_product_attention exists in this LibTorch.
inline constexpr bool kHasFusedAttention = detail::HasScaledDotProductAttention<at::Tensor>;

// softmax(q k^T / sqrt(head_dim), causal) v on [B, H, T, head_dim] tensors, by the fused op.
// Throws std::logic_error when this LibTorch lacks it (check kHasFusedAttention first).
template <typename T = at::Tensor>
T fused_causal_attention(const T& q, const T& k, const T& v) {
  if constexpr (detail::HasScaledDotProductAttention<T>) {
    return scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  } else {
    throw std::logic_error(
        "fused_causal_attention: this LibTorch has no scaled_dot_product_attention (1.13); use the written-out "
        "attention (check fsdp::compat::kHasFusedAttention first)");
  }
}

}  // namespace fsdp::compat
