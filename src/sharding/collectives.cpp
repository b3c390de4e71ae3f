#include "collectives.h"

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

#include "fsdp/compat/fused_copies.h"
#include "fsdp/debug/cpu_collectives.h"
#include "memory/buffer_alloc.h"

namespace fsdp::detail {

namespace {
// The contiguous `t`'s storage from element `offset` of t's as `sizes`, made without an operator.
at::Tensor reshaped_without_op(const at::Tensor& t, int64_t offset, at::IntArrayRef sizes) {
  c10::intrusive_ptr<c10::TensorImpl> impl = t.unsafeGetTensorImpl()->shallow_copy_and_detach(
      /*version_counter=*/c10::VariableVersion(0), /*allow_tensor_metadata_change=*/true);
  impl->set_storage_offset(t.storage_offset() + offset);
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

// out[i] at column `offset` gets shard rank (first_rank + i)'s padded rows of `full` (flat). The
// ranks whose rows all exist are one copy (a strided [k, padded_rows * row_numel] view of `out`
// from the contiguous rows of `full`), not one per rank; only a rank at the end with fewer rows
// (or none) than padded_rows takes a copy and a zero fill of its own.
void split_rows(const at::Tensor& full, const at::Tensor& out, int64_t offset, int first_rank, int64_t rows,
                int64_t row_numel, int64_t padded_rows) {
  const int64_t count = out.size(0), chunk = padded_rows * row_numel;
  const int64_t start = static_cast<int64_t>(first_rank) * padded_rows;
  const int64_t whole = std::clamp<int64_t>(padded_rows > 0 ? (rows - start) / padded_rows : 0, 0, count);
  if (whole > 0) {
    out.narrow(0, 0, whole)
        .narrow(1, offset, chunk)
        .copy_(full.narrow(0, start * row_numel, whole * chunk).view({whole, chunk}));
  }
  for (int64_t i = whole; i < count; ++i) {
    const int64_t first = start + i * padded_rows;
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(padded_rows, rows - first));
    if (n > 0) out[i].narrow(0, offset, n * row_numel).copy_(full.narrow(0, first * row_numel, n * row_numel));
    if (n < padded_rows) out[i].narrow(0, offset + n * row_numel, (padded_rows - n) * row_numel).zero_();
  }
}

// gathered [N, total] holds every rank's shards of `params`, side by side from column 0 (their
// unsharded storage allocated): the rows of each storage seen by rank
// (FSDPParam::unsharded_by_rank: room for every rank's padded rows, so the padding comes along).
// One op into all their storages where they compute in its dtype ([Note: one copy kernel per
// unit]), else a strided copy each (the inverse of split_rows).
void copy_out_side_by_side(const std::vector<FSDPParam*>& params, const at::Tensor& gathered) {
  std::vector<at::Tensor> outs;
  std::vector<int64_t> sizes;
  outs.reserve(params.size());
  sizes.reserve(params.size());
  bool one_op = !params.empty();
  int64_t total = 0;
  for (FSDPParam* p : params) {
    outs.push_back(p->unsharded_by_rank());
    sizes.push_back(p->shard_numel());
    one_op = one_op && p->compute_dtype() == gathered.scalar_type();
    total += p->shard_numel();
  }
  if (one_op && total > 0 && total == gathered.size(1)) {  // (CUDA's kernel divides by the total)
    at::split_with_sizes_copy_out(outs, gathered, sizes, 1);
    return;
  }
  int64_t offset = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    outs[i].copy_(gathered.narrow(1, offset, sizes[i]));
    offset += sizes[i];
  }
}

// `params` in order with their unsharded storage allocated, checking that `offsets` lay their
// shards side by side (what copy_out_side_by_side reads).
std::vector<FSDPParam*> allocated_side_by_side(const FSDPParams& params, const std::vector<int64_t>& offsets) {
  std::vector<FSDPParam*> in_order;
  in_order.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_INTERNAL_ASSERT(offsets[i] == (i == 0 ? 0 : offsets[i - 1] + params[i - 1]->shard_numel()),
                          "copy-out: the group's offsets are its shards side by side");
    in_order.push_back(params[i].get());
  }
  FSDPParam::alloc_unsharded_together(in_order);
  return in_order;
}

