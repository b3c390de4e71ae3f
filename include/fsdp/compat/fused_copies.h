#pragma once
// The multi-tensor copies FSDP2 uses for its copy-in and reduce-scatter input, where this
// LibTorch has them ([Note: one copy kernel per unit], src/sharding/collectives.cpp).
//  - 2.1+: at::_foreach_copy_(dsts, srcs): one multi-tensor kernel on CUDA (a cast included, when
//          every source has one dtype and every destination one); a copy each on the CPU.
//  - 2.4+: at::_chunk_cat_out(out, tensors, dim, num_chunks): each tensor cut into num_chunks
//          chunks along dim (the last ones zero-padded), chunk i of every tensor side by side in
//          row i of out. One kernel on CUDA for contiguous tensors of out's dtype or bf16 into
//          float32 (FSDP2's reduce-scatter copy-in); pads and concatenates on the CPU.
//  - 1.13: neither; callers keep a copy per tensor. (split_with_sizes_copy_out, the copy-out's
//          op, exists in 1.13 already: a composite there and on the CPU, one kernel on CUDA 2.3+.)
// Detected by feature, not version: unqualified calls with at::Tensor arguments are found by ADL
// when the template is instantiated (compat/attention.h explains the idiom).
#include <ATen/ATen.h>

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace fsdp::compat {

namespace detail {
template <typename T>
concept HasForeachCopy = requires(const std::vector<T>& a) {
  {_foreach_copy_(c10::ArrayRef<T>(a), c10::ArrayRef<T>(a), false)};
};
template <typename T>
concept HasChunkCat = requires(T& out, const std::vector<T>& a) {
  {_chunk_cat_out(out, c10::ArrayRef<T>(a), int64_t{0}, int64_t{2})};
};
}  // namespace detail

inline constexpr bool kHasForeachCopy = detail::HasForeachCopy<at::Tensor>;
inline constexpr bool kHasChunkCat = detail::HasChunkCat<at::Tensor>;

// dsts[i].copy_(srcs[i]) for every i, as one op. Throws std::logic_error without it (check
// kHasForeachCopy first).
template <typename T = at::Tensor>
void foreach_copy(const std::vector<T>& dsts, const std::vector<T>& srcs) {
  if constexpr (detail::HasForeachCopy<T>) {
    _foreach_copy_(c10::ArrayRef<T>(dsts), c10::ArrayRef<T>(srcs), false);
  } else {
    throw std::logic_error("foreach_copy: this LibTorch has no _foreach_copy_ (1.13); check kHasForeachCopy first");
  }
}

// out [num_chunks, sum of the chunks' elements] gets row i = chunk i of every tensor (cut along
// dim 0, padded with zeros), as one op. Throws std::logic_error without it (check kHasChunkCat).
template <typename T = at::Tensor>
void chunk_cat_rows(const std::vector<T>& tensors, int64_t num_chunks, T& out) {
  if constexpr (detail::HasChunkCat<T>) {
    _chunk_cat_out(out, c10::ArrayRef<T>(tensors), int64_t{0}, num_chunks);
  } else {
    throw std::logic_error("chunk_cat_rows: this LibTorch has no _chunk_cat (before 2.4); check kHasChunkCat first");
  }
}

}  // namespace fsdp::compat
