// Hugging Face folders <-> Llama models. The row-by-row reading and the one-tensor-at-a-time
// gathering are the checkpoint layer's (fsdp::checkpoint::load_safetensors / export_safetensors,
// which know every sharding's boxes); this file adds what is particular to Hugging Face: where the
// weights are, which keys to ignore, transformers' config.json, and every check made up front so
// that a bad folder leaves the model untouched.
#include "models/llama/hf.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "fsdp/checkpoint/inspect.h"
#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/comm/comm.h"
#include "fsdp/dist/runtime.h"
#include "fsdp/sharding/fully_shard.h"
#include "fsdp/tensor_parallel/placement.h"
#include "models/llama/hf_folder.h"

namespace fsdp::models {

namespace fs = std::filesystem;

namespace {

std::string shape_text(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// "a, b, c, d, e and 3 more" (at most five named).
std::string some_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < 5; ++i) s += (i ? ", " : "") + keys[i];
  if (keys.size() > 5) s += " and " + std::to_string(keys.size() - 5) + " more";
  return s;
}

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// The full parameter's shape, whatever holds it: fully_shard (and TP under it), TP alone, or none.
std::vector<int64_t> global_shape(const at::Tensor& param) {
  if (auto info = fsdp::shard_info(param)) return info->tp ? info->tp->global_shape : info->global_shape;
  if (auto tp = fsdp::tp::tp_placement(param)) return tp->global_shape;
  return param.sizes().vec();
}

// The folder's weights: the index (or the single file) and every file's validated header.
struct Weights {
  std::string path;                                    // what load_safetensors reads: the index or the file
  std::map<std::string, std::string> file_of;          // tensor name -> file
  std::map<std::string, safetensors::Header> headers;  // file -> header
};

// A weight_map entry as a path inside the folder `d` (a subfolder is inside; '..' out of it or an
// absolute path is not).
fs::path file_in_folder(const fs::path& d, const std::string& index, const std::string& name, const std::string& f) {
  const fs::path rel = fs::path(f).lexically_normal();
  if (f.empty() || rel.is_absolute() || rel.empty() || *rel.begin() == ".." || !rel.has_filename() ||
      rel.filename() == "." || rel.filename() == "..")
    throw HFError(index + ": weight_map['" + name + "'] names a file outside the folder: '" + f +
                  "'; every shard must be inside the model folder");
  return d / rel;
}

Weights find_weights(const std::string& dir) {
  const fs::path d(dir);
  Weights w;
  const fs::path index = d / "model.safetensors.index.json", single = d / "model.safetensors";
  if (detail::check_regular_file(index)) {  // stat first: a FIFO must not block open()
    w.path = index.string();
    nlohmann::json j;
    try {
      std::ifstream in(index);
      j = nlohmann::json::parse(in);
    } catch (const std::exception& e) {
      throw HFError(w.path + ": not valid JSON (" + e.what() + "); remake the index or the folder");
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      throw HFError(w.path + ": no \"weight_map\" object (a Hugging Face index maps tensor names to files)");
    if (j["weight_map"].empty())
      throw HFError(w.path +
                    ": \"weight_map\" is empty, so the index lists no weights; remake the index (it maps "
                    "each tensor name to its shard file) or download the folder again");
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string()) throw HFError(w.path + ": weight_map['" + name + "'] is not a file name");
      w.file_of[name] = file_in_folder(d, w.path, name, file.get<std::string>()).string();
    }
  } else if (detail::check_regular_file(single)) {
    w.path = single.string();
  } else if (fs::exists(d / "pytorch_model.bin") || fs::exists(d / "pytorch_model.bin.index.json")) {
    throw HFError(dir +
                  ": holds pytorch_model.bin weights only, which are not loaded (pickle can run code); convert "
                  "them to safetensors, e.g. transformers' save_pretrained(dir, safe_serialization=True)");
  } else {
    throw HFError(dir + ": no model.safetensors or model.safetensors.index.json (not a Hugging Face model folder?)" +
                  detail::interrupted_export_note(d));
  }

