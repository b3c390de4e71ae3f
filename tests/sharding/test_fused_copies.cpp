// The one-op copies of [Note: one copy kernel per unit] (src/sharding/collectives.cpp) lay the rows
// out exactly as FSDP's own per-parameter copies do. On a GPU they are single kernels that no CPU
// run executes (test_gpu checks those); here the ops' layout on the CPU, and their detection.
#include <gtest/gtest.h>
#include <torch/version.h>

#include "fused_copy_checks.h"

namespace {

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
  fsdp::testing::expect_chunk_cat_layout(at::kCPU);
}

TEST(FusedCopies, ForeachCopyCastsIntoTheInputsSlices) {
  if (!fsdp::compat::kHasForeachCopy)
    GTEST_SKIP() << "this LibTorch has no _foreach_copy_ (1.13): a copy per parameter";
  fsdp::testing::expect_foreach_copy_cast(at::kCPU);
}

TEST(FusedCopies, SplitWithSizesCopyFillsEveryRanksRowsOfEachParameter) {
  fsdp::testing::expect_split_copy_layout(at::kCPU);
}

}  // namespace
