// The one-op copies of [Note: one copy kernel per unit] (src/sharding/collectives.cpp) lay the rows
// out exactly as FSDP's own per-parameter copies do. On a GPU they are single kernels that no CPU
// run executes; what the CPU can check is the op's layout, which the CUDA kernels share: this
// file pins it against the layout written out by hand (torch.chunk's rows, zero padding).
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <vector>

#include "fsdp/compat/fused_copies.h"

namespace {

// Row r of the expected [n, sum of padded chunks]: rank r's rows of each tensor, then zeros up to
// ceil(rows / n) rows (FSDPParam's padded_rows).
at::Tensor by_hand(const std::vector<at::Tensor>& tensors, int64_t n, at::ScalarType dtype) {
  std::vector<at::Tensor> rows_of_rank;
  for (int64_t r = 0; r < n; ++r) {
    std::vector<at::Tensor> parts;
    for (const auto& t : tensors) {
      const int64_t rows = t.size(0), row_numel = t.numel() / rows, padded = (rows + n - 1) / n;
      const int64_t first = std::min(rows, r * padded), count = std::min(padded, rows - first);
      parts.push_back(t.reshape({rows, row_numel}).narrow(0, first, count).reshape({-1}).to(dtype));
      parts.push_back(at::zeros({(padded - count) * row_numel}, at::TensorOptions().dtype(dtype)));
    }
    rows_of_rank.push_back(at::cat(parts));
  }
  return at::stack(rows_of_rank);
}

std::vector<at::Tensor> uneven_tensors(at::ScalarType dtype) {
  // 5 rows of 3 (uneven at 2, 3 and 4 ranks), one row (fewer rows than ranks), a bias of 7.
  return {at::randn({5, 3}).to(dtype), at::randn({1, 2}).to(dtype), at::randn({7}).to(dtype)};
}

TEST(FusedCopies, DetectedWhereThisLibTorchHasThem) {
  // The detection is by feature (a requires-expression): a signature it got wrong would turn the
  // one-op paths off in silence and skip the tests below, so the versions that have the ops say so.
  const int version = TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR;
  EXPECT_EQ(fsdp::compat::kHasForeachCopy, version >= 201) << "LibTorch " << TORCH_VERSION;
  EXPECT_EQ(fsdp::compat::kHasChunkCat, version >= 204) << "LibTorch " << TORCH_VERSION;
}

TEST(FusedCopies, ChunkCatLaysOutEachRanksPaddedRows) {
  if (!fsdp::compat::kHasChunkCat)
    GTEST_SKIP() << "this LibTorch has no _chunk_cat (before 2.4): copies stay per parameter";
  torch::manual_seed(1);
  for (const auto [in_dtype, out_dtype] : {std::pair{at::kFloat, at::kFloat}, std::pair{at::kBFloat16, at::kFloat}}) {
    const auto tensors = uneven_tensors(in_dtype);
    for (int64_t n : {1, 2, 3, 4}) {
      const at::Tensor want = by_hand(tensors, n, out_dtype);
      at::Tensor out = at::full(want.sizes(), 7.0, at::TensorOptions().dtype(out_dtype));  // padding must be written
      std::vector<at::Tensor> rows;
      for (const auto& t : tensors) rows.push_back(t.reshape({t.size(0), -1}));
      fsdp::compat::chunk_cat_rows(rows, n, out);
      EXPECT_TRUE(at::equal(out, want)) << n << " ranks, " << c10::toString(in_dtype) << " in\n" << out << "\n" << want;
    }
  }
}

TEST(FusedCopies, ForeachCopyCastsIntoTheInputsSlices) {
  if (!fsdp::compat::kHasForeachCopy)
    GTEST_SKIP() << "this LibTorch has no _foreach_copy_ (1.13): a copy per parameter";
  torch::manual_seed(2);
  const std::vector<at::Tensor> shards{at::randn({6}), at::randn({2}), at::randn({9})};
  at::Tensor input = at::zeros({17}, at::kBFloat16);
  const std::vector<at::Tensor> dsts{input.narrow(0, 0, 6), input.narrow(0, 6, 2), input.narrow(0, 8, 9)};
  fsdp::compat::foreach_copy(dsts, shards);
  EXPECT_TRUE(at::equal(input, at::cat(shards).to(at::kBFloat16)));
}

TEST(FusedCopies, SplitWithSizesCopyFillsEveryRanksRowsOfEachParameter) {
  // The copy-out: the all-gather output [n, total] into each parameter's [n, shard_numel] storage.
  torch::manual_seed(3);
  const int64_t n = 3;
  const std::vector<int64_t> sizes{6, 2, 9};
  const at::Tensor gathered = at::randn({n, 17});
  std::vector<at::Tensor> outs;
  for (int64_t s : sizes) outs.push_back(at::empty({n, s}));
  at::split_with_sizes_copy_out(outs, gathered, sizes, 1);
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_TRUE(at::equal(outs[i], gathered.narrow(1, offset, sizes[i]))) << "parameter " << i;
    offset += sizes[i];
  }
}

}  // namespace