// Rank r's rows of `p`, as [first row, count): only the rows that exist (none for a rank past
// the end).
std::pair<int64_t, int64_t> rows_of(const FSDPParam& p, int r) {
  const int64_t first = std::min<int64_t>(static_cast<int64_t>(r) * p.padded_rows(), p.rows());
  return {first, std::max<int64_t>(0, std::min<int64_t>(p.padded_rows(), p.rows() - first))};
}

// Whether every shard can be sent as it lies: no cast to the compute dtype, shard and compute on
// the CPU, memory allocated (not meta).
bool shards_sent_as_they_are(const FSDPParams& params) {
  return std::all_of(params.begin(), params.end(), [](const auto& p) {
    return p->compute_dtype() == p->dtype() && p->device().is_cpu() && p->shard_device().is_cpu() &&
           !p->padded_shard().is_meta();
  });
}

bool small_shard(const FSDPParam& p, size_t min_bytes) {
  return static_cast<size_t>(p.shard_numel()) * c10::elementSize(p.compute_dtype()) < min_bytes;
}

// Whether gradient g of p can be reduced by the point-to-point paths on the CPU: float or double,
// already in p's reduce dtype, in CPU memory.
bool reducible_on_cpu(const FSDPParam& p, const at::Tensor& g) {
  const auto dtype = p.reduce_dtype();
  return g.scalar_type() == dtype && (dtype == at::kFloat || dtype == at::kDouble) && g.is_cpu();
}

// `flat`'s pieces by rank: rank r's rows of `p` (flat: the full parameter's elements).
std::vector<at::Tensor> pieces_by_rank(const FSDPParam& p, const at::Tensor& flat, int n) {
  std::vector<at::Tensor> pieces;
  for (int r = 0; r < n; ++r) {
    const auto [first, count] = rows_of(p, r);
    pieces.push_back(flat.narrow(0, first * p.row_numel(), count * p.row_numel()));
  }
  return pieces;
}

// The reduce-scatter input as one _chunk_cat ([Note: one copy kernel per unit]): on CUDA, where
// LibTorch has it, for contiguous gradients of one dtype on the input's device that CUDA's kernel
// takes (the input's dtype, or bf16 into float32), and padded rows that are torch.chunk's.
bool chunk_cat_fits(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, const at::Tensor& input) {
  if (!compat::kHasChunkCat || grads.empty() || !input.is_cuda()) return false;
  const at::ScalarType g0 = grads.front().second.scalar_type();
  if (g0 != input.scalar_type() && !(g0 == at::kBFloat16 && input.scalar_type() == at::kFloat)) return false;
  const int64_t n = input.size(0);
  for (const auto& [p, g] : grads) {
    // CUDA's _chunk_cat refuses an empty input ("expects non-empty tensor"): a [k, 0] gradient too.
    if (g.scalar_type() != g0 || g.device() != input.device() || !g.is_contiguous() || p->rows() == 0 ||
        g.numel() == 0 || g.numel() != p->rows() * p->row_numel() || p->padded_rows() != (p->rows() + n - 1) / n) {
      return false;
    }
  }
  return true;
}

// The reduce-scatter input as one at::cat_out along dim 1 (LibTorch 1.13 has it; the CPU's path,
// [Note: one copy kernel per unit]): where every gradient splits into the N ranks' rows with no
// padding (rows == N * padded_rows), has the input's dtype and device and is contiguous, rank r's
// row of the input is the r-th of each gradient's N equal parts side by side, so each gradient seen
// as [N, shard_numel] (a view) is one piece of the concatenation. Otherwise (padding, a cast,
// another device) false: split_rows per gradient.
bool cat_fits(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, const at::Tensor& input) {
  const int64_t n = input.size(0);
  return !grads.empty() && input.is_contiguous() && std::all_of(grads.begin(), grads.end(), [&](const auto& pg) {
    const auto& [p, g] = pg;
    return g.scalar_type() == input.scalar_type() && g.device() == input.device() && g.is_contiguous() &&
           p->rows() == n * p->padded_rows() && g.numel() == p->rows() * p->row_numel();
  });
}

