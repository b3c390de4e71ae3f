#pragma once
// FSDPParam: one parameter's life under fully_shard (FSDP2's FSDPParam).
//
// Three tensors per parameter:
//   padded_shard    flat [padded_rows * row_numel]: this rank's rows of the full parameter, padded
//                   to ceil(dim0 / N) rows (torch.chunk's layout); the all-gather input, and the
//                   storage the optimizer updates.
//   sharded_param   a leaf view of the unpadded part, shaped [local_rows, ...]: what
//                   module->parameters() returns, what the optimizer holds, where .grad lands.
//   unsharded_param the original tensor object. The module's fields (LinearImpl::weight, ...)
//                   point to it, so forward uses it and autograd saves it.
//
// [Note: sharding along dim d > 0] (FSDP2's shard_placement_fn returning Shard(d)): every storage
// FSDP moves (the padded shard, the all-gather's rows, the unsharded parameter's memory, the
// reduce-scatter's input and output) holds the parameter with dim d moved first, so a "row" is a
// slice along d and the code that copies rows is the same for every d. The tensors the user sees
// keep the parameter's own dim order, as views with permuted strides: the sharded parameter (and
// its gradient) is [.., local rows at d, ..] over its flat shard, and the unsharded parameter,
// over memory laid out dim d first, is a non-contiguous tensor of the full shape (a Shard(1)
// linear weight [out, in] is the transpose of a contiguous [in, out]: its matmul needs no copy).
// Autograd gives the unsharded parameter gradients in its strides (AccumulateGrad's layout
// contract), so take_unsharded_grad's moved view is contiguous without a copy. Rows along d are
// padded as dim-0 rows are (uneven sizes are allowed); a shard group of one shards nothing, so d
// is 0 there.
//
// Note on freeing without breaking autograd: resharding keeps the unsharded tensor object and its
// StorageImpl, and only resizes that storage to zero bytes (and the tensor to zero elements, so a
// forward that bypasses fsdp::call fails on shapes instead of reading freed memory). Unsharding
// re-allocates the same StorageImpl and copies the gathered rows in through a separate alias, so
// the views forward saved for backward (e.g. weight.t()) see the new data, and the parameter's own
// version counter never moves ("modified by an inplace operation" would otherwise fire). On a GPU
// a unit's parameters are re-allocated together, from one allocation (alloc_unsharded_together):
// each storage points into it and keeps it alive, and the last one freed returns it.
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fsdp::detail {

// A registry entry that holds this parameter (tied weights have several).
struct ParamSlot {
  std::weak_ptr<torch::nn::Module> module;  // weak: a replaced submodule may be gone
  std::string name;
  // Where check_unchanged last found the shard in the module's parameter registry (its item
  // index): checked there first, so a step looks no name up.
  mutable size_t registry_index = static_cast<size_t>(-1);
};

// Mixed precision as FSDP2 resolves it per parameter: param_dtype is dropped when it equals the
// original dtype or the parameter is not floating point; reduce_dtype when it equals the
// (resulting) compute dtype.
struct ParamDtypes {
  std::optional<at::ScalarType> param_dtype;
  std::optional<at::ScalarType> reduce_dtype;
};

// CPUOffloadPolicy as it applies to one parameter: the shard (and its gradient) live on the CPU,
// pinned when the compute device is a GPU so the copies to it can be asynchronous.
struct ParamPlacement {
  bool offload_to_cpu = false;
  bool pin_memory = false;
};

class FSDPParam {
 public:
  // shard_dim: the dimension the parameter is split along (FullyShardOptions::shard_placement_fn),
  // normalized to [0, dim); a shard group of one keeps 0. [Note: sharding along dim d > 0].
  FSDPParam(const at::Tensor& original, std::vector<ParamSlot> slots, std::string fqn, int shard_rank, int shard_size,
            const ParamDtypes& dtypes = {}, const ParamPlacement& placement = {}, int64_t shard_dim = 0);

  const std::string& fqn() const { return fqn_; }
  void set_fqn(std::string fqn) { fqn_ = std::move(fqn); }
  const std::vector<int64_t>& global_shape() const { return global_shape_; }
  // Rows are slices along shard_dim() (dim 0 but for shard_placement_fn); row_numel() values each.
  int64_t shard_dim() const { return shard_dim_; }
  int64_t rows() const { return rows_; }
  int64_t row_numel() const { return row_numel_; }
  int64_t padded_rows() const { return padded_rows_; }
  int64_t shard_numel() const { return padded_rows_ * row_numel_; }  // the same on every rank
  int64_t local_rows() const { return local_rows_; }
  int64_t dim0_offset() const { return dim0_offset_; }
  at::ScalarType dtype() const { return padded_shard_.scalar_type(); }  // original = sharded dtype
  at::ScalarType compute_dtype() const { return compute_dtype_; }       // unsharded / all-gather
  at::ScalarType reduce_dtype() const { return reduce_dtype_; }         // reduce-scatter
  c10::Device device() const { return unsharded_param_.device(); }      // where forward computes
  c10::Device shard_device() const { return padded_shard_.device(); }   // CPU when offloaded

  const at::Tensor& padded_shard() const { return padded_shard_; }
  const at::Tensor& sharded_param() const { return sharded_param_; }
  const at::Tensor& unsharded_param() const { return unsharded_param_; }
  const std::vector<ParamSlot>& slots() const { return slots_; }

  bool is_unsharded() const { return unsharded_; }
  void alloc_unsharded();
  // Frees the unsharded parameter's memory; it shows zero elements until the next alloc.
  // keep_shape (FSDPModule::set_unshard_in_backward(false)): it keeps its full shape over no
  // memory instead, for the gradient autograd sets on it ([Note: unshard_in_backward] in
  // fsdp_param_group.h); drop_kept_shape() then makes it zero elements, as free_unsharded() does.
  void free_unsharded(bool keep_shape = false);
  void drop_kept_shape();
  // alloc_unsharded for those of `params` not allocated yet. Off the CPU from one allocation of
  // their total (each parameter's memory 256-byte aligned inside it): one allocator call for a
  // unit, not one a parameter, which on a GPU is host time at every all-gather. Each parameter's
  // storage keeps a share of the block, which is freed when the last of them is (free_unsharded,
  // as ever). On the CPU each parameter comes from FSDP's buffer pool (one block a unit would
  // raise a rank's peak RSS under glibc's defaults).
  static void alloc_unsharded_together(const std::vector<FSDPParam*>& params);
  // The unsharded storage as a contiguous tensor of the full shape in the compute dtype, with its own
  // version counter: collectives.cpp copies rows in and out through it (see the note above). Its
  // dim 0 is shard_dim(): the full shape with that dim moved first ([Note: sharding along dim d > 0]).
  at::Tensor unsharded_alias() const;
  // The same storage as [shard group size, shard_numel]: row r is where rank r's padded shard
  // goes. The storage holds the padding rows past the parameter's end (at most N - 1 rows), so
  // copy-out is one strided copy per parameter, and one kernel per unit where the backend fuses
  // them (split_with_sizes_copy: [Note: one copy kernel per unit], collectives.cpp).
  at::Tensor unsharded_by_rank() const;
  // A shard group of one (no all-gather needed): copies the shard into the allocated unsharded
  // parameter, casting to the compute dtype.
  void copy_shard_to_unsharded();
  // A shard group of one where the shard already is the unsharded parameter (same dtype, same
  // device: no mixed precision cast, no offload): the unsharded storage points at the shard's
  // memory (holding a reference to it) instead of a copy. No allocation, no copy; the optimizer's
  // in-place updates of the shard are what forward reads. Returns false (nothing done) otherwise.
  bool alias_shard_as_unsharded();
  // A shard group of one without replicas (no reduce-scatter needed): `g` (the unsharded gradient,
  // the full parameter's) becomes or is added to the sharded gradient, divided by `divide`.
  void accumulate_full_grad(at::Tensor g, std::optional<double> divide);
  // A shard group of one (the shard is the whole parameter) in the shard's dtype and on its device,
  // during a backward without create_graph: the sharded gradient, when there is one, becomes the
  // unsharded parameter's gradient too, so that autograd adds the new gradient into it in place, as
  // into a plain parameter's (no copy of the new gradient, no add of it afterwards). The caller
  // knows that no cast, division or reduction is due. take_unsharded_grad() undoes it.
  void share_sharded_grad();
  bool shares_sharded_grad() const { return grad_shared_; }
  // HSDP with the all-reduce skipped: keeps this parameter's reduce-scatter output (the sum of
  // the shard group only) until the next all-reduce, which add_partial_reduce() folds it into.
  void stash_partial_reduce(const at::Tensor& reduced, int64_t offset);
  void add_partial_reduce(const at::Tensor& reduced, int64_t offset);
  // The gradient to reduce: the unsharded parameter's, plus what no-sync steps accumulated; both
  // are released. Contiguous with dim shard_dim() first (in the shape of unsharded_alias()).
  // Undefined when there is none, or when autograd added it into the sharded gradient itself
  // (share_sharded_grad).
  at::Tensor take_unsharded_grad();
  // No-sync step: keeps the gradient for the next synced one (in reduce_dtype when that differs
  // from the compute dtype, as FSDP2 does, so bf16 gradients do not lose the small increments).
  void accumulate_unsharded_grad();
  // reduced: this rank's flat reduce-scatter output; adds to (or sets) sharded_param.grad.
  void accumulate_sharded_grad(const at::Tensor& reduced, int64_t offset);
  // This parameter's rows of `reduced` (flat), in the sharded parameter's shape: a view.
  at::Tensor reduced_rows(const at::Tensor& reduced, int64_t offset) const;
  // With no gradient yet: sharded_param.grad becomes this parameter's rows of `owned` itself (FSDP2's
  // gradients as views of the reduce-scatter output), not a copy. `owned` is flat, in the shard's
  // dtype and on its device, and the caller hands it over: nothing else writes it afterwards. The
  // gradient is a tensor on owned's storage (Tensor::set_), not an autograd view, so optimizers may
  // detach_() and zero_() it (LibTorch 1.13's zero_grad does). Returns false (nothing done) when a
  // gradient exists or the dtype or device differ.
  bool adopt_sharded_grad(const at::Tensor& owned, int64_t offset);
  // Moves the padded shard into `slot` (flat [shard_numel], the shard's dtype and device): the
  // padded shard becomes that memory and the sharded parameter a view of it, still the same tensor
  // object (the module, the optimizer and its state hold it: Tensor::set_data, as FSDP1's flat
  // parameter views are made). [Note: the shards in one buffer] in fsdp_param_group.cpp.
  void move_shard_to(const at::Tensor& slot);
  // Meta-device initialisation: gives the shard memory on `device` (the CPU when offloaded) as a new
  // leaf registered in place of the meta one, and the unsharded parameter zero elements there.
  void materialize(c10::Device device);
  // Throws when a registry entry was replaced or the shard was reshaped since fully_shard.
  void check_unchanged() const;
  [[noreturn]] void throw_replaced() const;

 private:
  std::vector<ParamSlot> slots_;
  std::string fqn_;
  std::vector<int64_t> global_shape_;
  std::vector<int64_t> local_shape_;
  // [Note: sharding along dim d > 0]: the shapes with shard_dim_ moved first (the layout of the
  // storages), and the strides that show them in the parameter's own order.
  int64_t shard_dim_ = 0;
  std::vector<int64_t> moved_shape_, local_moved_shape_, unsharded_strides_, local_strides_;
  at::Tensor shard_view(const at::Tensor& flat) const;  // the sharded parameter on a flat shard
  // `sizes` with `strides` (the unsharded or local ones above; contiguous where shard_dim_ is 0).
  void set_layout(c10::TensorImpl* impl, at::IntArrayRef sizes, at::IntArrayRef strides) const;
  int64_t rows_ = 0, row_numel_ = 0, padded_rows_ = 0, local_rows_ = 0, dim0_offset_ = 0;
  int shard_size_ = 1;
  at::Tensor padded_shard_, sharded_param_, unsharded_param_;
  mutable at::Tensor alias_, by_rank_alias_;  // unsharded_alias(), unsharded_by_rank()
  const at::Tensor& cached_alias(at::Tensor& cache, at::IntArrayRef sizes, at::IntArrayRef strides) const;
  // The unsharded storage, its size when allocated, and allocating it from `memory` (alloc_unsharded,
  // alloc_unsharded_together).
  c10::StorageImpl* unsharded_storage() const;
  size_t unsharded_nbytes() const;
  void install_unsharded(at::DataPtr memory);
  at::Tensor accumulated_grad_;  // no-sync accumulation in reduce_dtype
  at::Tensor partial_reduce_;    // HSDP: reduce-scatter outputs not all-reduced yet (reduce_dtype)
  at::ScalarType compute_dtype_, reduce_dtype_;
  ParamPlacement placement_;
  bool unsharded_ = true;
  bool shape_kept_ = false;   // free_unsharded(keep_shape) until drop_kept_shape() or the next alloc
  bool grad_shared_ = false;  // share_sharded_grad() until take_unsharded_grad()
};

}  // namespace fsdp::detail
