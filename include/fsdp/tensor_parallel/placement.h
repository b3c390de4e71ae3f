#pragma once
// Where a tensor-parallel parameter sits in the full one (PyTorch's DTensor placement, for the
// plain local tensors that LibTorch modules hold).
//
//   auto p = fsdp::tp::tp_placement(attn->q->weight);   // after parallelize_module
//   // p->dim == 0: this rank holds rows [p->offset, p->offset + p->size) of p->global_shape
//   // (blocks > 1, a fused q|k|v: those rows of each of the `blocks` equal blocks, concatenated)
//
// parallelize_module replaces a sharded parameter's data by its local slice in place (the tensor
// object stays the same, so module fields, optimizers built later and fully_shard all see the
// local tensor) and records its placement here. fully_shard then shards that TP-local tensor along
// dim 0 over the data-parallel ranks; fsdp::shard_info(p)->tp carries this placement on.
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/mesh/device_mesh.h"

namespace fsdp::tp {

// The layout of an activation across the tp ranks (PyTorch's Replicate() / Shard(dim)).
struct Layout {
  enum class Kind { Replicate, Shard };
  Kind kind = Kind::Replicate;
  int64_t dim = 0;  // Shard only; negative counts from the end
  bool is_shard() const { return kind == Kind::Shard; }
  bool operator==(const Layout& o) const { return kind == o.kind && (kind == Kind::Replicate || dim == o.dim); }
  std::string to_string() const;
};
inline Layout Replicate() { return Layout{}; }
inline Layout Shard(int64_t dim) { return Layout{Layout::Kind::Shard, dim}; }

// A strided placement (blocks > 1, PyTorch's _StridedShard): `dim` of the full parameter is
// `blocks` equal blocks (a fused [q | k | v] projection: 3), each sharded over the tp ranks on its
// own; the local tensor is the concatenation of every block's slice [offset, offset + size), so
// rank r holds the r-th heads of q, of k and of v. blocks == 1: one contiguous slice.
struct TPPlacement {
  DeviceMesh mesh;                    // the 1-D tp mesh
  int64_t dim = 0;                    // the sharded dimension
  std::vector<int64_t> global_shape;  // the full parameter's shape
  int64_t offset = 0;                 // the local tensor holds [offset, offset + size) of `dim`
  int64_t size = 0;                   //   (of each block when blocks > 1)
  int64_t blocks = 1;                 // equal blocks along `dim` sharded separately
  // The length of one block along `dim` in the full parameter.
  int64_t block_len() const { return global_shape[static_cast<size_t>(dim)] / blocks; }
  // The local tensor's length along `dim` (blocks x size).
  int64_t local_len() const { return blocks * size; }
  // Index `i` along `dim` of the local tensor -> its index in the full parameter.
  int64_t global_index(int64_t i) const { return (i / size) * block_len() + offset + i % size; }
};

// The placement of a TP-local parameter (what parallelize_module left in the module), or nullopt
// for a parameter that tensor parallelism does not shard (replicated across the tp ranks).
std::optional<TPPlacement> tp_placement(const at::Tensor& param);

// The full parameter, all-gathered over the tp ranks (collective over the placement's mesh); the
// tensor itself when it is not TP-sharded. For checks and exports, not for training.
at::Tensor gather_full(const at::Tensor& param);

// Rank-major pieces -> block-major order: `t` is the concatenation along `dim` of `ranks` local
// tensors of a strided placement (each `blocks` pieces of `size`); returns the full tensor
// (block b = ranks' b-th pieces in rank order). blocks == 1: `t` itself.
at::Tensor interleave_blocks(const at::Tensor& t, int64_t dim, int64_t ranks, int64_t blocks);

}  // namespace fsdp::tp