std::vector<at::Tensor> rows_by_rank(const at::Tensor& packed) {
  std::vector<at::Tensor> rows;
  for (int64_t r = 0; r < packed.size(0); ++r) rows.push_back(packed[r]);
  return rows;
}

// FSDP_CPU_PIECE_BYTES: min_piece_bytes as a decimal byte count (0: every unit per parameter).
size_t min_piece_bytes_from_env(size_t fallback) {
  const char* v = std::getenv("FSDP_CPU_PIECE_BYTES");
  if (!v || !*v) return fallback;
  const std::string s = v;
  if (s.find_first_not_of("0123456789") == std::string::npos && s.size() <= 15) return std::stoull(s);
  throw std::invalid_argument("fsdp: FSDP_CPU_PIECE_BYTES='" + s +
                              "' is not a byte count; give a whole number of bytes (e.g. 1048576, the default; 0 "
                              "sends every unit per parameter) or unset it");
}

CpuCollectiveOptions options_from_env() {
  CpuCollectiveOptions o;
  o.min_piece_bytes = min_piece_bytes_from_env(o.min_piece_bytes);
  const char* v = std::getenv("FSDP_CPU_COLLECTIVES");
  const std::string s = v ? v : "";
  if (s == "flat") {
    o.gather_per_parameter = o.reduce_per_parameter = false;
    return o;
  }
  if (s.empty() || s == "pieces" || s == "gather-pieces" || s == "reduce-pieces") {
    o.gather_per_parameter = s != "reduce-pieces";
    o.reduce_per_parameter = s != "gather-pieces";
    return o;
  }
  throw std::invalid_argument("fsdp: FSDP_CPU_COLLECTIVES='" + s +
                              "' is not a layout; use pieces (the default: per parameter where a unit holds a "
                              "shard of 1 MiB or more), flat, gather-pieces or reduce-pieces");
}

std::mutex g_options_mu;
bool g_options_set = false;
CpuCollectiveOptions g_options;
std::atomic<uint64_t> g_options_epoch{0};

// The reduce-scatter input [N, total] written by one op where one fits (_chunk_cat on CUDA, else
// cat along dim 1), `placed` getting each gradient's offset; false (nothing written) otherwise. The
// gradients are all held already (the peak: they and the input), so one op over all of them, not
// a copy each freed at once, leaves the peak as it was.
bool copy_in_one_op(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, const at::Tensor& input,
                    std::vector<std::pair<FSDPParam*, int64_t>>& placed) {
  const int64_t n = input.size(0);
  const bool chunk_cat = chunk_cat_fits(grads, input);
  if (!chunk_cat && !cat_fits(grads, input)) return false;
  std::vector<at::Tensor> parts;
  parts.reserve(grads.size());
  int64_t offset = 0;
  for (const auto& [p, g] : grads) {
    // _chunk_cat takes each in its own shape (it cuts along dim 0 whatever the trailing dims): no
    // view op per parameter, but for a 0-dim one (FSDP shards it as one row). cat takes [N, shard].
    // (cat_fits checked each contiguous: its [N, shard] view made without an operator.)
    parts.push_back(chunk_cat ? (g.dim() == 0 ? g.view({1}) : g) : reshaped_without_op(g, 0, {n, p->shard_numel()}));
    placed.emplace_back(p, offset);
    offset += p->shard_numel();
  }
  at::Tensor out = input;  // a handle: both write into the same memory
  if (chunk_cat) {
    compat::chunk_cat_rows(parts, n, out);
  } else {
    at::cat_out(out, at::TensorList(parts), 1);
  }
  return true;
}

}  // namespace

