#pragma once
// Hugging Face model folders for the Llama family: load pretrained weights into a (sharded)
// model, and write a live model back in the layout transformers' from_pretrained reads.
//
// A folder holds config.json and either model.safetensors or model.safetensors.index.json with
// the shards it lists (other files, such as Mistral's consolidated.safetensors, are ignored).
//
// Example:
//   auto c = fsdp::models::read_hf_config("TinyLlama");   // refuses what the model cannot honour
//   c.device = torch::kMeta;
//   fsdp::models::Llama model(c);
//   for (auto& layer : model->layers()) fsdp::fully_shard(layer);
//   fsdp::fully_shard(model);
//   fsdp::to_empty(*model, torch::kCPU);
//   fsdp::models::load_hf_weights(*model, "TinyLlama");   // each rank reads its own rows
//   ... train ...
//   fsdp::models::save_hf(*model, "out", {.max_shard_size = 2ull << 30, .dtype = at::kBFloat16,
//                                         .copy_from = "TinyLlama"});   // collective
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "models/llama/llama.h"

namespace fsdp::models {

// Every problem with a folder or its files, in one line: the file, what is wrong, the fix. A bad
// input or destination (train_gpt and fsdp-ckpt exit 2 for it).
class HFError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An export whose writing failed (a full disk, an I/O error): one line saying what is left where.
// The destination is as it was before the export (train_gpt and fsdp-ckpt exit 1 for it).
class HFExportError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// <dir>/config.json as a LlamaConfig (LlamaConfigError for a field the model cannot honour).
LlamaConfig read_hf_config(const std::string& dir);

// Fills `model`'s parameters (full tensors, or this rank's shards) from the folder's safetensors
// files; each rank reads only the rows it holds, straight from the files, staging at most one
// shard of one tensor. File dtypes (F32, BF16, F16) are converted to the parameters'. Ignored:
// *.rotary_emb.inv_freq (derived from the config) and, with tied embeddings, lm_head.weight.
// Everything is checked before any weight is copied, each failure one HFError line: no
// safetensors weights (pytorch_model.bin is refused: pickle is not loaded), a bad header or a file
// shorter than its header says, config.json not describing this model, missing or unexpected
// keys (five named and the count), a shape that differs (key, expected, found), a non-float
// dtype, a file that is not a regular file (a FIFO, a folder, a device: refused from its stat,
// never opened; symlinks to regular files, as in Hugging Face's cache, are fine), an index with
// an empty weight_map or naming a file outside the folder (a shard in a subfolder is inside).
// After the copy, NaN or Inf in any parameter is refused naming the first such tensor (the model
// then holds the loaded values) unless HFLoadOptions::allow_nonfinite. Each rank checks the rows
// it read; a sharded model in a process group (fully_shard or TP) agrees on the verdict with one
// all-reduce over the world, so every rank of the world must call it then (as the recipe above
// does); an unsharded model is checked without talking to the other ranks.
struct HFLoadOptions {
  bool allow_nonfinite = false;  // true: NaN or Inf in the weights are loaded as they are
};
void load_hf_weights(LlamaImpl& model, const std::string& dir, const HFLoadOptions& options = {});

struct HFSaveOptions {
  // Split into model-0000k-of-0000n.safetensors of at most this many bytes, listed by
  // model.safetensors.index.json (transformers' save_pretrained default: 5 GB); one file,
  // model.safetensors, when everything fits.
  uint64_t max_shard_size = 5'000'000'000;
  // The files' dtype: at::kFloat or at::kBFloat16 (config.json's torch_dtype says which).
  at::ScalarType dtype = at::kFloat;
  // A folder whose generation_config.json and tokenizer files (tokenizer.model, tokenizer.json,
  // tokenizer_config.json, special_tokens_map.json), where present, are copied along; "" none.
  std::string copy_from;
};

// The same load and export for any model whose parameter names are the folder's keys (the other
// families of models/: models/moe/hf_moe.h), with what is particular to the model given here.
// Example (models/moe/hf_moe.cpp):
//   HFModelSpec spec{.check_config = [&] { /* config.json against the model: throw HFError */ },
//                    .ignored = [](const std::string& key) { return key.ends_with(".inv_freq"); }};
//   load_hf_module(model, dir, spec);
//   save_hf_module(model, config.to_json("float32"), "out", {.dtype = at::kFloat});
struct HFModelSpec {
  std::function<void()> check_config;                   // called first; throws HFError; null: none
  std::function<bool(const std::string& key)> ignored;  // a folder key that is not a parameter; null: none
};
void load_hf_module(torch::nn::Module& model, const std::string& dir, const HFModelSpec& spec,
                    const HFLoadOptions& options = {});
// save_hf with config.json's text given (its torch_dtype the one options.dtype names).
std::vector<std::string> save_hf_module(torch::nn::Module& model, const std::string& config_json,
                                        const std::string& dir, const HFSaveOptions& options = {});

// The marker every export writes into its folder: one line of JSON ({"format": "fsdp-hf-export",
// ...}). A destination holding it and nothing but the files an export writes is an earlier export,
// which a new export may replace; any other non-empty folder is refused.
inline constexpr const char* kHFExportMarker = ".fsdp-export";

// Where an export may go, checked before any work (train_gpt --export-hf at start, fsdp-ckpt
// export-hf before reading the checkpoint; save_hf and export_hf_from_checkpoint check again):
// not `init_from` (nor a path reaching it through a symlink), not a symlink, not a file, not a
// folder holding anything but an earlier export of ours (kHFExportMarker) or nothing, not a path
// under a regular file, and a parent folder this process can create and write in (probed). With
// `init_from`, the files an export copies from it must be regular files. Throws HFError (one line
// naming the folder and the fix). Creates the parent folders.
void check_hf_export_dir(const std::string& dir, const std::string& init_from = "");

// Collective (every rank of the world calls it when a process group is initialised): config.json
// and the weights, written by global rank 0 while the ranks gather one tensor at a time (no
// process holds the whole model); every file carries __metadata__ {"format": "pt"}. Returns the
// files written (rank 0). The checkpoint's commit protocol: rank 0 writes into a new temporary
// folder next to `dir` (".<name>.fsdp-export-tmp-<id>"), fsyncs every file and the folder, then
// renames it into place; an existing `dir` is replaced only when it is empty or an earlier export
// (kHFExportMarker), and only once the new folder is complete. Every rank throws the same error:
// HFError for a destination refused (check_hf_export_dir's rules; `dir` == copy_from included),
// HFExportError for a write that failed (the temporary folder removed, `dir` as it was).
std::vector<std::string> save_hf(LlamaImpl& model, const std::string& dir, const HFSaveOptions& options = {});

// Failures injected into this process's exports, for tests (tests/models/test_llama_hf.cpp):
// after this many files are complete in the temporary folder (config.json and each file copied
// along count one each; save_hf's weights count once they are all written) the export fails as
// on a full disk, before its commit; or the process aborts there (std::abort: a kill, which
// cleans nothing up). -1: never. Never set in training.
struct HFExportFaults {
  int fail_after_files = -1;
  int abort_after_files = -1;
  bool no_rename_exchange = false;  // replace as on a file system without RENAME_EXCHANGE (the backup path)
};
void set_hf_export_faults(const HFExportFaults& faults);
HFExportFaults hf_export_faults();

// Checks that `dir` is a Hugging Face folder whose weights can be read (config.json aside): the
// single file or the index and every file it lists, each header parsed and sized, without a
// model. Returns what load_hf_weights would read (the index or model.safetensors); throws HFError.
std::string check_hf_weights(const std::string& dir);

// config.json recorded in a checkpoint, so that a checkpoint of a Llama run describes itself
// (fsdp-ckpt export-hf needs nothing else): saved as the Stateful entry kHFConfigEntry, the
// text as a uint8 tensor under the key "config_json" (checkpoint key "extra.hf.config_json").
// Example:
//   HFConfigState hf(model->config);
//   fsdp::checkpoint::save(dir, {model.ptr(), &opt, {{"trainer", &scalars}, {kHFConfigEntry, &hf}}});
inline constexpr const char* kHFConfigEntry = "hf";
inline constexpr const char* kHFConfigKey = "extra.hf.config_json";
class HFConfigState : public fsdp::checkpoint::Stateful {
 public:
  HFConfigState() = default;
  explicit HFConfigState(const LlamaConfig& config) : json(config.to_json("float32")) {}
  std::map<std::string, at::Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, at::Tensor>& state) override;
  std::string json;  // config.json's text
};