  // Every file's header, parsed and checked against its size (a damaged or short file is named).
  std::set<std::string> files;
  for (const auto& [name, file] : w.file_of) files.insert(file);
  if (w.file_of.empty()) files.insert(w.path);
  for (const auto& file : files) {
    if (!detail::check_regular_file(file))
      throw HFError(file + ": listed by " + w.path + " but missing; copy the whole folder");
    try {
      w.headers.emplace(file, safetensors::Reader(file).header());
    } catch (const safetensors::SafetensorsError& e) {
      throw HFError(std::string(e.what()) + "; the file is damaged or incomplete, download it again");
    }
  }
  if (w.file_of.empty()) {
    for (const auto& entry : w.headers.at(w.path).tensors) w.file_of[entry.name] = w.path;
  } else {
    for (const auto& [name, file] : w.file_of)
      if (!w.headers.at(file).find(name))
        throw HFError(file + ": has no tensor '" + name + "' although " + w.path + " lists it there");
  }
  return w;
}

// config.json against the model asked for: the fields that decide what the weights mean.
void check_config(const LlamaConfig& file, const LlamaConfig& model, const std::string& source) {
  auto same = [&](const char* field, const auto& a, const auto& b) {
    if (a != b) {
      std::ostringstream msg;
      msg << source << ": " << field << " is " << a << " but the model was built with " << b
          << "; build the model from this config.json (read_hf_config)";
      throw HFError(msg.str());
    }
  };
  same("architectures", file.architecture, model.architecture);
  same("vocab_size", file.vocab_size, model.vocab_size);
  same("hidden_size", file.hidden_size, model.hidden_size);
  same("intermediate_size", file.intermediate_size, model.intermediate_size);
  same("num_hidden_layers", file.num_hidden_layers, model.num_hidden_layers);
  same("num_attention_heads", file.num_attention_heads, model.num_attention_heads);
  same("num_key_value_heads", file.num_key_value_heads, model.num_key_value_heads);
  same("head_dim", file.resolved_head_dim(), model.resolved_head_dim());
  same("tie_word_embeddings", file.tie_word_embeddings, model.tie_word_embeddings);
  same("attention_bias", file.attention_bias, model.attention_bias);
  same("mlp_bias", file.mlp_bias, model.mlp_bias);
  same("rms_norm_eps", file.rms_norm_eps, model.rms_norm_eps);
  same("rope_theta", file.rope_theta, model.rope_theta);
  same("rope_scaling.rope_type", file.rope_type, model.rope_type);
}

bool ignored_key(const std::string& name, const LlamaConfig& c) {
  return ends_with(name, ".rotary_emb.inv_freq") || (c.tie_word_embeddings && name == "lm_head.weight");
}

// NaN or Inf in the loaded parameters: each rank looks at what it holds; a sharded model's ranks
// add their flags up (one all-reduce over the world) so that every rank refuses the same tensor.
void check_finite(torch::nn::Module& model, const std::string& dir) {
  const auto params = model.named_parameters();
  at::Tensor flags = at::zeros({static_cast<int64_t>(params.size())}, at::kLong);
  bool sharded = false;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& local = params[i].value();
    sharded = sharded || fsdp::shard_info(local) || fsdp::tp::tp_placement(local);
    if (local.numel() > 0 && !at::isfinite(local).all().item<bool>()) flags[static_cast<int64_t>(i)] = 1;
  }
  if (sharded && fsdp::dist::is_initialized() && fsdp::dist::world_size() > 1)
    fsdp::dist::world_comm()->all_reduce(flags, fsdp::comm::ReduceOp::Sum);
  const auto bad = flags.nonzero();
  if (bad.numel() == 0) return;
  const std::string name = params[static_cast<size_t>(bad[0][0].item<int64_t>())].key();
  throw HFError(dir + ": '" + name + "' holds NaN or Inf values (the first of " + std::to_string(bad.size(0)) +
                " tensors that do); the weights are damaged: download them again, or load them as they are with "
                "HFLoadOptions::allow_nonfinite (train_gpt --allow-nonfinite-weights)");
}

}  // namespace

LlamaConfig read_hf_config(const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  if (!detail::check_regular_file(path)) {
    const std::string note = detail::interrupted_export_note(dir);
    if (!note.empty()) throw HFError(path.string() + ": missing" + note);
  }
  return LlamaConfig::from_file(path.string());
}

void load_hf_weights(LlamaImpl& model, const std::string& dir, const HFLoadOptions& options) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  HFModelSpec spec;
  spec.check_config = [&] { check_config(read_hf_config(dir), model.config, config_path); };
  spec.ignored = [&](const std::string& name) { return ignored_key(name, model.config); };
  load_hf_module(model, dir, spec, options);
}

