#include "fsdp/sharding/materialize.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>

#include <algorithm>
#include <functional>
#include <mutex>
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

// Which part of the full row a local row is: all of it, or (tensor parallelism along a dim > 0) a
// slice of it, so the fill draws the full row's values and keeps the local part. Tensor
// parallelism along dim 0 moves the rows instead (RowMap::global).
struct RowSlice {
  std::vector<int64_t> full_row_shape;  // the full parameter's dims 1..
  int64_t dim = -1;                     // -1: the whole row; else the sliced dim of the row
  int64_t offset = 0, size = 0;
};

// Where the rows this tensor holds sit in its full parameter. A row is dims 1.. flattened.
struct RowMap {
  int64_t first = 0;                       // the first row held, in the tensor fully_shard took (TP-local under TP)
  int64_t rows = 0;                        // rows held here
  int64_t full_rows = 1;                   // rows of the full parameter
  std::optional<tp::TPPlacement> rows_tp;  // TP along dim 0: local row -> global row
  RowSlice slice;
  int64_t global(int64_t local) const { return rows_tp ? rows_tp->global_index(first + local) : first + local; }
};

RowMap row_map(const at::Tensor& param) {
  if (param.device().is_meta()) {
    throw std::invalid_argument("fsdp::init: the parameter is on the meta device; call fsdp::to_empty first");
  }
  RowMap m;
  m.rows = param.dim() == 0 ? 1 : param.size(0);
  m.full_rows = m.rows;
  std::optional<tp::TPPlacement> tp;
  std::string name = "the parameter";  // for errors
  if (auto info = shard_info(param)) {
    tp = info->tp;
    name = "parameter '" + info->fqn + "'";
    if (info->shard_dim > 0) {
      // Sharded along a dim > 0 (shard_placement_fn): every row, a slice of each (TP's below may
      // then move the rows, or the slice when it splits the same dim).
      m.rows = m.full_rows = info->global_shape[0];
      m.slice.full_row_shape.assign(info->global_shape.begin() + 1, info->global_shape.end());
      m.slice.dim = info->shard_dim - 1;
      m.slice.offset = info->dim0_offset;
      m.slice.size = info->local_rows;
    } else {
      m.first = info->dim0_offset;
      m.rows = info->local_rows;
      m.full_rows = info->global_shape.empty() ? 1 : info->global_shape[0];
    }
  } else {
    tp = tp::tp_placement(param);
  }
  if (tp) {
    if (tp->blocks > 1 && tp->dim != 0) {
      throw std::invalid_argument("fsdp::init: a strided (fused) tensor-parallel placement along dim " +
                                  std::to_string(tp->dim) + " is not supported; fuse along dim 0 (ColwiseParallel)");
    }
    if (tp->dim == 0) {
      m.rows_tp = tp;
    } else if (m.slice.dim < 0 || m.slice.dim == tp->dim - 1) {
      // FSDP's slice (if any) is of the TP-local row: the full row is TP's, its offset TP's plus FSDP's.
      const bool fsdp_slice = m.slice.dim >= 0;
      m.slice.full_row_shape.assign(tp->global_shape.begin() + 1, tp->global_shape.end());
      m.slice.dim = tp->dim - 1;
      m.slice.offset = tp->offset + (fsdp_slice ? m.slice.offset : 0);
      if (!fsdp_slice) m.slice.size = tp->size;
    } else {
      throw std::invalid_argument("fsdp::init: " + name + " is sharded along dim " + std::to_string(m.slice.dim + 1) +
                                  " and tensor-parallel along dim " + std::to_string(tp->dim) +
                                  "; shard it along dim 0 or the TP dim (shard_placement_fn), or initialise it "
                                  "before sharding");
    }
    m.full_rows = tp->global_shape[0];
  }
  if (m.rows > 0) m.full_rows = std::max(m.full_rows, m.global(m.rows - 1) + 1);
  return m;
}

// The values drawn for n full rows ([n, full row]), cut to the local part of each row.
at::Tensor local_part(const at::Tensor& full_rows, const RowSlice& slice) {
  if (slice.dim < 0) return full_rows;
  std::vector<int64_t> shape{full_rows.size(0)};
  shape.insert(shape.end(), slice.full_row_shape.begin(), slice.full_row_shape.end());
  return full_rows.view(shape).narrow(slice.dim + 1, slice.offset, slice.size).reshape({full_rows.size(0), -1});
}