at::Tensor row_of(const at::Tensor& t, int64_t row) {
  TORCH_INTERNAL_ASSERT(t.dim() == 2 && row >= 0 && row < t.size(0), "row_of: a row of a 2-D tensor");
  if (!t.is_contiguous()) return t[row];
  return reshaped_without_op(t, row * t.size(1), {t.size(1)});
}

uint64_t cpu_collective_options_epoch() { return g_options_epoch.load(std::memory_order_acquire); }

}  // namespace fsdp::detail

namespace fsdp {

void set_cpu_collective_options(const CpuCollectiveOptions& options) {
  std::lock_guard<std::mutex> lock(detail::g_options_mu);
  detail::g_options = options;
  detail::g_options_set = true;
  detail::g_options_epoch.fetch_add(1, std::memory_order_acq_rel);  // the units choose their collectives again
}

CpuCollectiveOptions cpu_collective_options() {
  std::lock_guard<std::mutex> lock(detail::g_options_mu);
  if (!detail::g_options_set) {
    detail::g_options = detail::options_from_env();
    detail::g_options_set = true;
  }
  return detail::g_options;
}

}  // namespace fsdp

namespace fsdp::detail {

bool gathers_per_parameter(const FSDPParams& params) {
  const CpuCollectiveOptions o = cpu_collective_options();
  if (params.empty() || !o.gather_per_parameter) return false;
  // A unit of small shards only: one flat message (cpu_collectives.h).
  if (std::all_of(params.begin(), params.end(), [&](const auto& p) { return small_shard(*p, o.min_piece_bytes); })) {
    return false;
  }
  return shards_sent_as_they_are(params);
}

GatherPieces build_gather_pieces(const FSDPParams& params, int rank, int n) {
  const size_t min_bytes = cpu_collective_options().min_piece_bytes;
  GatherPieces out;
  int64_t packed_total = 0;
  for (const auto& p : params) {
    if (small_shard(*p, min_bytes)) packed_total += p->shard_numel();
  }
  if (packed_total > 0) {
    out.packed = empty_buffer({n, packed_total}, params.front()->padded_shard().options().requires_grad(false),
                              BufferOwner::AllGatherOutput);
  }
  torch::NoGradGuard no_grad;
  {
    std::vector<FSDPParam*> all;
    all.reserve(params.size());
    for (const auto& p : params) all.push_back(p.get());
    FSDPParam::alloc_unsharded_together(all);
  }
  int64_t offset = 0;
  for (const auto& p : params) {
    if (small_shard(*p, min_bytes)) {
      out.packed[rank].narrow(0, offset, p->shard_numel()).copy_(p->padded_shard());
      out.packed_params.push_back(p.get());
      offset += p->shard_numel();
      continue;
    }
    out.ins.push_back(p->padded_shard().narrow(0, 0, p->local_rows() * p->row_numel()));
    out.outs.push_back(pieces_by_rank(*p, p->unsharded_alias().view(-1), n));
  }
  if (out.packed.defined()) {
    out.ins.push_back(out.packed[rank]);
    out.outs.push_back(rows_by_rank(out.packed));
  }
  return out;
}

void copy_out_gather_pieces(const GatherPieces& pieces) {
  // The packing decided when the gather was issued (the options may have changed since).
  torch::NoGradGuard no_grad;
  copy_out_side_by_side(pieces.packed_params, pieces.packed);
}

bool reduces_per_parameter(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads) {
  const CpuCollectiveOptions o = cpu_collective_options();
  if (grads.empty() || !o.reduce_per_parameter) return false;
  if (std::all_of(grads.begin(), grads.end(),
                  [&](const auto& pg) { return small_shard(*pg.first, o.min_piece_bytes); })) {
    return false;
  }
  return std::all_of(grads.begin(), grads.end(), [](const auto& pg) { return reducible_on_cpu(*pg.first, pg.second); });
}

ReducePieces build_reduce_pieces(std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int rank, int n) {
  const size_t min_bytes = cpu_collective_options().min_piece_bytes;
  ReducePieces out;
  int64_t packed_total = 0;
  for (const auto& [p, g] : grads) {
    if (small_shard(*p, min_bytes)) packed_total += p->shard_numel();
  }
  if (packed_total > 0) {
    out.packed = empty_buffer({n, packed_total}, grads.front().second.options().requires_grad(false),
                              BufferOwner::ReduceScatterInput);
  }
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& [p, g] : grads) {
    if (small_shard(*p, min_bytes)) {
      split_rows(g.contiguous().view(-1), out.packed, offset, 0, p->rows(), p->row_numel(), p->padded_rows());
      out.results.push_back({p, {out.packed[rank], offset}});
      offset += p->shard_numel();
      g = at::Tensor();  // in the packed buffer now: freed
      continue;
    }
    at::Tensor flat = g.contiguous().view(-1);
    std::vector<at::Tensor> by_rank = pieces_by_rank(*p, flat, n);
    out.outs.push_back(by_rank[static_cast<size_t>(rank)]);  // reduced in place, in this rank's rows
    out.results.push_back({p, {by_rank[static_cast<size_t>(rank)], 0}});
    out.ins.push_back(std::move(by_rank));
    out.grad_bytes += static_cast<int64_t>(flat.nbytes());
    out.grads.push_back(std::move(flat));
    g = at::Tensor();
  }
  grads.clear();
  if (out.packed.defined()) {
    out.outs.push_back(out.packed[rank]);
    out.ins.push_back(rows_by_rank(out.packed));
  }
  count_buffer(BufferOwner::UnshardedGrads, out.grad_bytes);
  return out;
}