// fsdp-ckpt export-hf: a checkpoint of a Llama run (one that recorded its config.json) written as
// a Hugging Face folder, the same files save_hf writes from the live model (same names, order,
// split and dtype), one full tensor in memory at a time, each verified against its CRC-32s. Not
// collective. The destination is checked first (check_hf_export_dir) and written as save_hf
// writes it (temporary folder, commit by rename). Throws HFError for a destination refused or a
// checkpoint without a recorded config.json (a GPT's: no Hugging Face architecture) or whose
// tensors do not match it, CheckpointError for a damaged one, HFExportError for a failed write.
std::vector<std::string> export_hf_from_checkpoint(const std::string& checkpoint_dir, const std::string& dir,
                                                   const HFSaveOptions& options = {});

// The config.json a checkpoint recorded (kHFConfigEntry), for a caller choosing the model family
// (models/moe's hf_architecture of it); HFError when it recorded none.
std::string recorded_hf_config(const std::string& checkpoint_dir);

// export_hf_from_checkpoint for any model family: `describe` turns the recorded config.json (and a
// source name for its errors) into the model built on the meta device (its parameter names, order
// and shapes: the checkpoint's "model." keys) and the config.json text to write (its torch_dtype
// the one options.dtype names). models/moe/hf_moe.h's export_moe_hf_from_checkpoint uses it.
struct HFCheckpointModel {
  std::shared_ptr<torch::nn::Module> meta_model;
  std::string config_json;
};
using HFCheckpointDescriber = std::function<HFCheckpointModel(const std::string& json, const std::string& source)>;
std::vector<std::string> export_hf_module_from_checkpoint(const std::string& checkpoint_dir, const std::string& dir,
                                                          const HFCheckpointDescriber& describe,
                                                          const HFSaveOptions& options = {});

}  // namespace fsdp::models