// Values a device generator draws together: whole rows of the full parameter, about 1M values
// (4 MB of floats), chunk c holding rows [c * rows_per_chunk, (c + 1) * rows_per_chunk).
constexpr int64_t kChunkValues = int64_t{1} << 20;

// A generator of `device`'s kind (its own, not the default one) seeded with `seed`.
at::Generator device_generator(c10::Device device, uint64_t seed) {
  const at::Generator& def = at::globalContext().defaultGenerator(device);
  at::Generator gen;
  {
    std::lock_guard<std::mutex> lock(const_cast<at::Generator&>(def).mutex());
    gen = def.clone();
  }
  gen.set_current_seed(seed);
  return gen;
}

// Fills `param` (a full parameter, a shard, or a TP-local tensor) with the values its rows hold in
// the full parameter; draw(out, gen) fills a float tensor in place from `gen`. The values depend
// on (seed, the full parameter's shape, the row) only, never on the world size:
//  - On the CPU every row has its own generator, seeded with splitmix64(seed + row), drawn one
//    row at a time (what fsdp::init has always drawn: CPU values are unchanged).
//  - On a device (CUDA) one generator of the device draws a chunk of whole rows at a time,
//    seeded with splitmix64(seed + chunk), where the chunks' boundaries depend only on the full
//    parameter's shape (kChunkValues). PyTorch's device kernels give the same values for the
//    same generator state, number of values and device model, so every process on the same
//    kind of GPU draws the same chunk, and each keeps the rows it holds: a shard holds what the
//    unsharded parameter initialised on that kind of GPU holds. (The values differ from the
//    CPU's, as torch.manual_seed's do.)
// Rows are copied in runs (consecutive rows of one chunk), not one by one.
void fill_rows(const at::Tensor& param, uint64_t seed, const std::function<void(at::Tensor&, at::Generator)>& draw) {
  const RowMap m = row_map(param);
  if (m.rows == 0 || param.numel() == 0) return;
  // A view where the parameter is contiguous (filling rows fills it); a shard along a dim > 0
  // (shard_placement_fn, permuted strides) is filled through a copy.
  const bool direct = param.is_contiguous();
  at::Tensor as_rows =
      (direct ? param.detach() : at::empty(param.sizes(), param.options().requires_grad(false))).view({m.rows, -1});
  int64_t row_values = as_rows.size(1);  // of a full row
  if (m.slice.dim >= 0) {
    row_values = 1;
    for (int64_t s : m.slice.full_row_shape) row_values *= s;
  }
  const int64_t chunk_rows = std::max<int64_t>(1, kChunkValues / std::max<int64_t>(1, row_values));
  const c10::Device device = param.device();
  const bool on_cpu = device.is_cpu();
  c10::OptionalDeviceGuard guard;
  if (!on_cpu) guard.reset_device(device);
  const auto floats = param.options().dtype(at::kFloat).requires_grad(false);
  at::Tensor chunk;  // device: the chunk drawn last
  int64_t chunk_index = -1;
  for (int64_t r = 0; r < m.rows;) {
    const int64_t g = m.global(r), c = g / chunk_rows;
    int64_t n = 1;
    while (r + n < m.rows && m.global(r + n) == g + n && (g + n) / chunk_rows == c) ++n;
    at::Tensor values;  // [n, row_values]: full rows g .. g + n - 1
    if (on_cpu) {
      values = at::empty({n, row_values}, floats);
      for (int64_t i = 0; i < n; ++i) {
        at::Tensor row = values[i];
        draw(row, at::detail::createCPUGenerator(splitmix64(seed + static_cast<uint64_t>(g + i))));
      }
    } else {
      if (c != chunk_index) {
        const int64_t first_row = c * chunk_rows;
        chunk = at::empty({std::min(chunk_rows, m.full_rows - first_row), row_values}, floats);
        draw(chunk, device_generator(device, splitmix64(seed + static_cast<uint64_t>(c))));
        chunk_index = c;
      }
      values = chunk.narrow(0, g - c * chunk_rows, n);
    }
    as_rows.narrow(0, r, n).copy_(local_part(values, m.slice));
    r += n;
  }
  if (!direct) param.detach().copy_(as_rows.view(param.sizes()));
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
  fill_rows(param, seed, [&](at::Tensor& out, at::Generator gen) { out.normal_(mean, std, gen); });
}

void uniform_(const at::Tensor& param, double low, double high, uint64_t seed) {
  torch::NoGradGuard no_grad;
  fill_rows(param, seed, [&](at::Tensor& out, at::Generator gen) { out.uniform_(low, high, gen); });
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