void load_hf_module(torch::nn::Module& model, const std::string& dir, const HFModelSpec& spec,
                    const HFLoadOptions& options) {
  if (spec.check_config) spec.check_config();
  const Weights w = find_weights(dir);

  // Keys and shapes, all before a single weight is copied.
  std::vector<std::string> missing, unexpected;
  std::set<std::string> wanted;
  for (const auto& p : model.named_parameters()) {
    wanted.insert(p.key());
    auto it = w.file_of.find(p.key());
    if (it == w.file_of.end()) {
      missing.push_back(p.key());
      continue;
    }
    const auto* entry = w.headers.at(it->second).find(p.key());
    const auto expected = global_shape(p.value());
    if (entry->shape != expected)
      throw HFError(it->second + ": '" + p.key() + "' has shape " + shape_text(entry->shape) +
                    " but the model expects " + shape_text(expected) +
                    "; the weights do not belong to this config.json");
    if (!at::isFloatingType(entry->dtype))
      throw HFError(it->second + ": '" + p.key() + "' is " + safetensors::dtype_name(entry->dtype) +
                    ", not a float dtype (F32, BF16, F16); quantized weights are not supported");
  }
  for (const auto& [name, file] : w.file_of)
    if (!wanted.count(name) && !(spec.ignored && spec.ignored(name))) unexpected.push_back(name);
  if (!missing.empty() || !unexpected.empty()) {
    std::vector<std::string> parts;
    if (!missing.empty()) parts.push_back(std::to_string(missing.size()) + " missing (" + some_keys(missing) + ")");
    if (!unexpected.empty())
      parts.push_back(std::to_string(unexpected.size()) + " unexpected (" + some_keys(unexpected) + ")");
    std::string msg = w.path + ": does not match the model: " + parts[0];
    if (parts.size() > 1) msg += "; " + parts[1];
    throw HFError(msg + "; check config.json against the weights");
  }

  // The copy: each rank its own rows of each tensor, converted to the parameter's dtype, file by
  // file (so that a shard in a subfolder is read where the index says).
  std::set<std::string> files, loaded;
  for (const auto& [name, file] : w.file_of) files.insert(file);
  try {
    for (const auto& file : files) {
      const auto result = fsdp::checkpoint::load_safetensors(model, file, /*strict=*/false);
      const std::set<std::string> missing(result.missing_keys.begin(), result.missing_keys.end());
      for (const auto& key : wanted)
        if (!missing.count(key)) loaded.insert(key);
    }
  } catch (const fsdp::checkpoint::CheckpointError& e) {
    throw HFError(e.what());
  }
  if (loaded.size() != wanted.size())  // checked above; a file changed while loading
    throw HFError(w.path + ": " + std::to_string(wanted.size() - loaded.size()) +
                  " tensors missing while loading; a file changed under the load: load it again");
  if (!options.allow_nonfinite) check_finite(model, dir);
}

namespace {

void check_save_dtype(const HFSaveOptions& options) {
  if (options.dtype != at::kFloat && options.dtype != at::kBFloat16)
    throw HFError(std::string("save_hf: dtype ") + c10::toString(options.dtype) +
                  " is not supported (kFloat, kBFloat16)");
}

const char* dtype_name(const HFSaveOptions& options) { return options.dtype == at::kBFloat16 ? "bfloat16" : "float32"; }

// Everything but the weights, into the export's temporary folder: config.json and the files
// copied along (regular files only: a FIFO there is refused, never opened).
void write_config_and_copies(detail::ExportFolder& folder, const std::string& config_json,
                             const HFSaveOptions& options) {
  const fs::path config_path = folder.dir() / "config.json";
  {
    std::ofstream out(config_path, std::ios::trunc);
    out << config_json;
    out.close();
    if (!out) throw HFExportError("cannot write " + config_path.string());
  }
  folder.file_written();
  if (options.copy_from.empty()) return;
  for (const auto& name : detail::copied_file_names()) {
    const fs::path from = fs::path(options.copy_from) / name;
    if (!detail::check_regular_file(from)) continue;
    fs::copy_file(from, folder.dir() / name);
    folder.file_written();
  }
}

// Runs one step of an export; "" when it succeeded, else the verdict every rank will throw: 'R'
// and the refusal (HFError) or 'W' and what failed (HFExportError), each saying what is left where.
template <class Step>
std::string export_step(const std::string& dir, detail::ExportFolder* folder, Step&& step) {
  auto left = [&] { return folder ? folder->abandon() : std::string(); };
  try {
    step();
    return "";
  } catch (const HFError& e) {
    return "R" + std::string(e.what()) + left();
  } catch (const std::exception& e) {
    return "W" + std::string("export to ") + dir + " failed: " + e.what() + left();
  }
}

// Rank 0's verdict to every rank of the world (a no-op alone), so that a failure on rank 0 is the
// same error on every rank instead of a hang or a peer's closed connection.
std::string agree(const std::string& verdict) {
  if (!fsdp::dist::is_initialized() || fsdp::dist::world_size() < 2) return verdict;
  constexpr int64_t kMax = 4096;
  at::Tensor buf = at::zeros({kMax + 1}, at::kLong);
  if (fsdp::dist::rank() == 0) {
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(verdict.size()), kMax);
    auto* p = buf.data_ptr<int64_t>();
    p[0] = n;
    for (int64_t i = 0; i < n; ++i) p[i + 1] = static_cast<unsigned char>(verdict[static_cast<size_t>(i)]);
  }
  fsdp::dist::world_comm()->broadcast(buf, 0);
  const auto* p = buf.data_ptr<int64_t>();
  std::string out;
  for (int64_t i = 0; i < p[0]; ++i) out.push_back(static_cast<char>(p[i + 1]));
  return out;
}

