#include "state_items.h"

#include "fsdp/dist/runtime.h"
#include "fsdp/sharding/fully_shard.h"

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

int64_t local_rows(const LocalItem& item) { return item.local.dim() == 0 ? 1 : item.local.size(0); }

int64_t global_rows(const std::vector<int64_t>& shape) { return shape.empty() ? 1 : shape[0]; }

int64_t row_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

// Geometry of a tensor shaped like parameter `param` (the parameter itself or its optimizer
// state): sharded rows when fully_shard manages it, else the whole tensor from rank 0.
LocalItem like_param(std::string key, const at::Tensor& param, const at::Tensor& local, int global_rank) {
  LocalItem item;
  item.key = std::move(key);
  item.local = local.detach();
  if (auto info = fsdp::shard_info(param)) {
    item.global_shape = info->global_shape;
    item.row_offset = info->dim0_offset;
    // Replicas of a shard (HSDP) hold the same rows: the first one writes them.
    item.writer = info->local_rows > 0 && info->replica_rank == 0;
    item.shard_comm = info->mesh.comm(info->mesh.ndim() - 1);  // the shard dimension is the last
    item.padded_rows = info->padded_rows;
  } else {
    item.global_shape = local.sizes().vec();
    item.writer = global_rank == 0;
  }
  return item;
}

LocalItem whole(std::string key, const at::Tensor& t, int global_rank) {
  LocalItem item;
  item.key = std::move(key);
  item.local = t.detach();
  item.global_shape = t.sizes().vec();
  item.writer = global_rank == 0;
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

}  // namespace fsdp::checkpoint::detail
