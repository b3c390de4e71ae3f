// Full / sharded state dicts and safetensors export / import. Full tensors are gathered one at a
// time over the parameter's shard group, so no rank ever holds more than the largest parameter
// beyond its own shards (rank 0 also holds what it is about to write or return).
#include "fsdp/checkpoint/state_dict.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>

#include "box.h"
#include "file_plan.h"
#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/dist/runtime.h"
#include "fsdp/tensor_parallel/placement.h"
#include "state_dict_selection.h"
#include "state_items.h"

namespace fsdp::checkpoint {

namespace detail {

// One GatherStep: the tensor rebuilt along step.dim from every rank of step.comm (rank r holds
// [r * per_rank, ...) along it, the last ranks fewer or none).
at::Tensor gather_along_dim(const at::Tensor& local, const GatherStep& step);
at::Tensor gather_along(const at::Tensor& local, const GatherStep& step) {
  // A strided split: the ranks' parts, each `blocks` pieces, back in block-major order.
  return tp::interleave_blocks(gather_along_dim(local, step), step.dim, step.comm->size(), step.blocks);
}

at::Tensor gather_along_dim(const at::Tensor& local, const GatherStep& step) {
  auto& group = *step.comm;
  const int64_t dim = step.dim;
  std::vector<int64_t> padded_shape = local.sizes().vec();
  padded_shape[dim] = step.per_rank;
  at::Tensor padded = at::zeros(padded_shape, local.options());
  padded.narrow(dim, 0, local.size(dim)).copy_(local);
  if (dim == 0) {  // rank order is row order: no reordering needed
    padded_shape[0] = step.per_rank * group.size();
    at::Tensor gathered = at::empty(padded_shape, local.options());
    group.all_gather_into_tensor(gathered, padded);
    return gathered.narrow(0, 0, step.full);
  }
  std::vector<int64_t> stacked_shape = padded_shape;
  stacked_shape.insert(stacked_shape.begin(), group.size());
  at::Tensor gathered = at::empty(stacked_shape, local.options());
  group.all_gather_into_tensor(gathered, padded);
  std::vector<at::Tensor> pieces;
  for (int64_t r = 0; r < group.size(); ++r) {
    const int64_t held = std::clamp<int64_t>(step.full - r * step.per_rank, 0, step.per_rank);
    if (held > 0) pieces.push_back(gathered[r].narrow(dim, 0, held));
  }
  return at::cat(pieces, dim);
}

// Any box layout (ShardedTensor entries): every rank's box (offsets, sizes) and data over `group`,
// placed into the whole tensor; boxes held twice (replicas) hold the same values. Elements no box
// covers are an error naming the key.
namespace {
at::Tensor gather_boxes(const LocalItem& item, comm::Comm& group) {
  const int64_t nd = static_cast<int64_t>(item.global_shape.size());
  const int world = group.size();
  // Boxes travel on the tensor's device (NCCL takes only CUDA tensors, Gloo either).
  std::vector<int64_t> box(item.offsets);
  for (int64_t d = 0; d < nd; ++d) box.push_back(item.local.size(d));
  box.push_back(item.local.numel());
  const at::Tensor meta = at::tensor(box, at::kLong).to(item.local.device());
  at::Tensor metas = at::empty({world * (2 * nd + 1)}, meta.options());
  group.all_gather_into_tensor(metas, meta);
  metas = metas.cpu().view({world, 2 * nd + 1});
  const int64_t most = metas.select(1, 2 * nd).max().item<int64_t>();
  const auto cpu = item.local.options();
  at::Tensor flat = at::zeros({std::max<int64_t>(most, 1)}, cpu);
  if (item.local.numel() > 0) flat.narrow(0, 0, item.local.numel()).copy_(item.local.reshape({-1}));
  at::Tensor all = at::empty({world * flat.numel()}, cpu);
  group.all_gather_into_tensor(all, flat);
  all = all.view({world, flat.numel()});
  at::Tensor full = at::empty(item.global_shape, cpu);
  at::Tensor seen = at::zeros(item.global_shape, at::kBool);
  for (int r = 0; r < world; ++r) {
    std::vector<int64_t> sizes(nd);
    for (int64_t d = 0; d < nd; ++d) sizes[d] = metas[r][nd + d].item<int64_t>();
    const int64_t numel = metas[r][2 * nd].item<int64_t>();
    if (numel == 0) continue;
    at::Tensor dst = full, mark = seen;
    for (int64_t d = 0; d < nd; ++d) {
      const int64_t off = metas[r][d].item<int64_t>();
      dst = dst.narrow(d, off, sizes[d]);
      mark = mark.narrow(d, off, sizes[d]);
    }
    dst.copy_(all[r].narrow(0, 0, numel).view(sizes));
    mark.fill_(true);
  }
  if (!seen.all().item<bool>())
    throw CheckpointError("get_tensor_state_dict: the ranks' boxes of '" + item.key + "' (shape " +
                          shape_text(item.global_shape) +
                          ") leave elements uncovered; give every element to at least one rank");
  return full;
}

}  // namespace

// The whole tensor of `item` on every rank of its groups (collective for sharded items): each
// GatherStep in order (FSDP's dim 0, then e.g. tensor parallel's dim), or any box layout.
at::Tensor gather_full(const LocalItem& item) {
  if (item.box_group) return gather_boxes(item, *item.box_group);
  at::Tensor t = item.local;
  for (const auto& step : item.gather) t = gather_along(t, step);
  return t;
}

}  // namespace detail

namespace fs = std::filesystem;
using detail::global_rank;
using detail::key_list;
using detail::gather_full;
using detail::LocalItem;
using detail::shape_text;

namespace {

std::string strip(const std::string& key, const std::string& prefix) {
  return key.rfind(prefix, 0) == 0 ? key.substr(prefix.size()) : key;
}

void throw_if_strict(const LoadResult& result, bool strict, const std::string& what) {
  if (!strict || (result.missing_keys.empty() && result.unexpected_keys.empty())) return;
  std::string message = what + " does not match the model: ";
  if (!result.missing_keys.empty()) message += "missing " + key_list(result.missing_keys);
  if (!result.missing_keys.empty() && !result.unexpected_keys.empty()) message += "; ";
  if (!result.unexpected_keys.empty()) message += "unexpected " + key_list(result.unexpected_keys);
  throw CheckpointError(message + " (strict = false loads the keys both have)");
}

// Copies into `item` its box of `source` (global shape), or all of `source` when it is already
// this rank's box.
void fill(LocalItem& item, const at::Tensor& source, bool source_is_full) {
  at::NoGradGuard no_grad;
  if (!source_is_full)
    item.local.copy_(source);
  else
    for (const auto& piece : detail::boxes(item))  // a strided TP shard: several boxes
      if (piece.local.numel() > 0) piece.local.copy_(detail::box_of(source, piece));
  if (item.on_loaded) item.on_loaded();
}

StateDict get_items(std::vector<LocalItem> items, const std::string& prefix, const StateDictOptions& options) {
  StateDict out;
  const bool keep = !options.cpu_offload || global_rank() == 0;
  for (auto& item : items) {
    const std::string name = strip(item.key, prefix);
    if (!options.full_state_dict) {
      out[name] = item.local;
      continue;
    }
    at::Tensor full = gather_full(item);
    if (keep) out[name] = options.cpu_offload ? full.to(at::kCPU, false, /*copy=*/true) : full.clone();
  }
  return out;
}

// Sets `items` from `dict` (keys without `prefix`), locally or broadcast from rank 0.
LoadResult set_items(std::vector<LocalItem> items, const StateDict& dict, const std::string& prefix,
                     const StateDictOptions& options, const std::string& what) {
  LoadResult result;
  std::set<std::string> used;
  const bool broadcast = options.broadcast_from_rank0 && dist::is_initialized() && dist::world_size() > 1;
  const bool full = options.full_state_dict || options.broadcast_from_rank0;
  auto world = broadcast ? dist::world_comm() : nullptr;
  const bool root = global_rank() == 0;
  // The small status broadcasts travel on the model's device: NCCL (a CUDA model's world group)
  // takes only CUDA tensors, Gloo takes either.
  const at::TensorOptions code_options =
      at::TensorOptions(at::kLong).device(items.empty() ? at::Device(at::kCPU) : items.front().local.device());
  for (auto& item : items) {
    const std::string name = strip(item.key, prefix);
    auto found = dict.find(name);
    const at::IntArrayRef want = full ? at::IntArrayRef(item.global_shape) : item.local.sizes();
    // 0: absent, 1: present, 2: wrong shape. With broadcast, rank 0's dict decides for everyone.
    int64_t status = found == dict.end() ? 0 : (found->second.sizes() == want ? 1 : 2);
    if (broadcast) {
      at::Tensor code = at::full({1}, root ? status : 0, code_options);
      world->broadcast(code, 0);
      status = code[0].item<int64_t>();
    }
    if (found != dict.end()) used.insert(name);
    if (status == 0) {
      result.missing_keys.push_back(name);
      continue;
    }
    if (status == 2)
      throw CheckpointError(what + ": '" + name + "' has shape " +
                            (found != dict.end() ? shape_text(found->second.sizes()) : "(rank 0's)") +
                            " but the model needs " + shape_text(want) +
                            (full ? " (full tensor)" : " (this rank's shard)"));
    if (!broadcast) {
      fill(item, found->second, full);
      continue;
    }
    at::Tensor value =
        root ? found->second.to(item.local.options()).contiguous() : at::empty(item.global_shape, item.local.options());
    world->broadcast(value, 0);
    fill(item, value, /*source_is_full=*/true);
  }
  for (const auto& [name, value] : dict)
    if (!used.count(name)) result.unexpected_keys.push_back(name);
  if (broadcast) {  // only rank 0's dict counts: everyone agrees on whether to fail
    at::Tensor unexpected = at::full({1}, root ? static_cast<int64_t>(result.unexpected_keys.size()) : 0, code_options);
    world->broadcast(unexpected, 0);
    if (!root && unexpected[0].item<int64_t>() > 0)
      result.unexpected_keys.push_back("(" + std::to_string(unexpected[0].item<int64_t>()) + " keys of rank 0's dict)");
  }
  throw_if_strict(result, options.strict, what);
  return result;
}

}  // namespace

StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options) {
  auto selected = detail::select_model_items(detail::model_items(model, global_rank()), model, options);
  return get_items(std::move(selected.items), "model.", options);
}

LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& state_dict,
                                const StateDictOptions& options) {
  auto selected = detail::select_model_items(detail::model_items(model, global_rank()), model, options);
  if (selected.ignored.empty())
    return set_items(std::move(selected.items), state_dict, "model.", options, "set_model_state_dict");
  StateDict kept = state_dict;  // frozen parameters' keys are ignored (ignore_frozen_params)
  for (const auto& name : selected.ignored) kept.erase(name);
  return set_items(std::move(selected.items), kept, "model.", options, "set_model_state_dict");
}

namespace {
// ShardedTensor entries gather over the world (a group of one without a process group).
std::vector<LocalItem> tensor_items(const std::map<std::string, ShardedTensor>& tensors) {
  auto group = dist::is_initialized() ? dist::world_comm() : comm::Comm::single_process("tensor-state-dict");
  return detail::sharded_tensor_items(tensors, std::move(group));
}
}  // namespace

StateDict get_tensor_state_dict(const std::map<std::string, ShardedTensor>& tensors, const StateDictOptions& options) {
  return get_items(tensor_items(tensors), "", options);
}

LoadResult set_tensor_state_dict(const std::map<std::string, ShardedTensor>& tensors, const StateDict& state_dict,
                                 const StateDictOptions& options) {
  return set_items(tensor_items(tensors), state_dict, "", options, "set_tensor_state_dict");
}

StateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options) {
  return get_items(detail::optimizer_save_items(optimizer, model, global_rank()), "optim.", options);
}

LoadResult set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const StateDict& state_dict, const StateDictOptions& options) {
  // Which per-parameter fields exist: rank 0's dict decides when it is the only one read.
  std::function<bool(const std::string&)> has_key = [&](const std::string& key) {
    return state_dict.count(strip(key, "optim.")) > 0;
  };
  std::set<std::string> present;
  if (options.broadcast_from_rank0 && dist::is_initialized() && dist::world_size() > 1) {
    const std::vector<std::string> candidates = detail::optimizer_candidate_keys(optimizer, model);
    at::Tensor mask = at::zeros({static_cast<int64_t>(candidates.size())}, at::kLong);
    if (global_rank() == 0)
      for (size_t i = 0; i < candidates.size(); ++i) mask[i] = has_key(candidates[i]) ? 1 : 0;
    dist::world_comm()->broadcast(mask, 0);
    for (size_t i = 0; i < candidates.size(); ++i)
      if (mask[i].item<int64_t>()) present.insert(candidates[i]);
    has_key = [&present](const std::string& key) { return present.count(key) > 0; };
  }
  auto items = detail::optimizer_load_items(optimizer, model, has_key);
  return set_items(std::move(items), state_dict, "optim.", options, "set_optimizer_state_dict");
}

// ---- safetensors export / import ------------------------------------------------------------

