#pragma once
// The one-op copies of [Note: one copy kernel per unit] (src/sharding/collectives.cpp), checked on
// a device against their layout written out by hand (torch.chunk's rows, zero padding): on the
// CPU by tests/sharding/test_fused_copies.cpp, on a GPU (CUDA's own kernels) by test_gpu.
// Each check skips what this LibTorch lacks (fsdp/compat/fused_copies.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "fsdp/compat/fused_copies.h"

namespace fsdp::testing {

// Row r of the expected [n, sum of padded chunks]: rank r's rows of each tensor, then zeros up to
// ceil(rows / n) rows (FSDPParam's padded_rows). Computed on the CPU.
inline at::Tensor chunk_rows_by_hand(const std::vector<at::Tensor>& tensors, int64_t n, at::ScalarType dtype) {
  std::vector<at::Tensor> rows_of_rank;
  for (int64_t r = 0; r < n; ++r) {
    std::vector<at::Tensor> parts;
    for (const auto& t : tensors) {
      const int64_t rows = t.size(0), row_numel = t.numel() / rows, padded = (rows + n - 1) / n;
      const int64_t first = std::min(rows, r * padded), count = std::min(padded, rows - first);
      parts.push_back(t.cpu().reshape({rows, row_numel}).narrow(0, first, count).reshape({-1}).to(dtype));
      parts.push_back(at::zeros({(padded - count) * row_numel}, at::TensorOptions().dtype(dtype)));
    }
    rows_of_rank.push_back(at::cat(parts));
  }
  return at::stack(rows_of_rank);
}

// The reduce-scatter input: uneven rows (5 rows at 2-4 ranks), fewer rows than ranks, a 1-D bias,
// a 3-D tensor, each in its own shape as build_reduce_scatter_input passes them (_chunk_cat cuts
// along dim 0 whatever the trailing dims); float32 from float32 and from bf16 (the cast CUDA's
// kernel does inside).
inline void expect_chunk_cat_layout(c10::Device device) {
  torch::manual_seed(1);
  for (const auto& [in_dtype, out_dtype] : {std::pair{at::kFloat, at::kFloat}, std::pair{at::kBFloat16, at::kFloat}}) {
    const auto opts = at::TensorOptions().dtype(in_dtype).device(device);
    const std::vector<at::Tensor> tensors{at::randn({5, 3}).to(opts), at::randn({1, 2}).to(opts),
                                          at::randn({7}).to(opts), at::randn({4, 2, 3}).to(opts)};
    for (int64_t n : {1, 2, 3, 4}) {
      const at::Tensor want = chunk_rows_by_hand(tensors, n, out_dtype);
      at::Tensor out = at::full(want.sizes(), 7.0, at::TensorOptions().dtype(out_dtype).device(device));
      fsdp::compat::chunk_cat_rows(tensors, n, out);  // the 7s in the padding must be overwritten
      EXPECT_TRUE(at::equal(out.cpu(), want)) << n << " ranks, " << c10::toString(in_dtype) << " in, on " << device;
    }
  }
}

// Copy-in under mixed precision: float32 shards cast into a bf16 input's slices.
inline void expect_foreach_copy_cast(c10::Device device) {
  torch::manual_seed(2);
  const std::vector<at::Tensor> shards{at::randn({6}, device), at::randn({2}, device), at::randn({9}, device)};
  at::Tensor input = at::zeros({17}, at::TensorOptions().dtype(at::kBFloat16).device(device));
  const std::vector<at::Tensor> dsts{input.narrow(0, 0, 6), input.narrow(0, 6, 2), input.narrow(0, 8, 9)};
  fsdp::compat::foreach_copy(dsts, shards);
  EXPECT_TRUE(at::equal(input.cpu(), at::cat(shards).to(at::kBFloat16).cpu())) << "on " << device;
}

// Copy-out: the all-gather output [n, total] into each parameter's [n, shard_numel] storage.
inline void expect_split_copy_layout(c10::Device device) {
  torch::manual_seed(3);
  const int64_t n = 3;
  const std::vector<int64_t> sizes{6, 2, 9};
  const at::Tensor gathered = at::randn({n, 17}, device);
  std::vector<at::Tensor> outs;
  for (int64_t s : sizes) outs.push_back(at::empty({n, s}, device));
  at::split_with_sizes_copy_out(outs, gathered, sizes, 1);
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(at::equal(outs[i].cpu(), gathered.narrow(1, offset, sizes[i]).cpu()))
        << "parameter " << i << " on " << device;
    offset += sizes[i];
  }
}

}  // namespace fsdp::testing
