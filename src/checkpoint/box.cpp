#include "box.h"

#include <algorithm>
#include <numeric>

namespace fsdp::checkpoint::detail {

int64_t volume(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (int64_t s : sizes) n *= s;
  return n;
}

std::string dims_text(const std::vector<int64_t>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

bool intersect(const std::vector<int64_t>& a_offsets, const std::vector<int64_t>& a_sizes,
               const std::vector<int64_t>& b_offsets, const std::vector<int64_t>& b_sizes,
               std::vector<int64_t>& offsets, std::vector<int64_t>& sizes) {
  const size_t n = a_offsets.size();
  offsets.assign(n, 0);
  sizes.assign(n, 0);
  for (size_t d = 0; d < n; ++d) {
    const int64_t lo = std::max(a_offsets[d], b_offsets[d]);
    const int64_t hi = std::min(a_offsets[d] + a_sizes[d], b_offsets[d] + b_sizes[d]);
    if (hi <= lo) return false;
    offsets[d] = lo;
    sizes[d] = hi - lo;
  }
  return true;
}

std::string tiling_problem(const std::vector<int64_t>& shape, const std::vector<std::vector<int64_t>>& offsets,
                           const std::vector<std::vector<int64_t>>& sizes) {
  auto chunk_text = [&](size_t i) {
    return "the chunk at " + dims_text(offsets[i]) + " of size " + dims_text(sizes[i]);
  };
  for (int64_t s : shape)
    if (s < 0) return "the shape " + dims_text(shape) + " has a negative size";
  // Wide sums: a damaged index must not overflow into a false "tiles exactly".
  __int128 total = 1, covered = 0;
  for (int64_t s : shape) total *= s;
  std::vector<size_t> nonempty;
  for (size_t i = 0; i < offsets.size(); ++i) {
    if (offsets[i].size() != shape.size() || sizes[i].size() != shape.size())
      return chunk_text(i) + " has offsets of " + std::to_string(offsets[i].size()) + " and sizes of " +
             std::to_string(sizes[i].size()) + " dimensions, the tensor " + std::to_string(shape.size());
    __int128 v = 1;
    for (size_t d = 0; d < shape.size(); ++d) {
      if (offsets[i][d] < 0 || sizes[i][d] < 0 || offsets[i][d] > shape[d] || sizes[i][d] > shape[d] - offsets[i][d])
        return chunk_text(i) + " lies outside the tensor";
      v *= sizes[i][d];
    }
    covered += v;
    if (v > 0) nonempty.push_back(i);
  }
  // Overlaps: sweep along dim 0 (each chunk is compared only with those that start before it
  // ends there: O(chunks) for row chunks, O(chunks^2) at worst).
  if (!shape.empty()) {
    std::sort(nonempty.begin(), nonempty.end(), [&](size_t a, size_t b) { return offsets[a] < offsets[b]; });
    std::vector<int64_t> o, s;
    for (size_t x = 0; x < nonempty.size(); ++x) {
      const size_t i = nonempty[x];
      for (size_t y = x + 1; y < nonempty.size(); ++y) {
        const size_t j = nonempty[y];
        if (offsets[j][0] >= offsets[i][0] + sizes[i][0]) break;
        if (intersect(offsets[i], sizes[i], offsets[j], sizes[j], o, s))
          return chunk_text(j) + " overlaps " + chunk_text(i);
      }
    }
  } else if (nonempty.size() > 1) {
    return "a 0-d tensor is held by " + std::to_string(nonempty.size()) + " chunks";
  }
  if (covered != total) {
    return "the chunks cover " + std::to_string(static_cast<long long>(covered)) + " of its " +
           std::to_string(static_cast<long long>(total)) + " elements";
  }
  return "";
}

Runs::Runs(const std::vector<int64_t>& outer, const std::vector<int64_t>& rel_offsets,
           const std::vector<int64_t>& region_sizes, int64_t element_bytes) {
  const size_t n = outer.size();
  std::vector<uint64_t> stride(n, static_cast<uint64_t>(element_bytes));
  for (size_t d = n; d-- > 1;) stride[d - 1] = stride[d] * static_cast<uint64_t>(outer[d]);
  for (size_t d = 0; d < n; ++d) base_ += static_cast<uint64_t>(rel_offsets[d]) * stride[d];
  if (n == 0) {
    run_bytes_ = static_cast<uint64_t>(element_bytes);
    return;
  }
  // The run dim k: the outermost dim such that every dim after it is whole in the region.
  size_t k = n - 1;
  while (k > 0 && region_sizes[k] == outer[k]) --k;
  run_bytes_ = static_cast<uint64_t>(region_sizes[k]) * stride[k];
  for (size_t d = 0; d < k; ++d) {
    outer_sizes_.push_back(region_sizes[d]);
    outer_strides_.push_back(stride[d]);
    count_ *= region_sizes[d];
  }
}

uint64_t Runs::offset(int64_t j) const {
  uint64_t off = base_;
  for (size_t d = outer_sizes_.size(); d-- > 0;) {
    off += static_cast<uint64_t>(j % outer_sizes_[d]) * outer_strides_[d];
    j /= outer_sizes_[d];
  }
  return off;
}

}  // namespace fsdp::checkpoint::detail