namespace {

at::ScalarType export_dtype(const LocalItem& item, const ExportOptions& options) {
  const auto own = item.local.scalar_type();
  return options.dtype && at::isFloatingType(own) ? *options.dtype : own;
}

// What export_safetensors has written so far; `error` set stops rank 0's writing (the other
// ranks still take part in every gather).
struct ExportProgress {
  std::vector<std::string> written;
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total = 0;
  std::string error;
};

// Rank 0's writer of one file, header first; null on the other ranks or after an error.
std::unique_ptr<safetensors::StreamWriter> open_export_file(const std::vector<LocalItem>& items,
                                                            const std::vector<size_t>& file, const fs::path& target,
                                                            const std::string& tmp, const ExportOptions& options,
                                                            ExportProgress& progress) {
  if (global_rank() != 0 || !progress.error.empty()) return nullptr;
  try {
    if (!target.parent_path().empty()) fs::create_directories(target.parent_path());
    std::vector<safetensors::TensorSpec> specs;
    for (size_t i : file)
      specs.push_back({strip(items[i].key, "model."), export_dtype(items[i], options), items[i].global_shape});
    return std::make_unique<safetensors::StreamWriter>(tmp, specs,
                                                       std::map<std::string, std::string>{{"format", "pt"}});
  } catch (const std::exception& e) {
    progress.error = e.what();
    return nullptr;
  }
}

// Rank 0 streams the file: header first, then each tensor as soon as it is gathered, so it never
// holds more than one full tensor.
void write_export_file(const std::vector<LocalItem>& items, const std::vector<size_t>& file, const fs::path& target,
                       const std::string& name, const ExportOptions& options, ExportProgress& progress) {
  const fs::path out = target.parent_path() / name;
  const std::string tmp = out.string() + ".tmp";
  std::unique_ptr<safetensors::StreamWriter> writer = open_export_file(items, file, target, tmp, options, progress);
  for (size_t i : file) {
    at::Tensor full = gather_full(items[i]);  // every rank of the shard group takes part
    if (!writer) continue;
    try {
      writer->append(full.reshape(items[i].global_shape).to(export_dtype(items[i], options)));
      progress.weight_map[strip(items[i].key, "model.")] = name;
      progress.total += static_cast<uint64_t>(full.numel()) * c10::elementSize(export_dtype(items[i], options));
    } catch (const std::exception& e) {
      progress.error = e.what();
      writer.reset();
    }
  }
  if (!writer) return;
  try {
    writer->finish();
    fs::rename(tmp, out);
    progress.written.push_back(out.string());
  } catch (const std::exception& e) {
    progress.error = e.what();
  }
}

void write_export_index(const fs::path& target, ExportProgress& progress) {
  const fs::path index_path = target.parent_path() / (target.filename().string() + ".index.json");
  nlohmann::json index{{"metadata", {{"total_size", progress.total}}}, {"weight_map", progress.weight_map}};
  std::ofstream(index_path.string() + ".tmp", std::ios::trunc) << index.dump(2);
  fs::rename(index_path.string() + ".tmp", index_path);
  progress.written.push_back(index_path.string());
}

}  // namespace

std::vector<std::string> export_safetensors(torch::nn::Module& model, const std::string& path,
                                            const ExportOptions& options) {
  auto items = detail::model_items(model, global_rank());
  // Files planned from the global shapes, so every rank knows the grouping without talking.
  std::vector<uint64_t> sizes;
  for (const auto& item : items) {
    uint64_t bytes = c10::elementSize(export_dtype(item, options));
    for (int64_t d : item.global_shape) bytes *= static_cast<uint64_t>(d);
    sizes.push_back(bytes);
  }
  const auto files = detail::plan_files(sizes, options.max_file_bytes);
  const fs::path target(path);
  ExportProgress progress;
  for (size_t f = 0; f < files.size(); ++f)
    write_export_file(items, files[f], target, detail::planned_file_name(target, f, files.size()), options, progress);
  if (global_rank() == 0 && progress.error.empty() && files.size() > 1) write_export_index(target, progress);
  if (!progress.error.empty())
    throw CheckpointError("export_safetensors: writing '" + path + "' failed: " + progress.error);
  return progress.written;
}

namespace {

// The safetensors files a load reads, each opened (and its header parsed) once.
class SafetensorsReaders {
 public:
  safetensors::Reader& operator()(const std::string& file) {
    auto& slot = readers_[file];
    if (!slot) slot = std::make_unique<safetensors::Reader>(file);
    return *slot;
  }

