#pragma once
// Boxes: the N-dimensional pieces a checkpoint stores and reads (DCP's chunk metadata). A box of a
// tensor of global shape G is (offsets, sizes), one of each per dimension; a 0-d tensor has the
// empty box (no dimensions, one element). Chunks in the index are boxes; so is what a rank holds.
//
// Reading part of a chunk: a chunk's bytes are its box in row-major order, so a region inside it
// is a set of equal-length contiguous byte runs (one run when the region spans whole rows of the
// chunk). `Runs` enumerates them in increasing offset order.
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// Elements of a box of these sizes (1 for no dimensions).
int64_t volume(const std::vector<int64_t>& sizes);

// "[2, 3]"
std::string dims_text(const std::vector<int64_t>& dims);

// The intersection of boxes a and b (same rank); false when it is empty.
bool intersect(const std::vector<int64_t>& a_offsets, const std::vector<int64_t>& a_sizes,
               const std::vector<int64_t>& b_offsets, const std::vector<int64_t>& b_sizes,
               std::vector<int64_t>& offsets, std::vector<int64_t>& sizes);

// Checks that boxes (offsets[i], sizes[i]) tile `shape` exactly: each inside the tensor, none
// overlapping another, together covering every element. Returns "" or the first problem in words
// ("the chunk at [1, 0] of size [3, 3] overlaps the chunk at [0, 0] of size [3, 3]").
std::string tiling_problem(const std::vector<int64_t>& shape, const std::vector<std::vector<int64_t>>& offsets,
                           const std::vector<std::vector<int64_t>>& sizes);

// The contiguous byte runs of the region (rel_offsets, region_sizes) of a row-major array of
// shape `outer` with `element_bytes` per element. Run j starts at offset(j) and is run_bytes()
// long; runs are in increasing offset order, and their concatenation is the region row-major.
class Runs {
 public:
  Runs(const std::vector<int64_t>& outer, const std::vector<int64_t>& rel_offsets,
       const std::vector<int64_t>& region_sizes, int64_t element_bytes);
  int64_t count() const { return count_; }
  uint64_t run_bytes() const { return run_bytes_; }
  uint64_t offset(int64_t j) const;

 private:
  std::vector<int64_t> outer_sizes_;     // region sizes of the dims before the run dim
  std::vector<uint64_t> outer_strides_;  // bytes per step in those dims
  uint64_t base_ = 0;                    // offset of the region's first element
  uint64_t run_bytes_ = 0;
  int64_t count_ = 1;
};

}  // namespace fsdp::checkpoint::detail
