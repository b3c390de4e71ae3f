#include "state_items.h"

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <unordered_set>

#include "box.h"
#include "fsdp/compat/optim.h"
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

at::Tensor box_of(const at::Tensor& full, const LocalItem& item) {
  at::Tensor view = full;
  for (size_t d = 0; d < item.offsets.size(); ++d)
    view = view.narrow(static_cast<int64_t>(d), item.offsets[d], item.local.size(static_cast<int64_t>(d)));
  return view;
}

std::optional<ParamBox> param_box(const at::Tensor& param) {
  auto info = fsdp::shard_info(param);
  if (!info) return std::nullopt;
  ParamBox box;
  box.global_shape = info->global_shape;
  box.offsets.assign(info->global_shape.size(), 0);
  if (!box.offsets.empty()) box.offsets[0] = info->dim0_offset;
  // Replicas of a shard (HSDP) hold the same rows: the first one writes them.
  box.writer = info->local_rows > 0 && info->replica_rank == 0;
  // The shard dimension is the mesh's last; rank r holds rows [r * padded_rows, ...).
  box.gather.push_back(GatherStep{0, info->mesh.comm(info->mesh.ndim() - 1), info->padded_rows,
                                  info->global_shape.empty() ? 1 : info->global_shape[0]});
  // Tensor parallel: extend here (see state_items.h, "the parallelism glue point").
  return box;
}

namespace {

// Geometry of a tensor shaped like parameter `param` (the parameter itself or its optimizer
// state): its box when it is sharded (param_box), else the whole tensor from rank 0.
LocalItem like_param(std::string key, const at::Tensor& param, const at::Tensor& local, int global_rank) {
  LocalItem item;
  item.key = std::move(key);
  item.local = local.detach();
  if (auto box = param_box(param)) {
    item.global_shape = std::move(box->global_shape);
    item.offsets = std::move(box->offsets);
    item.writer = box->writer;
    item.gather = std::move(box->gather);
  } else {
    item.global_shape = local.sizes().vec();
    item.offsets.assign(item.global_shape.size(), 0);
    item.writer = global_rank == 0;
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
  return item;
}

std::unordered_set<const void*> optimizer_params(const torch::optim::Optimizer& optimizer) {
  std::unordered_set<const void*> params;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) params.insert(p.unsafeGetTensorImpl());
  return params;
}

enum class OptimizerKind { Adam, AdamW, SGD, Other };

OptimizerKind kind_of(torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) return OptimizerKind::AdamW;
  if (dynamic_cast<torch::optim::Adam*>(&optimizer)) return OptimizerKind::Adam;
  if (dynamic_cast<torch::optim::SGD*>(&optimizer)) return OptimizerKind::SGD;
  return OptimizerKind::Other;
}

[[noreturn]] void unsupported_optimizer() {
  throw CheckpointError(
      "checkpoint: this optimizer's state cannot be saved or loaded by name (supported: Adam, AdamW, SGD); "
      "leave State::optimizer unset and save its state yourself");
}

// Adam and AdamW keep the same fields under different types.
template <typename AdamState>
void adam_items(const std::string& prefix, const at::Tensor& p, AdamState& s, int rank, std::vector<LocalItem>& out) {
  out.push_back(like_param(prefix + "exp_avg", p, s.exp_avg(), rank));
  out.push_back(like_param(prefix + "exp_avg_sq", p, s.exp_avg_sq(), rank));
  if (s.max_exp_avg_sq().defined()) out.push_back(like_param(prefix + "max_exp_avg_sq", p, s.max_exp_avg_sq(), rank));
  out.push_back(whole(prefix + "step", at::scalar_tensor(s.step(), at::kLong), rank));
}

template <typename AdamState>
void adam_load_items(const std::string& prefix, const at::Tensor& p, AdamState& s,
                     const std::function<bool(const std::string&)>& has_key, std::vector<LocalItem>& out) {
  if (!s.exp_avg().defined()) s.exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
  if (!s.exp_avg_sq().defined()) s.exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  if (has_key(prefix + "max_exp_avg_sq") && !s.max_exp_avg_sq().defined())
    s.max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
  out.push_back(like_param(prefix + "exp_avg", p, s.exp_avg(), -1));
  out.push_back(like_param(prefix + "exp_avg_sq", p, s.exp_avg_sq(), -1));
  if (s.max_exp_avg_sq().defined()) out.push_back(like_param(prefix + "max_exp_avg_sq", p, s.max_exp_avg_sq(), -1));
  at::Tensor step_value = at::scalar_tensor(s.step(), at::kLong);
  LocalItem item = whole(prefix + "step", step_value, -1);
  item.on_loaded = [&s, step_value] { s.step(step_value.template item<int64_t>()); };
  out.push_back(std::move(item));
}

}  // namespace