void throw_verdict(const std::string& verdict) {
  if (verdict.empty()) return;
  if (verdict[0] == 'R') throw HFError(verdict.substr(1));
  throw HFExportError(verdict.substr(1));
}

}  // namespace

std::string check_hf_weights(const std::string& dir) { return find_weights(dir).path; }

std::map<std::string, at::Tensor> HFConfigState::state_dict() const {
  at::Tensor bytes = at::empty({static_cast<int64_t>(json.size())}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), json.data(), json.size());
  return {{"config_json", bytes}};
}

void HFConfigState::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  auto it = state.find("config_json");
  if (it == state.end()) return;
  const at::Tensor bytes = it->second.to(at::kCPU, at::kByte).contiguous();
  json.assign(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
}

namespace {

struct CheckpointItem {
  std::string name;
  std::vector<int64_t> shape;
};

// The checkpoint's tensors into the export's folder, `files` as planned (file -> items), one full
// tensor in memory at a time; the index too when there are several files.
void write_checkpoint_weights(detail::ExportFolder& folder, fsdp::checkpoint::CheckpointReader& reader,
                              const std::vector<CheckpointItem>& items, const std::vector<std::vector<size_t>>& files,
                              at::ScalarType dtype) {
  auto file_name = [&](size_t f) {
    if (files.size() == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", f + 1, files.size());
    return std::string(buf);
  };
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total = 0;
  for (size_t f = 0; f < files.size(); ++f) {
    std::vector<safetensors::TensorSpec> specs;
    for (size_t i : files[f]) specs.push_back({items[i].name, dtype, items[i].shape});
    safetensors::StreamWriter writer((folder.dir() / file_name(f)).string(), specs, {{"format", "pt"}});
    for (size_t i : files[f]) {
      at::Tensor full = reader.read("model." + items[i].name).to(dtype).contiguous();
      writer.append(full);
      weight_map[items[i].name] = file_name(f);
      total += static_cast<uint64_t>(full.numel()) * c10::elementSize(dtype);
    }
    writer.finish();
    folder.file_written();
  }
  if (files.size() == 1) return;
  const fs::path index_path = folder.dir() / "model.safetensors.index.json";
  nlohmann::json index{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  std::ofstream out(index_path, std::ios::trunc);
  out << index.dump(2);
  out.close();
  if (!out) throw HFExportError("cannot write " + index_path.string());
}

}  // namespace

std::vector<std::string> export_hf_from_checkpoint(const std::string& checkpoint_dir, const std::string& dir,
                                                   const HFSaveOptions& options) {
  auto describe = [&](const std::string& json, const std::string& source) {
    LlamaConfig config = LlamaConfig::from_json(json, source);
    // The parameters' names, order and shapes, from the model built on the meta device (no memory).
    config.device = torch::kMeta;
    Llama model(config);
    return HFCheckpointModel{model.ptr(), config.to_json(dtype_name(options))};
  };
  return export_hf_module_from_checkpoint(checkpoint_dir, dir, describe, options);
}

std::string recorded_hf_config(const std::string& checkpoint_dir) {
  fsdp::checkpoint::CheckpointReader reader(checkpoint_dir);
  if (!reader.info().find(kHFConfigKey))
    throw HFError(checkpoint_dir +
                  ": records no config.json, so it has no Hugging Face architecture (a checkpoint of train_gpt "
                  "--model gpt?); export-hf takes checkpoints of --model llama or --init-from runs");
  HFConfigState recorded;
  recorded.load_state_dict({{"config_json", reader.read(kHFConfigKey)}});
  return recorded.json;
}

std::vector<std::string> export_hf_module_from_checkpoint(const std::string& checkpoint_dir, const std::string& dir,
                                                          const HFCheckpointDescriber& describe,
                                                          const HFSaveOptions& options) {
  check_save_dtype(options);
  detail::check_export_destination(dir, "");  // before reading anything
  fsdp::checkpoint::CheckpointReader reader(checkpoint_dir);
  const HFCheckpointModel described =
      describe(recorded_hf_config(checkpoint_dir), checkpoint_dir + " (recorded config.json)");
  torch::nn::Module& model = *described.meta_model;
  std::vector<CheckpointItem> items;
  for (const auto& p : model.named_parameters()) {
    const std::string key = "model." + p.key();
    const auto* t = reader.info().find(key);
    if (!t)
      throw HFError(checkpoint_dir + ": has no '" + key +
                    "' although its recorded config.json describes a model with it; the checkpoint is not of "
                    "that model");
    if (t->shape != p.value().sizes().vec())
      throw HFError(checkpoint_dir + ": '" + key + "' has shape " + shape_text(t->shape) +
                    " but its recorded config.json gives " + shape_text(p.value().sizes()));
    items.push_back({p.key(), t->shape});
  }
  // The files, planned as export_safetensors plans them (so save_hf's files come out the same).
  const uint64_t element = c10::elementSize(options.dtype);
  std::vector<std::vector<size_t>> files(1);
  uint64_t in_file = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    uint64_t bytes = element;
    for (int64_t d : items[i].shape) bytes *= static_cast<uint64_t>(d);
    if (options.max_shard_size && in_file > 0 && in_file + bytes > options.max_shard_size) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(i);
    in_file += bytes;
  }
  detail::ExportFolder folder(dir, options.copy_from);
  std::vector<std::string> written;
  try {
    write_config_and_copies(folder, described.config_json, options);
    write_checkpoint_weights(folder, reader, items, files, options.dtype);
    written = folder.commit(dtype_name(options));
  } catch (const HFError& e) {
    throw HFError(e.what() + folder.abandon());
  } catch (const fsdp::checkpoint::CheckpointError& e) {
    throw fsdp::checkpoint::CheckpointError(e.what() + folder.abandon());
  } catch (const std::exception& e) {
    throw HFExportError("export to " + dir + " failed: " + e.what() + folder.abandon());
  }
  return written;
}

std::vector<std::string> save_hf(LlamaImpl& model, const std::string& dir, const HFSaveOptions& options) {
  check_save_dtype(options);
  return save_hf_module(model, model.config.to_json(dtype_name(options)), dir, options);
}

std::vector<std::string> save_hf_module(torch::nn::Module& model, const std::string& config_json,
                                        const std::string& dir, const HFSaveOptions& options) {
  check_save_dtype(options);
  const bool root = !fsdp::dist::is_initialized() || fsdp::dist::rank() == 0;
  // Rank 0: the destination checked, the temporary folder made, config.json and the copies.
  std::unique_ptr<detail::ExportFolder> folder;
  std::string verdict;
  if (root) {
    verdict =
        export_step(dir, nullptr, [&] { folder = std::make_unique<detail::ExportFolder>(dir, options.copy_from); });
    if (verdict.empty())
      verdict = export_step(dir, folder.get(), [&] { write_config_and_copies(*folder, config_json, options); });
  }
  throw_verdict(agree(verdict));
  // Collective: gathered tensor by tensor, written by rank 0 (names are already transformers').
  // A write that fails on rank 0 keeps it in the gathers; the verdict below tells every rank.
  const fs::path target = (root ? folder->dir() : fs::path(dir)) / "model.safetensors";
  std::vector<std::string> files, written;
  verdict = export_step(dir, folder.get(), [&] {
    files = fsdp::checkpoint::export_safetensors(
        model, target.string(),
        fsdp::checkpoint::ExportOptions{.max_file_bytes = options.max_shard_size, .dtype = options.dtype});
  });
  if (!root && !verdict.empty()) throw_verdict(verdict);  // this rank's own failure (a collective's)
  if (root && verdict.empty())
    verdict = export_step(dir, folder.get(), [&] {
      folder->file_written(static_cast<int>(files.size()));
      written = folder->commit(dtype_name(options));
    });
  throw_verdict(agree(verdict));
  return written;
}

}  // namespace fsdp::models