void release_reduce_pieces(ReducePieces& pieces) {
  count_buffer(BufferOwner::UnshardedGrads, -pieces.grad_bytes);
  release_buffer(pieces.packed);
  pieces = ReducePieces();
}

// [Note: one copy kernel per unit] Each phase's copies are one op for the whole unit, as FSDP2's
// _fsdp_collectives.py makes them, so that a GPU launches one copy kernel per unit and phase, not
// one per parameter (the H200's trace of train_gpt counted 293 copy-in and 293 copy-out copies a
// step, docs/gpu.md):
//  - copy-in: one copy_ of the unit's shard buffer into the input, the cast inside, where the
//    shards lie in one buffer ([Note: the shards in one buffer], fsdp_param_group.cpp: from the
//    first all-gather on; no per-parameter op at all). Else
//    at::cat_out of the shards where they have the input's dtype; under mixed precision (a cast)
//    at::_foreach_copy_ into the input's slices (one multi-tensor kernel on CUDA, LibTorch 2.1+:
//    compat/fused_copies.h); a copy per parameter otherwise (1.13, or offloaded shards: a
//    host-to-device transfer each).
//  - copy-out: at::split_with_sizes_copy_out of the all-gather output [N, total] along dim 1 into
//    each parameter's unsharded storage seen as [N, shard_numel] (FSDPParam::unsharded_by_rank:
//    the storage holds the padding rows, as FSDP2's padded unsharded parameters do). One kernel on
//    CUDA (2.3+); on the CPU one op still (its copies inside).
//  - reduce-scatter input: at::_chunk_cat_out (LibTorch 2.4+) on CUDA, the padding zeroed and a
//    bf16 gradient cast to a float32 reduction in the same kernel. Elsewhere, where no gradient
//    needs padding or a cast, one at::cat_out along dim 1 of the gradients seen as [N, shard_numel]
//    (cat_fits); else split_rows per gradient.
// tests/sharding/test_fused_copies.cpp checks on the CPU that these ops lay rows out as
// split_rows does (uneven rows, more ranks than rows, a cast); the parity tests run them.
void copy_in_all_gather_input(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& input,
                              const at::Tensor& shard_buffer) {
  torch::NoGradGuard no_grad;
  if (shard_buffer.defined()) {
    TORCH_INTERNAL_ASSERT(shard_buffer.numel() == input.numel(), "copy-in: the shard buffer holds the unit's total");
    input.copy_(shard_buffer, /*non_blocking=*/true);
    return;
  }
  // One op for the whole unit where every shard is on the input's device with one dtype: a
  // concatenation where that is the input's (the offsets are the shards side by side), else a
  // multi-tensor copy with the cast where this LibTorch has it; else a copy (a cast, or a
  // host-to-device transfer) per parameter.
  std::vector<at::Tensor> shards;
  shards.reserve(params.size());
  bool one_op = !params.empty(), side_by_side = true;
  int64_t next = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& shard = params[i]->padded_shard();
    shards.push_back(shard);
    one_op = one_op && shard.device() == input.device() && shard.scalar_type() == shards.front().scalar_type();
    side_by_side = side_by_side && offsets[i] == next;
    next += params[i]->shard_numel();
  }
  if (one_op && side_by_side && next == input.numel() && shards.front().scalar_type() == input.scalar_type()) {
    at::Tensor out = input;  // a handle: cat_out writes into the same memory
    at::cat_out(out, at::TensorList(shards), 0);
    return;
  }
  std::vector<at::Tensor> dsts;
  dsts.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) dsts.push_back(input.narrow(0, offsets[i], params[i]->shard_numel()));
  if (one_op && compat::kHasForeachCopy) {
    compat::foreach_copy(dsts, shards);
    return;
  }
  for (size_t i = 0; i < params.size(); ++i) dsts[i].copy_(shards[i], /*non_blocking=*/true);
}

