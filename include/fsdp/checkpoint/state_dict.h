#pragma once
// Full and sharded state dicts (torch.distributed.checkpoint.state_dict for LibTorch), and
// safetensors export / pretrained import.
//
// Example:
//   // Consolidated weights on rank 0 only, gathered one parameter at a time:
//   auto sd = fsdp::checkpoint::get_model_state_dict(*model, {.full_state_dict = true, .cpu_offload = true});
//   // Rank 0 read a file; every rank gets its rows:
//   fsdp::checkpoint::set_model_state_dict(*model, sd, {.full_state_dict = true, .broadcast_from_rank0 = true});
//   // Hugging Face layout (one file, or several + model.safetensors.index.json):
//   fsdp::checkpoint::export_safetensors(*model, "out/model.safetensors");
//   fsdp::checkpoint::load_safetensors(*model, "out/model.safetensors");   // each rank reads its rows
//
// Model keys are parameter/buffer names (as model.named_parameters()); optimizer keys are
// "<parameter name>.<field>" (exp_avg, exp_avg_sq, step, momentum_buffer, ...) and
// "param_groups.<g>.<hyperparameter>" (fsdp/checkpoint/optimizer_state.h).
#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp::checkpoint {

using StateDict = std::map<std::string, at::Tensor>;

// Example: get_model_state_dict(*model, {.full_state_dict = true, .ignore_frozen_params = true});
//          get_model_state_dict(*model, {.submodules = {"blocks.0"}, .keep_submodule_prefixes = false});
// Example: auto sd = get_model_state_dict(*model, StateDictOptions{.full_state_dict = true, .cpu_offload = true});
struct StateDictOptions {
  // get: full tensors gathered from the shards (collective) instead of this rank's shards.
  // set: the dict holds full tensors (each rank takes its rows) instead of shards.
  bool full_state_dict = false;
  // get + full: only rank 0 keeps the tensors, on CPU; other ranks return an empty dict.
  bool cpu_offload = false;
  // set: only rank 0's dict is read (others may pass an empty one); values are broadcast.
  // Implies full_state_dict.
  bool broadcast_from_rank0 = false;
  // set: missing or unexpected keys are an error (otherwise only reported).
  bool strict = true;
  // Model state dicts: leave out parameters with requires_grad false (fine-tuning: the frozen
  // base weights come from elsewhere). set: they are neither loaded nor required, and keys for
  // them in the dict are ignored. (Frozen parameters never have optimizer state.)
  bool ignore_frozen_params = false;
  // Model state dicts: only the parameters and buffers of these submodules (names as
  // model.named_modules() gives them, e.g. "blocks.0"); empty: the whole model. A name that is no
  // submodule is an error listing the submodules.
  std::vector<std::string> submodules;
  // With submodules: keys keep the submodule's name in front ("blocks.0.attn.w"), or, false, are
  // relative to it ("attn.w"; two selected submodules must then not share a relative key).
  bool keep_submodule_prefixes = true;
};

struct LoadResult {
  std::vector<std::string> missing_keys;     // in the model, not in the dict
  std::vector<std::string> unexpected_keys;  // in the dict, not in the model
};

// Collective when full_state_dict is set (every rank of the mesh calls it).
StateDict get_model_state_dict(torch::nn::Module& model, const StateDictOptions& options = {});
LoadResult set_model_state_dict(torch::nn::Module& model, const StateDict& state_dict,
                                const StateDictOptions& options = {});

// ShardedTensor entries (State::tensors: any box layout, no parallelism library): this rank's
// boxes, or with full_state_dict the whole tensors, gathered box by box over the world (every rank
// calls it with the same keys; the boxes must cover every element). set_: each rank takes its box
// of full tensors (or its own box when not full_state_dict; broadcast_from_rank0 as for models).
StateDict get_tensor_state_dict(const std::map<std::string, ShardedTensor>& tensors,
                                const StateDictOptions& options = {});
LoadResult set_tensor_state_dict(const std::map<std::string, ShardedTensor>& tensors, const StateDict& state_dict,
                                 const StateDictOptions& options = {});

StateDict get_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                   const StateDictOptions& options = {});
LoadResult set_optimizer_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                    const StateDict& state_dict, const StateDictOptions& options = {});

// Model and optimizer together (torch.distributed.checkpoint.state_dict's get_state_dict /
// set_state_dict): the two dicts of get_model_state_dict and get_optimizer_state_dict.
//
//   auto [model_sd, optim_sd] = fsdp::checkpoint::get_state_dict(*model, optimizer);
//   fsdp::checkpoint::set_state_dict(*model, optimizer, {model_sd, optim_sd});
struct ModelOptimizerStateDict {
  StateDict model;
  StateDict optimizer;
};
ModelOptimizerStateDict get_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                       const StateDictOptions& options = {});
// Missing / unexpected keys of both (optimizer keys prefixed "optim.").
LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const ModelOptimizerStateDict& state_dict, const StateDictOptions& options = {});

// Example: export_safetensors(*model, "out/model.safetensors", ExportOptions{.max_file_bytes = 5ull << 30});
struct ExportOptions {
  // Split into files of at most this many bytes (0: one file). Split files are named
  // <stem>-00001-of-0000N.safetensors next to <stem>.safetensors.index.json (the Hugging Face
  // layout); a tensor larger than the limit gets a file of its own.
  uint64_t max_file_bytes = 0;
  // Floating-point tensors written in this dtype (e.g. at::kBFloat16, halving the files), others
  // as they are; nullopt: every tensor in its own dtype.
  std::optional<at::ScalarType> dtype = std::nullopt;
};
// Collective. Rank 0 writes the full parameters and buffers (names without any prefix), each file
// through a temporary name + rename, streaming one gathered tensor at a time (it never holds more
// than the largest parameter in full); the other ranks only take part in the gathers. Returns the
// files written (rank 0; empty elsewhere).
std::vector<std::string> export_safetensors(torch::nn::Module& model, const std::string& path,
                                            const ExportOptions& options = {});

// Initialises a (sharded) model from a safetensors file or a Hugging Face index json: each rank
// reads only the rows of its shards. Dtypes are converted to the model's. Not collective.
LoadResult load_safetensors(torch::nn::Module& model, const std::string& path, bool strict = true);

}  // namespace fsdp::checkpoint