std::vector<LocalItem> model_items(torch::nn::Module& model, int global_rank) {
  std::vector<LocalItem> items;
  for (const auto& entry : model.named_parameters(/*recurse=*/true))
    items.push_back(like_param("model." + entry.key(), entry.value(), entry.value(), global_rank));
  for (const auto& entry : model.named_buffers(/*recurse=*/true))
    items.push_back(whole("model." + entry.key(), entry.value(), global_rank));
  return items;
}

std::vector<LocalItem> optimizer_save_items(torch::optim::Optimizer& optimizer, torch::nn::Module& model,
                                            int global_rank) {
  std::vector<LocalItem> items;
  if (optimizer.state().empty()) return items;
  const OptimizerKind kind = kind_of(optimizer);
  if (kind == OptimizerKind::Other) unsupported_optimizer();
  const auto in_optimizer = optimizer_params(optimizer);
  for (const auto& entry : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = entry.value();
    if (!in_optimizer.count(p.unsafeGetTensorImpl())) continue;
    auto found = optimizer.state().find(compat::optimizer_state_key(p));
    if (found == optimizer.state().end()) continue;
    const std::string prefix = "optim." + entry.key() + ".";
    auto& state = *found->second;
    if (kind == OptimizerKind::AdamW) {
      adam_items(prefix, p, static_cast<torch::optim::AdamWParamState&>(state), global_rank, items);
    } else if (kind == OptimizerKind::Adam) {
      adam_items(prefix, p, static_cast<torch::optim::AdamParamState&>(state), global_rank, items);
    } else {
      auto& s = static_cast<torch::optim::SGDParamState&>(state);
      if (s.momentum_buffer().defined()) items.push_back(like_param(prefix + "momentum_buffer", p, s.momentum_buffer(), global_rank));
    }
  }
  return items;
}

std::vector<LocalItem> optimizer_load_items(torch::optim::Optimizer& optimizer, torch::nn::Module& model,
                                            const std::function<bool(const std::string&)>& has_key) {
  std::vector<LocalItem> items;
  const OptimizerKind kind = kind_of(optimizer);
  const auto in_optimizer = optimizer_params(optimizer);
  for (const auto& entry : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = entry.value();
    if (!in_optimizer.count(p.unsafeGetTensorImpl())) continue;
    const std::string prefix = "optim." + entry.key() + ".";
    const bool adam_like = has_key(prefix + "exp_avg") || has_key(prefix + "step");
    const bool sgd_like = has_key(prefix + "momentum_buffer");
    if (!adam_like && !sgd_like) continue;
    if (kind == OptimizerKind::Other) unsupported_optimizer();
    if ((adam_like && kind == OptimizerKind::SGD) || (sgd_like && kind != OptimizerKind::SGD))
      throw CheckpointError("checkpoint: optimizer state of '" + entry.key() + "' was saved by " +
                            (adam_like ? "Adam/AdamW" : "SGD") +
                            " but the optimizer given is not one; build the same optimizer type or load with "
                            "LoadOptions::load_optimizer = false");
    auto& slot = optimizer.state()[compat::optimizer_state_key(p)];
    if (kind == OptimizerKind::AdamW) {
      if (!slot) slot = std::make_unique<torch::optim::AdamWParamState>();
      adam_load_items(prefix, p, static_cast<torch::optim::AdamWParamState&>(*slot), has_key, items);
    } else if (kind == OptimizerKind::Adam) {
      if (!slot) slot = std::make_unique<torch::optim::AdamParamState>();
      adam_load_items(prefix, p, static_cast<torch::optim::AdamParamState&>(*slot), has_key, items);
    } else {
      if (!slot) slot = std::make_unique<torch::optim::SGDParamState>();
      auto& s = static_cast<torch::optim::SGDParamState&>(*slot);
      if (!s.momentum_buffer().defined()) s.momentum_buffer(at::zeros_like(p, at::MemoryFormat::Preserve));
      items.push_back(like_param(prefix + "momentum_buffer", p, s.momentum_buffer(), -1));
    }
  }
  return items;
}

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
    if (!t.local.defined()) throw bad("has no local tensor; set ShardedTensor::local (an empty box: a tensor with 0 elements)");
    const auto sizes = t.local.sizes().vec();
    if (t.global_shape.size() != sizes.size() || t.offsets.size() != sizes.size())
      throw bad("has a local tensor of " + std::to_string(sizes.size()) + " dims, global_shape of " +
                std::to_string(t.global_shape.size()) + " and offsets of " + std::to_string(t.offsets.size()) +
                "; give one offset and one global size per dimension of the local tensor");
    for (size_t d = 0; d < sizes.size(); ++d)
      if (t.offsets[d] < 0 || t.global_shape[d] < 0 || t.offsets[d] + sizes[d] > t.global_shape[d])
        throw bad("is a box at " + shape_text(t.offsets) + " of size " + shape_text(sizes) +
                  " that does not fit in the global shape " + shape_text(t.global_shape) + "; fix its offsets or shape");
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
