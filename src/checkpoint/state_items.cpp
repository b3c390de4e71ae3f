#include "state_items.h"

#include <algorithm>
#include <mutex>
#include <set>

#include "box.h"
#include "fsdp/dist/runtime.h"
#include "fsdp/sharding/fully_shard.h"
#include "fsdp/tensor_parallel/placement.h"

namespace fsdp::checkpoint::detail {

std::string shape_text(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string key_list(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < 4; ++i) s += (i ? ", " : "") + keys[i];
  if (keys.size() > 4) s += ", ... (" + std::to_string(keys.size()) + " in all)";
  return s;
}

int global_rank() { return dist::is_initialized() ? dist::rank() : 0; }

at::Tensor box_of(const at::Tensor& full, const LocalItem& item) {
  return box_of(full, Piece{item.local, item.offsets});
}

at::Tensor box_of(const at::Tensor& full, const Piece& piece) {
  at::Tensor view = full;
  for (size_t d = 0; d < piece.offsets.size(); ++d)
    view = view.narrow(static_cast<int64_t>(d), piece.offsets[d], piece.local.size(static_cast<int64_t>(d)));
  return view;
}

std::vector<Piece> boxes(const LocalItem& item) {
  if (!item.pieces.empty()) return item.pieces;
  return {Piece{item.local, item.offsets}};
}

namespace {

// A tensor-parallel split of the (TP-local) tensor whose box is `box`: the global shape becomes
// the full parameter's, the offset along the TP dim adds up (FSDP's dim-0 offset lies within the
// TP-local tensor, and tp.dim may be 0 too), and the TP gather runs after FSDP's (FSDP shards the
// TP-local tensor, so its step rebuilds that first). `first`, `rows`: the TP-local rows (dim 0)
// this rank holds (all of them without FSDP). A strided placement cuts them into one Part per
// block they reach.
void add_tensor_parallel(ParamBox& box, const tp::TPPlacement& tp, int64_t first, int64_t rows) {
  box.global_shape = tp.global_shape;
  box.gather.push_back(
      GatherStep{tp.dim, tp.mesh.comm(0), tp.local_len(), tp.global_shape[static_cast<size_t>(tp.dim)], tp.blocks});
  if (tp.blocks <= 1) {
    box.offsets[static_cast<size_t>(tp.dim)] += tp.offset;
    return;
  }
  if (tp.dim != 0) {
    throw CheckpointError("checkpoint: a strided (fused) tensor-parallel placement along dim " +
                          std::to_string(tp.dim) + " is not supported; fuse along dim 0 (ColwiseParallel{.fused = k})");
  }
  box.offsets[0] = 0;  // the parts carry their own
  for (int64_t b = 0; b < tp.blocks; ++b) {
    const int64_t lo = std::max(first, b * tp.size), hi = std::min(first + rows, (b + 1) * tp.size);
    if (lo >= hi) continue;
    ParamBox::Part part;
    part.local_begin = lo - first;
    part.rows = hi - lo;
    part.offsets = box.offsets;
    part.offsets[0] = b * tp.block_len() + tp.offset + (lo - b * tp.size);
    box.parts.push_back(std::move(part));
  }
}

// Whether global rank `rank` is one of the mesh's ranks. The ranks are cached per mesh (its rank
// tensor, kept alive so that its address is not reused), since every parameter of a save asks.
bool holds_rank(const DeviceMesh& mesh, int rank) {
  static std::mutex mu;
  static std::map<const void*, std::pair<at::Tensor, std::set<int64_t>>> cache;
  const at::Tensor& ranks = mesh.mesh();
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(ranks.unsafeGetTensorImpl());
  if (it == cache.end()) {
    const at::Tensor flat = ranks.flatten().to(at::kLong).contiguous();
    std::set<int64_t> members(flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel());
    if (cache.size() > 4096) cache.clear();
    it = cache.emplace(ranks.unsafeGetTensorImpl(), std::make_pair(ranks, std::move(members))).first;
  }
  return it->second.second.count(rank) > 0;
}

}  // namespace

std::optional<ParamBox> param_box(const at::Tensor& param) {
  if (auto info = fsdp::shard_info(param)) {
    ParamBox box;
    box.global_shape = info->global_shape;
    box.offsets.assign(info->global_shape.size(), 0);
    // The rows are along shard_dim (0 unless shard_placement_fn chose another).
    const auto dim = static_cast<size_t>(info->shard_dim);
    if (!box.offsets.empty()) box.offsets[dim] = info->dim0_offset;
    // Replicas of a shard (HSDP) hold the same rows: the first one writes them. A parameter that
    // tensor parallelism leaves whole (e.g. a row-wise linear's bias) is sharded by every tp
    // rank's FSDP group alike: only the group holding global rank 0 writes it (the lowest rank
    // holding the key, when not every rank does: an expert's group under expert parallelism).
    const bool holds_rows = info->local_rows > 0 && info->replica_rank == 0, tp = info->tp.has_value();
    box.writer_if_first = [holds_rows, tp, mesh = info->mesh](int first) {
      return holds_rows && (tp || holds_rank(mesh, first));
    };
    box.writer = box.writer_if_first(0);
    // The shard dimension is the mesh's last; rank r holds rows [r * padded_rows, ...).
    box.gather.push_back(GatherStep{info->shard_dim, info->mesh.comm(info->mesh.ndim() - 1), info->padded_rows,
                                    info->global_shape.empty() ? 1 : info->global_shape[dim]});
    // A strided TP placement is along dim 0, which fully_shard keeps whole when shard_dim > 0.
    if (info->tp) {
      add_tensor_parallel(box, *info->tp, dim == 0 ? info->dim0_offset : 0,
                          dim == 0 ? info->local_rows : info->global_shape[0]);
    }
    return box;
  }
  // Tensor parallel without fully_shard: every tp rank holds its slice. Where the tp groups are
  // repeated (data parallel without sharding), the tp group holding global rank 0 writes.
  if (auto tp = tp::tp_placement(param)) {
    ParamBox box;
    box.global_shape = tp->global_shape;  // set again by add_tensor_parallel
    box.offsets.assign(tp->global_shape.size(), 0);
    box.writer_if_first = [holds = tp->size > 0, mesh = tp->mesh](int first) {
      return holds && holds_rank(mesh, first);
    };
    box.writer = box.writer_if_first(0);
    add_tensor_parallel(box, *tp, 0, tp->local_len());
    return box;
  }
  return std::nullopt;
}

// Geometry of a tensor shaped like parameter `param` (the parameter itself or its optimizer
// state): its box when it is sharded (param_box), else the whole tensor from rank 0. A strided
// TP shard gets one Piece per part (views of `local`).
LocalItem like_param(std::string key, const at::Tensor& param, const at::Tensor& local, int global_rank) {
  LocalItem item;
  item.key = std::move(key);
  item.local = local.detach();
  if (auto box = param_box(param)) {
    item.global_shape = std::move(box->global_shape);
    item.offsets = std::move(box->offsets);
    item.writer = box->writer;
    item.writer_if_first = std::move(box->writer_if_first);
    item.gather = std::move(box->gather);
    for (auto& part : box->parts)
      item.pieces.push_back(Piece{item.local.narrow(0, part.local_begin, part.rows), std::move(part.offsets)});
  } else {
    item.global_shape = local.sizes().vec();
    item.offsets.assign(item.global_shape.size(), 0);
    item.writer = global_rank == 0;
    item.writer_if_first = [global_rank](int first) { return global_rank == first; };
  }
  return item;
}

LocalItem whole(std::string key, const at::Tensor& t, int global_rank) {
  LocalItem item;
  item.key = std::move(key);
  item.local = t.detach();
  item.global_shape = t.sizes().vec();
  item.offsets.assign(item.global_shape.size(), 0);
  item.writer = global_rank == 0;
  item.writer_if_first = [global_rank](int first) { return global_rank == first; };
  return item;
}

std::vector<LocalItem> model_items(torch::nn::Module& model, int global_rank) {
  std::vector<LocalItem> items;
  for (const auto& entry : model.named_parameters(/*recurse=*/true))
    items.push_back(like_param("model." + entry.key(), entry.value(), entry.value(), global_rank));
  for (const auto& entry : model.named_buffers(/*recurse=*/true))
    items.push_back(whole("model." + entry.key(), entry.value(), global_rank));
  return items;
}

// optimizer_save_items / optimizer_load_items: optimizer_state.cpp (the codec registry).

std::vector<LocalItem> extra_save_items(const std::map<std::string, Stateful*>& extras, int global_rank) {
  std::vector<LocalItem> items;
  for (const auto& [name, stateful] : extras) {
    if (!stateful) continue;
    for (const auto& [key, value] : stateful->state_dict())
      items.push_back(whole("extra." + name + "." + key, value.contiguous(), global_rank));
  }
  return items;
}

std::vector<LocalItem> sharded_tensor_items(const std::map<std::string, ShardedTensor>& tensors,
                                            std::shared_ptr<comm::Comm> group) {
  std::vector<LocalItem> items;
  for (const auto& [key, t] : tensors) {
    auto bad = [&](const std::string& what) {
      return CheckpointError("checkpoint: State::tensors['" + key + "'] " + what);
    };
    if (!t.local.defined())
      throw bad("has no local tensor; set ShardedTensor::local (an empty box: a tensor with 0 elements)");
    const auto sizes = t.local.sizes().vec();
    if (t.global_shape.size() != sizes.size() || t.offsets.size() != sizes.size())
      throw bad("has a local tensor of " + std::to_string(sizes.size()) + " dims, global_shape of " +
                std::to_string(t.global_shape.size()) + " and offsets of " + std::to_string(t.offsets.size()) +
                "; give one offset and one global size per dimension of the local tensor");
    for (size_t d = 0; d < sizes.size(); ++d)
      if (t.offsets[d] < 0 || t.global_shape[d] < 0 || t.offsets[d] + sizes[d] > t.global_shape[d])
        throw bad("is a box at " + shape_text(t.offsets) + " of size " + shape_text(sizes) +
                  " that does not fit in the global shape " + shape_text(t.global_shape) +
                  "; fix its offsets or shape");
    LocalItem item;
    item.key = key;
    item.local = t.local.detach();
    item.global_shape = t.global_shape;
    item.offsets = t.offsets;
    // An empty box writes nothing, unless the whole tensor is empty (then its holders record it).
    item.writer = t.write && (t.local.numel() > 0 || volume(t.global_shape) == 0);
    item.box_group = group;
    items.push_back(std::move(item));
  }
  return items;
}

}  // namespace fsdp::checkpoint::detail