void copy_out_all_gather_output(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& output,
                                int64_t total) {
  torch::NoGradGuard no_grad;
  const at::Tensor gathered = output.view({-1, total});
  copy_out_side_by_side(allocated_side_by_side(params, offsets), gathered);
}

void copy_in_post_forward(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& out,
                          int first_rank) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    split_rows(p.unsharded_alias().view(-1), out, offsets[i], first_rank, p.rows(), p.row_numel(), p.padded_rows());
  }
}

at::Tensor build_reduce_scatter_input(std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int n,
                                      at::ScalarType dtype, std::vector<std::pair<FSDPParam*, int64_t>>& placed,
                                      const std::function<at::Tensor(int64_t, const at::TensorOptions&)>& allocate) {
  int64_t total = 0, grad_bytes = 0;
  for (const auto& [p, g] : grads) {
    total += p->shard_numel();
    grad_bytes += static_cast<int64_t>(g.nbytes());
  }
  // The unsharded gradients are FSDP's to free from here on: counted until they are.
  count_buffer(BufferOwner::UnshardedGrads, grad_bytes);
  const auto options = grads.front().second.options().dtype(dtype).requires_grad(false);
  at::Tensor input = allocate ? allocate(n * total, options).view({n, total})
                              : empty_buffer({n, total}, options, BufferOwner::ReduceScatterInput);
  placed.clear();
  int64_t offset = 0;
  torch::NoGradGuard no_grad;
  if (copy_in_one_op(grads, input, placed)) {  // [Note: one copy kernel per unit]
    count_buffer(BufferOwner::UnshardedGrads, -grad_bytes);
    grads.clear();
    return input;
  }
  for (auto& [p, g] : grads) {
    split_rows(g.contiguous().view(-1), input, offset, 0, p->rows(), p->row_numel(), p->padded_rows());
    placed.emplace_back(p, offset);
    offset += p->shard_numel();
    count_buffer(BufferOwner::UnshardedGrads, -static_cast<int64_t>(g.nbytes()));
    g = at::Tensor();  // freed now (the last reference), before the next one is copied
  }
  grads.clear();
  return input;
}

}  // namespace fsdp::detail
