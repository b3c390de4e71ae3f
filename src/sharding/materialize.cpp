#include "fsdp/sharding/materialize.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <functional>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/sharding/fully_shard.h"
#include "fsdp/tensor_parallel/placement.h"
#include "fsdp_param.h"
#include "registry.h"

namespace fsdp {

namespace {

// Turns a meta tensor into a real one on `device` without changing its identity: the module's
// fields, the registry and autograd keep pointing at the same tensor object.
void give_memory(const at::Tensor& t, at::IntArrayRef sizes, c10::Device device) {
  at::Tensor real = at::empty(sizes, t.options().device(device).requires_grad(false));
  t.unsafeGetTensorImpl()->shallow_copy_from(real.getIntrusivePtr());
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Calls fill(row_view, global_row, columns) for each row this tensor holds of its full parameter.
// A row is dims 1.. flattened; `columns` says which part of the full row the local row is: all of
// it, or (tensor parallelism along a dim > 0) a slice of it, so the fill draws the full row's
// values and keeps the local part. Tensor parallelism along dim 0 moves the rows instead.
struct RowSlice {
  std::vector<int64_t> full_row_shape;  // the full parameter's dims 1..
  int64_t dim = -1;                     // -1: the whole row; else the sliced dim of the row
  int64_t offset = 0, size = 0;
};

void for_each_row(const at::Tensor& param, const std::function<void(at::Tensor, int64_t, const RowSlice&)>& fill) {
  if (param.device().is_meta()) {
    throw std::invalid_argument("fsdp::init: the parameter is on the meta device; call fsdp::to_empty first");
  }
  int64_t first = 0, rows = param.dim() == 0 ? 1 : param.size(0);
  std::optional<tp::TPPlacement> tp;
  if (auto info = shard_info(param)) {
    first = info->dim0_offset;
    rows = info->local_rows;
    tp = info->tp;
  } else {
    tp = tp::tp_placement(param);
  }
  RowSlice slice;
  std::optional<tp::TPPlacement> rows_tp;  // TP along dim 0: local row -> global row
  if (tp) {
    if (tp->blocks > 1 && tp->dim != 0) {
      throw std::invalid_argument("fsdp::init: a strided (fused) tensor-parallel placement along dim " +
                                  std::to_string(tp->dim) + " is not supported; fuse along dim 0 (ColwiseParallel)");
    }
    if (tp->dim == 0) {
      rows_tp = tp;
    } else {
      slice.full_row_shape.assign(tp->global_shape.begin() + 1, tp->global_shape.end());
      slice.dim = tp->dim - 1;
      slice.offset = tp->offset;
      slice.size = tp->size;
    }
  }
  if (rows == 0) return;
  if (!param.is_contiguous()) throw std::invalid_argument("fsdp::init: the parameter must be contiguous");
  at::Tensor as_rows = param.detach().view({rows, -1});  // a view: filling rows fills the parameter
  for (int64_t r = 0; r < rows; ++r) fill(as_rows[r], rows_tp ? rows_tp->global_index(first + r) : first + r, slice);
}

// The values drawn for a full row, cut to the local part.
at::Tensor local_part(const at::Tensor& full_row, const RowSlice& slice) {
  if (slice.dim < 0) return full_row;
  return full_row.view(slice.full_row_shape).narrow(slice.dim, slice.offset, slice.size).reshape(-1);
}

int64_t full_row_numel(const at::Tensor& row, const RowSlice& slice) {
  if (slice.dim < 0) return row.numel();
  int64_t n = 1;
  for (int64_t s : slice.full_row_shape) n *= s;
  return n;
}

}  // namespace

void to_empty(torch::nn::Module& module, c10::Device device) {
  std::unordered_set<const c10::TensorImpl*> done;
  auto all = module.modules(/*include_self=*/true);
  for (const auto& m : all) {
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::Tensor& t = item.value();
      if (!done.insert(t.unsafeGetTensorImpl()).second) continue;
      if (detail::FSDPParam* p = detail::param_of_shard(t)) {
        if (!p->sharded_param().device().is_meta()) continue;
        done.insert(p->unsharded_param().unsafeGetTensorImpl());
        p->materialize(device);
      } else if (t.device().is_meta()) {
        give_memory(t, t.sizes(), device);
      }
    }
    for (const auto& item : m->named_buffers(/*recurse=*/false)) {
      const at::Tensor& t = item.value();
      if (t.device().is_meta() && done.insert(t.unsafeGetTensorImpl()).second) give_memory(t, t.sizes(), device);
    }
  }
}

namespace init {

uint64_t param_seed(uint64_t base_seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across runs and platforms
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return splitmix64(base_seed ^ h);
}

void normal_(const at::Tensor& param, double mean, double std, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for_each_row(param, [&](at::Tensor row, int64_t r, const RowSlice& slice) {
    auto gen = at::detail::createCPUGenerator(splitmix64(seed + static_cast<uint64_t>(r)));
    at::Tensor values =
        at::normal(mean, std, {full_row_numel(row, slice)}, gen, row.options().dtype(at::kFloat).device(at::kCPU));
    row.copy_(local_part(values, slice));
  });
}

void uniform_(const at::Tensor& param, double low, double high, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for_each_row(param, [&](at::Tensor row, int64_t r, const RowSlice& slice) {
    auto gen = at::detail::createCPUGenerator(splitmix64(seed + static_cast<uint64_t>(r)));
    at::Tensor values = at::empty({full_row_numel(row, slice)}, row.options().dtype(at::kFloat).device(at::kCPU));
    values.uniform_(low, high, gen);
    row.copy_(local_part(values, slice));
  });
}

void constant_(const at::Tensor& param, double value) {
  if (param.device().is_meta()) {
    throw std::invalid_argument("fsdp::init: the parameter is on the meta device; call fsdp::to_empty first");
  }
  torch::NoGradGuard no_grad;
  param.detach().fill_(value);
}

}  // namespace init
}  // namespace fsdp
