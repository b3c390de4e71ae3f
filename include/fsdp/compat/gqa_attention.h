#pragma once
// Fused causal attention over fewer key/value heads than query heads (grouped-query attention),
// where this LibTorch's fused op takes them as they are.
//  - 2.5+: at::scaled_dot_product_attention(..., enable_gqa = true): query head h reads KV head
//          h / (heads / kv_heads) inside the kernel (CPU flash kernel included), so the KV heads
//          are never repeated into a [B, heads, T, d] copy, and backward sums each KV head's
//          gradient inside the kernel instead of through the repeat's backward. transformers'
//          sdpa attention takes this path whenever there is no attention mask (use_gqa_in_sdpa).
//  - 2.0-2.4: no enable_gqa argument; 1.13: no fused op at all (attention.h). Callers repeat the
//          KV heads and call fused_causal_attention, or write the attention out.
// Detected by feature, not version, as in attention.h: the eight-argument call is looked up by
// ADL when the template is instantiated, so a LibTorch without the argument makes the concept
// false instead of failing to compile.
#include <ATen/ATen.h>

#include <optional>
#include <stdexcept>

namespace fsdp::compat {

namespace detail {
template <typename T>
concept HasGqaScaledDotProductAttention = requires(const T& q) {
  {scaled_dot_product_attention(q, q, q, {}, 0.0, /*is_causal=*/true, std::optional<double>{}, /*enable_gqa=*/true)};
};
}  // namespace detail

// True when at::scaled_dot_product_attention takes enable_gqa in this LibTorch.
inline constexpr bool kHasGqaFusedAttention = detail::HasGqaScaledDotProductAttention<at::Tensor>;

// softmax(q k^T / sqrt(head_dim), causal) v with q [B, heads, T, d] and k, v [B, kv_heads, T, d]
// (heads a multiple of kv_heads), by the fused op with enable_gqa. Throws std::logic_error when
// this LibTorch lacks it (check kHasGqaFusedAttention first).
template <typename T = at::Tensor>
T fused_causal_gqa_attention(const T& q, const T& k, const T& v) {
  if constexpr (detail::HasGqaScaledDotProductAttention<T>) {
    return scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::optional<double>{},
                                        /*enable_gqa=*/true);
  } else {
    throw std::logic_error(
        "fused_causal_gqa_attention: this LibTorch's scaled_dot_product_attention has no enable_gqa (before 2.5); "
        "repeat the KV heads and use fused_causal_attention (check fsdp::compat::kHasGqaFusedAttention first)");
  }
}

}  // namespace fsdp::compat