 private:
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers_;
};

// name -> file, from a Hugging Face index or from the single file's own header.
std::map<std::string, std::string> read_weight_map(const std::string& path, SafetensorsReaders& reader_for) {
  std::map<std::string, std::string> weight_map;
  try {
    if (fs::path(path).extension() == ".json") {
      std::ifstream in(path);
      if (!in) throw CheckpointError("load_safetensors: cannot open '" + path + "'");
      const auto index = nlohmann::json::parse(in);
      for (const auto& [name, file] : index.at("weight_map").items()) {
        const std::string f = file.get<std::string>();
        if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
          throw CheckpointError("load_safetensors: '" + path + "' names a file outside its directory: '" + f + "'");
        weight_map[name] = (fs::path(path).parent_path() / f).string();
      }
    } else {
      for (const auto& entry : reader_for(path).header().tensors) weight_map[entry.name] = path;
    }
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError("load_safetensors: '" + path + "': " + e.what());
  }
  return weight_map;
}

// One read buffer for every box, sized once to the largest (the file's dtype): a buffer per
// tensor, freed after its copy, left glibc's heap up to a third larger than the parameters
// when loading a 1.1B model (the freed buffers below the mmap threshold are not returned).
at::Tensor load_buffer(const std::vector<LocalItem>& items, const std::map<std::string, std::string>& weight_map,
                       SafetensorsReaders& reader_for) {
  uint64_t buffer_bytes = 0;
  for (const auto& item : items) {
    auto found = weight_map.find(strip(item.key, "model."));
    if (found == weight_map.end()) continue;
    try {
      const auto& entry = reader_for(found->second).entry(found->first);
      for (const auto& piece : detail::boxes(item))
        buffer_bytes = std::max<uint64_t>(buffer_bytes,
                                          static_cast<uint64_t>(piece.local.numel()) * c10::elementSize(entry.dtype));
    } catch (const std::exception&) {  // reported with the file's name by load_item
    }
  }
  return at::empty({static_cast<int64_t>(buffer_bytes)}, at::kByte);
}

// Reads this rank's boxes of tensor `name` from `reader` into the item's local tensor.
void load_item(const LocalItem& item, const std::string& name, safetensors::Reader& reader, at::Tensor& buffer) {
  const auto& entry = reader.entry(name);
  if (entry.shape != item.global_shape)
    throw CheckpointError("'" + name + "' has shape " + shape_text(entry.shape) + " in the file but " +
                          shape_text(item.global_shape) + " in the model");
  for (const auto& piece : detail::boxes(item)) {  // a strided TP shard: several boxes
    if (piece.local.numel() == 0) continue;
    // This rank's box of the file's tensor: its contiguous runs (one for a dim-0 shard).
    at::Tensor staging = at::from_blob(buffer.data_ptr(), piece.local.sizes(), at::TensorOptions().dtype(entry.dtype));
    const detail::Runs runs(item.global_shape, piece.offsets, piece.local.sizes().vec(),
                            static_cast<int64_t>(c10::elementSize(entry.dtype)));
    auto* out = static_cast<uint8_t*>(staging.data_ptr());
    for (int64_t j = 0; j < runs.count(); ++j)
      reader.read_bytes(name, runs.offset(j), runs.run_bytes(), out + static_cast<uint64_t>(j) * runs.run_bytes());
    at::NoGradGuard no_grad;
    piece.local.copy_(staging);
  }
}

}  // namespace

LoadResult load_safetensors(torch::nn::Module& model, const std::string& path, bool strict) {
  SafetensorsReaders reader_for;
  const std::map<std::string, std::string> weight_map = read_weight_map(path, reader_for);
  auto items = detail::model_items(model, global_rank());
  at::Tensor buffer = load_buffer(items, weight_map, reader_for);

  LoadResult result;
  std::set<std::string> used;
  for (auto& item : items) {
    const std::string name = strip(item.key, "model.");
    auto found = weight_map.find(name);
    if (found == weight_map.end()) {
      result.missing_keys.push_back(name);
      continue;
    }
    used.insert(name);
    try {
      load_item(item, name, reader_for(found->second), buffer);
    } catch (const CheckpointError& e) {
      throw CheckpointError("load_safetensors: " + found->second + ": " + e.what());
    } catch (const safetensors::SafetensorsError& e) {
      throw CheckpointError(std::string("load_safetensors: ") + e.what());
    }
  }
  for (const auto& [name, file] : weight_map)
    if (!used.count(name)) result.unexpected_keys.push_back(name);
  throw_if_strict(result, strict, "load_safetensors: '" + path + "'");
  return result;
}

}  // namespace fsdp::checkpoint
