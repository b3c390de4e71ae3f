#include "fsdp_param.h"

#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <stdexcept>
#include <utility>
#include <vector>

#include "memory/buffer_alloc.h"
#include "module_access.h"
#include "registry.h"

namespace fsdp::detail {

namespace {

// Memory for `nbytes` of unsharded parameters on `storage`'s device (none for 0 bytes). On the CPU
// it comes from FSDP's buffer pool (reused unit after unit and step after step, see
// fsdp/debug/buffer_pool.h); elsewhere from the storage's own allocator.
at::DataPtr allocate_for(c10::StorageImpl* storage, size_t nbytes) {
  if (nbytes == 0) return at::DataPtr(nullptr, storage->device());
  // A device allocator (CUDA's caching allocator) allocates on the current device: the storage's
  // own device is made current, so a rank whose parameters live on cuda:k while the current device
  // is 0 gets its memory on cuda:k (FSDP2 allocates with device= explicitly).
  c10::OptionalDeviceGuard on_device;
  if (storage->device().is_cuda()) on_device.reset_device(storage->device());
  c10::Allocator* allocator = storage->allocator() ? storage->allocator() : c10::GetAllocator(storage->device_type());
  return allocate_buffer(nbytes, storage->device(), allocator, BufferOwner::UnshardedParams);
}

// Frees or re-allocates a storage in place: the StorageImpl object (which autograd's saved views
// hold) stays the same.
void set_storage(c10::StorageImpl* storage, at::DataPtr memory, size_t nbytes) {
  storage->set_data_ptr_noswap(std::move(memory));
  storage->set_nbytes(nbytes);
}

// Frees the storage's memory, with its device current (as it was allocated).
void release_storage(c10::StorageImpl* storage) {
  c10::OptionalDeviceGuard on_device;
  if (storage->device().is_cuda()) on_device.reset_device(storage->device());
  set_storage(storage, at::DataPtr(nullptr, storage->device()), 0);
}

// The strides of `moved` (contiguous, dim d first) shown in the original dim order.
std::vector<int64_t> unmoved_strides(const std::vector<int64_t>& moved, int64_t d) {
  const auto cs = c10::contiguous_strides(moved);
  std::vector<int64_t> out(moved.size());
  for (int64_t i = 0; i < static_cast<int64_t>(moved.size()); ++i) out[i] = i == d ? cs[0] : i < d ? cs[i + 1] : cs[i];
  return out;
}

// `shape` with dim d moved first.
std::vector<int64_t> moved_first(std::vector<int64_t> shape, int64_t d) {
  if (d > 0) std::rotate(shape.begin(), shape.begin() + d, shape.begin() + d + 1);
  return shape;
}

std::string shape_str(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

FSDPParam::FSDPParam(const at::Tensor& original, std::vector<ParamSlot> slots, std::string fqn, int shard_rank,
                     int shard_size, const ParamDtypes& dtypes, const ParamPlacement& placement, int64_t shard_dim)
    : slots_(std::move(slots)), fqn_(std::move(fqn)), shard_size_(shard_size), unsharded_param_(original) {
  const bool floating = at::isFloatingType(original.scalar_type());
  compute_dtype_ = floating && dtypes.param_dtype ? *dtypes.param_dtype : original.scalar_type();
  reduce_dtype_ = floating && dtypes.reduce_dtype ? *dtypes.reduce_dtype : compute_dtype_;
  placement_ = placement;
  if (!original.is_contiguous() || original.storage_offset() != 0 ||
      (!original.is_meta() &&
       original.storage().nbytes() != static_cast<size_t>(original.numel()) * original.element_size())) {
    throw std::invalid_argument("fsdp::fully_shard: parameter '" + fqn_ +
                                "' does not own its storage (a view, non-contiguous, or sharing a buffer); "
                                "register parameters as separate contiguous tensors");
  }
  global_shape_ = original.sizes().vec();
  // fully_shard checked it (param_shard_dim), with the message for the user.
  TORCH_INTERNAL_ASSERT(shard_dim == 0 || (shard_dim > 0 && shard_dim < original.dim()), "shard_dim ", shard_dim);
  shard_dim_ = shard_size > 1 ? shard_dim : 0;  // a group of one holds the whole parameter
  rows_ = original.dim() == 0 ? 1 : original.size(shard_dim_);
  row_numel_ = 1;
  for (int64_t d = 0; d < original.dim(); ++d) row_numel_ *= d == shard_dim_ ? 1 : original.size(d);
  padded_rows_ = (rows_ + shard_size - 1) / shard_size;
  dim0_offset_ = std::min<int64_t>(static_cast<int64_t>(shard_rank) * padded_rows_, rows_);
  local_rows_ = std::max<int64_t>(0, std::min<int64_t>(padded_rows_, rows_ - dim0_offset_));
  local_shape_ = original.dim() == 0 ? std::vector<int64_t>{local_rows_} : global_shape_;
  if (original.dim() > 0) local_shape_[shard_dim_] = local_rows_;
  moved_shape_ = moved_first(global_shape_, shard_dim_);
  local_moved_shape_ = moved_first(local_shape_, shard_dim_);
  unsharded_strides_ = unmoved_strides(moved_shape_, shard_dim_);
  local_strides_ = unmoved_strides(local_moved_shape_, shard_dim_);

  torch::NoGradGuard no_grad;
  auto shard_options = original.options().requires_grad(false);
  // Offloaded shards live on the CPU (pinned when the parameters compute on a GPU); a meta
  // original keeps a meta shard until fsdp::to_empty places it (materialize: the CPU when offloaded).
  if (placement.offload_to_cpu && !original.is_meta()) {
    shard_options = shard_options.device(at::kCPU).pinned_memory(placement.pin_memory && !original.device().is_cpu());
  }
  padded_shard_ = at::zeros({shard_numel()}, shard_options);
  padded_shard_.narrow(0, 0, local_rows_ * row_numel_)
      .copy_(original.detach()
                 .movedim(shard_dim_, 0)
                 .reshape(-1)
                 .narrow(0, dim0_offset_ * row_numel_, local_rows_ * row_numel_));
  sharded_param_ = shard_view(padded_shard_);
  sharded_param_.set_requires_grad(original.requires_grad());
  // The shard replaces the original in every registry entry: parameters() now returns shards.
  for (auto& slot : slots_) parameter_registry(*slot.module.lock())[slot.name] = sharded_param_;
  free_unsharded();
  if (compute_dtype_ != original.scalar_type()) {
    // Mixed precision: the unsharded parameter (what forward computes with) takes param_dtype; the
    // shard keeps the original dtype as the optimizer's master copy.
    auto* impl = unsharded_param_.unsafeGetTensorImpl();
    impl->set_storage_and_dtype(impl->storage(), caffe2::TypeMeta::fromScalarType(compute_dtype_));
  }
}

at::Tensor FSDPParam::shard_view(const at::Tensor& flat) const {
  at::Tensor local = flat.narrow(0, 0, local_rows_ * row_numel_).view(local_moved_shape_);
  return (shard_dim_ > 0 ? local.movedim(0, shard_dim_) : local).detach();
}

void FSDPParam::set_layout(c10::TensorImpl* impl, at::IntArrayRef sizes, at::IntArrayRef strides) const {
  if (shard_dim_ == 0)
    impl->set_sizes_contiguous(sizes);  // the strides are contiguous: no stride array to compare
  else
    impl->set_sizes_and_strides(sizes, strides);
}

// The aliases are made once per storage (materialize replaces it) and kept: the StorageImpl is
// re-allocated in place (set_storage), so an alias follows its data pointer, and two host
// operations per parameter and all-gather are saved. Made only while the storage is allocated
// (set_ would otherwise grow a freed storage).
const at::Tensor& FSDPParam::cached_alias(at::Tensor& cache, at::IntArrayRef sizes, at::IntArrayRef strides) const {
  if (!cache.defined() || cache.storage().unsafeGetStorageImpl() != unsharded_param_.storage().unsafeGetStorageImpl()) {
    cache = at::empty({0}, unsharded_param_.options().dtype(compute_dtype_).requires_grad(false));
    cache.set_(unsharded_param_.storage(), 0, sizes, strides);
  }
  return cache;
}

at::Tensor FSDPParam::unsharded_alias() const {
  return cached_alias(alias_, moved_shape_, c10::contiguous_strides(moved_shape_));
}

at::Tensor FSDPParam::unsharded_by_rank() const {
  return cached_alias(by_rank_alias_, {shard_size_, shard_numel()}, {shard_numel(), 1});
}

size_t FSDPParam::unsharded_nbytes() const {
  // Room for every rank's padded rows (unsharded_by_rank), not only the parameter's own.
  return static_cast<size_t>(shard_size_ * shard_numel()) * c10::elementSize(compute_dtype_);
}

c10::StorageImpl* FSDPParam::unsharded_storage() const { return unsharded_param_.storage().unsafeGetStorageImpl(); }

void FSDPParam::install_unsharded(at::DataPtr memory) {
  // Frozen parameters (requires_grad false on the shard, e.g. set after fully_shard for
  // fine-tuning): forward computes with a tensor that asks for no gradient, so none is reduced.
  if (unsharded_param_.requires_grad() != sharded_param_.requires_grad())
    unsharded_param_.set_requires_grad(sharded_param_.requires_grad());
  set_storage(unsharded_storage(), std::move(memory), unsharded_nbytes());
  set_layout(unsharded_param_.unsafeGetTensorImpl(), global_shape_, unsharded_strides_);
  unsharded_ = true;
  shape_kept_ = false;
}

void FSDPParam::alloc_unsharded() {
  if (unsharded_) return;
  install_unsharded(allocate_for(unsharded_storage(), unsharded_nbytes()));
}

namespace {
// One allocation shared by a unit's unsharded parameters: each one's DataPtr holds a reference.
struct SharedBlock {
  at::DataPtr memory;
  std::atomic<int64_t> refs{0};
};
void release_share(void* ctx) {
  auto* block = static_cast<SharedBlock*>(ctx);
  if (block->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete block;  // frees the memory
}
}  // namespace

void FSDPParam::alloc_unsharded_together(const std::vector<FSDPParam*>& params) {
  constexpr size_t kAlign = 256;
  std::vector<FSDPParam*> todo;
  todo.reserve(params.size());
  for (FSDPParam* p : params) {
    if (!p->unsharded_) todo.push_back(p);
  }
  c10::StorageImpl* first = todo.empty() ? nullptr : todo.front()->unsharded_storage();
  bool together = todo.size() > 1 && !first->device().is_cpu();
  for (const FSDPParam* p : todo) {
    const c10::StorageImpl* storage = p->unsharded_storage();
    together = together && storage->device() == first->device() && storage->allocator() == first->allocator() &&
               p->unsharded_nbytes() > 0;
  }
  if (!together) {
    for (FSDPParam* p : todo) p->alloc_unsharded();
    return;
  }
  std::vector<size_t> offsets;
  offsets.reserve(todo.size());
  size_t total = 0;
  for (const FSDPParam* p : todo) {
    offsets.push_back(total);
    total += (p->unsharded_nbytes() + kAlign - 1) / kAlign * kAlign;
  }
  auto* block = new SharedBlock{allocate_for(first, total)};
  block->refs = static_cast<int64_t>(todo.size());
  char* base = static_cast<char*>(block->memory.get());
  for (size_t i = 0; i < todo.size(); ++i)
    todo[i]->install_unsharded(at::DataPtr(base + offsets[i], block, &release_share, first->device()));
}

void FSDPParam::free_unsharded(bool keep_shape) {
  if (!unsharded_) return;
  release_storage(unsharded_storage());
  // keep_shape: [Note: unshard_in_backward] (fsdp_param_group.h).
  if (keep_shape)
    shape_kept_ = true;
  else
    unsharded_param_.unsafeGetTensorImpl()->set_sizes_contiguous({0});
  unsharded_ = false;
}

void FSDPParam::drop_kept_shape() {
  if (!std::exchange(shape_kept_, false) || unsharded_) return;
  unsharded_param_.unsafeGetTensorImpl()->set_sizes_contiguous({0});
}

void FSDPParam::copy_shard_to_unsharded() {
  // A shard group of one: padded_rows == rows, the shard is the whole parameter.
  unsharded_alias().view(-1).copy_(padded_shard_);
}

bool FSDPParam::alias_shard_as_unsharded() {
  if (unsharded_) return true;
  if (shard_size_ != 1 || compute_dtype_ != padded_shard_.scalar_type() || shard_device() != device() ||
      padded_shard_.is_meta() || padded_shard_.numel() != rows_ * row_numel_) {
    return false;
  }
  if (unsharded_param_.requires_grad() != sharded_param_.requires_grad())
    unsharded_param_.set_requires_grad(sharded_param_.requires_grad());
  auto* impl = unsharded_param_.unsafeGetTensorImpl();
  c10::StorageImpl* storage = impl->storage().unsafeGetStorageImpl();
  // The data pointer's context is a reference to the shard's storage: it stays valid even if the
  // shard is replaced (materialize) before this storage is freed. The reference is the storage's
  // own intrusive count (taken here, dropped by the deleter), not a heap-allocated handle: an
  // unshard of a world of one allocates nothing.
  c10::StorageImpl* shard_storage = padded_shard_.storage().unsafeGetStorageImpl();
  c10::raw::intrusive_ptr::incref(shard_storage);
  storage->set_data_ptr_noswap(at::DataPtr(
      padded_shard_.data_ptr(), shard_storage,
      [](void* ctx) { c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx)); }, padded_shard_.device()));
  storage->set_nbytes(padded_shard_.nbytes());
  set_layout(impl, global_shape_, unsharded_strides_);
  unsharded_ = true;
  shape_kept_ = false;
  return true;
}

void FSDPParam::accumulate_full_grad(at::Tensor g, std::optional<double> divide) {
  // A shard group of one: the gradient is the sharded gradient (same shape), in reduce_dtype as
  // the reduce-scatter would have had it, divided by a custom factor.
  // No `to` op where the dtype and device already are right (LibTorch 2.x dispatches even a no-op one).
  if (g.scalar_type() != reduce_dtype_) g = g.to(reduce_dtype_);
  if (divide) g = g.div(*divide);
  if (g.scalar_type() != sharded_param_.scalar_type() || g.device() != sharded_param_.device())
    g = g.to(sharded_param_.device(), sharded_param_.scalar_type());
  // Not a view (optimizers detach_() gradients): a 0-dim parameter's shard is [1], a copy.
  if (g.sizes() != at::IntArrayRef(local_shape_)) g = g.reshape(local_shape_).clone();
  at::Tensor& grad = sharded_param_.mutable_grad();
  torch::NoGradGuard no_grad;
  if (grad.defined()) {
    grad.add_(g);
  } else {
    const bool pinned = placement_.offload_to_cpu && placement_.pin_memory && !device().is_cpu();
    // Autograd's gradient is ours alone now (take_unsharded_grad released it): kept as it is.
    grad = pinned ? at::empty(g.sizes(), g.options().pinned_memory(true)).copy_(g) : g.contiguous();
  }
}

void FSDPParam::stash_partial_reduce(const at::Tensor& reduced, int64_t offset) {
  at::Tensor mine = reduced.narrow(0, offset, shard_numel());
  if (partial_reduce_.defined())
    partial_reduce_.add_(mine);
  else
    partial_reduce_ = mine.clone();
}

void FSDPParam::add_partial_reduce(const at::Tensor& reduced, int64_t offset) {
  if (!partial_reduce_.defined()) return;
  reduced.narrow(0, offset, shard_numel()).add_(partial_reduce_);
  partial_reduce_ = at::Tensor();
}

void FSDPParam::share_sharded_grad() {
  const at::Tensor& grad = sharded_param_.grad();
  if (shard_size_ != 1 || !grad.defined() || unsharded_param_.grad().defined() || accumulated_grad_.defined() ||
      partial_reduce_.defined() || reduce_dtype_ != compute_dtype_ || compute_dtype_ != grad.scalar_type() ||
      grad.device() != device() || grad.sizes() != at::IntArrayRef(global_shape_)) {
    return;
  }
  unsharded_param_.mutable_grad() = grad;
  grad_shared_ = true;
}

at::Tensor FSDPParam::take_unsharded_grad() {
  at::Tensor g = unsharded_param_.grad();
  unsharded_param_.mutable_grad().reset();
  // Shared (share_sharded_grad): autograd has added this backward's gradient into the sharded one.
  if (std::exchange(grad_shared_, false) && g.defined() && g.is_same(sharded_param_.grad())) g = at::Tensor();
  if (accumulated_grad_.defined()) {
    at::Tensor total = std::move(accumulated_grad_);
    if (g.defined()) total.add_(g.to(total.scalar_type()));
    g = std::move(total);
  }
  if (shard_dim_ == 0 || !g.defined()) return g;
  // Dim shard_dim first, as the rows are laid out: a view where the gradient has the parameter's
  // strides (autograd's, [Note: sharding along dim d > 0]), else a copy.
  g = g.movedim(shard_dim_, 0);
  return g.is_contiguous() ? g : g.contiguous();
}

void FSDPParam::accumulate_unsharded_grad() {
  if (reduce_dtype_ == compute_dtype_) return;  // autograd already accumulates on the parameter
  at::Tensor g = unsharded_param_.grad();
  if (!g.defined()) return;
  torch::NoGradGuard no_grad;
  if (accumulated_grad_.defined())
    accumulated_grad_.add_(g.to(reduce_dtype_));
  else
    accumulated_grad_ = g.to(reduce_dtype_);
  unsharded_param_.mutable_grad().reset();
}

at::Tensor FSDPParam::reduced_rows(const at::Tensor& reduced, int64_t offset) const {
  // One view op where the reduced buffer is flat and contiguous (every caller's), not a narrow and a view.
  if (reduced.dim() == 1 && reduced.is_contiguous())
    return reduced.as_strided(local_shape_, local_strides_, reduced.storage_offset() + offset);
  return shard_view(reduced.narrow(0, offset, local_rows_ * row_numel_));
}

void FSDPParam::accumulate_sharded_grad(const at::Tensor& reduced, int64_t offset) {
  at::Tensor g = reduced_rows(reduced, offset);
  // Back to the shard's dtype and device (the CPU when offloaded); no op where they already are.
  if (g.scalar_type() != sharded_param_.scalar_type() || g.device() != sharded_param_.device())
    g = g.to(sharded_param_.device(), sharded_param_.scalar_type());
  at::Tensor& grad = sharded_param_.mutable_grad();
  torch::NoGradGuard no_grad;
  if (grad.defined()) {
    grad.add_(g);
  } else {
    // Own storage (not a view of the reduce buffer): optimizers may detach_()/zero_() grads.
    // Offloaded from a GPU: pinned, like the shard (FSDP2's CPUOffloadPolicy).
    const bool pinned = placement_.offload_to_cpu && placement_.pin_memory && !device().is_cpu();
    grad = pinned ? at::empty(g.sizes(), g.options().pinned_memory(true)).copy_(g) : g.clone();
  }
}

bool FSDPParam::adopt_sharded_grad(const at::Tensor& owned, int64_t offset) {
  at::Tensor& grad = sharded_param_.mutable_grad();
  if (grad.defined() || owned.scalar_type() != sharded_param_.scalar_type() ||
      owned.device() != sharded_param_.device() || !owned.is_contiguous()) {
    return false;
  }
  // A tensor of its own on `owned`'s storage, not an autograd view (optimizers detach_() gradients),
  // made without an operator: a shallow copy of `owned`'s TensorImpl (what variable_data() makes,
  // with its metadata left changeable), then this parameter's offset and shape. On a GPU each
  // operator is host time, and this runs for every parameter of every step.
  c10::intrusive_ptr<c10::TensorImpl> impl = owned.unsafeGetTensorImpl()->shallow_copy_and_detach(
      /*version_counter=*/c10::VariableVersion(0), /*allow_tensor_metadata_change=*/true);
  impl->set_storage_offset(owned.storage_offset() + offset);
  set_layout(impl.get(), local_shape_, local_strides_);
  grad = at::Tensor(std::move(impl));
  return true;
}

void FSDPParam::move_shard_to(const at::Tensor& slot) {
  TORCH_INTERNAL_ASSERT(slot.numel() == shard_numel() && slot.scalar_type() == padded_shard_.scalar_type() &&
                        slot.device() == padded_shard_.device() && slot.is_contiguous());
  torch::NoGradGuard no_grad;
  slot.copy_(padded_shard_);
  padded_shard_ = slot;
  sharded_param_.set_data(shard_view(slot));
}

void FSDPParam::materialize(c10::Device device) {
  const c10::Device shard_device = placement_.offload_to_cpu ? c10::Device(at::kCPU) : device;
  const bool requires_grad = sharded_param_.requires_grad();
  const c10::TensorImpl* old_shard = sharded_param_.unsafeGetTensorImpl();
  auto options = padded_shard_.options().device(shard_device).pinned_memory(placement_.pin_memory && !device.is_cpu());
  padded_shard_ = at::zeros({shard_numel()}, options);  // zero padding rows
  sharded_param_ = shard_view(padded_shard_);
  sharded_param_.set_requires_grad(requires_grad);
  for (auto& slot : slots_) parameter_registry(*slot.module.lock())[slot.name] = sharded_param_;
  rekey_shard(old_shard, this);
  // The unsharded tensor keeps its identity (module fields and autograd hold it); only its device
  // changes, to an empty tensor there: the resharded state.
  at::Tensor empty =
      at::empty({0}, unsharded_param_.options().device(device).dtype(compute_dtype_).requires_grad(false));
  unsharded_param_.unsafeGetTensorImpl()->shallow_copy_from(empty.getIntrusivePtr());
  unsharded_ = false;
}

void FSDPParam::throw_replaced() const {
  throw std::logic_error("fsdp: parameter '" + fqn_ +
                         "' was replaced after fully_shard (register_parameter or assignment); change "
                         "parameters before sharding, or load values into the shard in place");
}

void FSDPParam::check_unchanged() const {
  if (sharded_param_.is_meta()) {
    throw std::logic_error("fsdp: parameter '" + fqn_ +
                           "' is still on the meta device; call fsdp::to_empty(module, device) and initialise the "
                           "parameters before the first forward");
  }
  for (const auto& slot : slots_) {
    auto module = slot.module.lock();
    if (!module) throw_replaced();
    // The item where the shard was last found holds it still: nothing was replaced (a registry
    // item's value changes only through register_parameter or assignment, which the lookup below
    // would see too). Else the name is looked up, once.
    const auto& items = parameter_registry(*module).items();
    if (slot.registry_index < items.size() && items[slot.registry_index].value().is_same(sharded_param_)) continue;
    const at::Tensor* now = parameter_registry(*module).find(slot.name);
    if (now == nullptr || !now->is_same(sharded_param_)) throw_replaced();
    for (size_t i = 0; i < items.size(); ++i) {
      if (&items[i].value() == now) slot.registry_index = i;
    }
  }
  if (sharded_param_.sizes() != at::IntArrayRef(local_shape_)) {
    throw std::logic_error("fsdp: the shard of parameter '" + fqn_ + "' changed shape from " + shape_str(local_shape_) +
                           " to " + shape_str(sharded_param_.sizes()) +
                           " after fully_shard; shapes are fixed once a module is sharded");
  }
  if (!unsharded_ && !shape_kept_ && unsharded_param_.numel() != 0) {
    throw std::logic_error("fsdp: the unsharded parameter '" + fqn_ + "' was resized to " +
                           shape_str(unsharded_param_.sizes()) + " while sharded; shapes are fixed after fully_shard");
  }
}

}  // namespace fsdp::detail
