#pragma once
// Hugging Face folders for the mixture-of-experts decoders (MixtralForCausalLM,
// Qwen3MoeForCausalLM): config.json read and refused as the Llama family's is, weights loaded
// into a (sharded) MoECausalLM with each rank reading only the rows it holds (and only its
// experts when it holds a range of them), and a live model written back in the Hub's layout
// (one tensor per expert) through models/llama/hf.h's export (temporary folder, commit by rename).
//
// Example:
//   auto c = fsdp::models::read_moe_config("Mixtral");   // refuses what the model cannot honour
//   c.base.device = torch::kMeta;
//   fsdp::models::MoECausalLM model(c);
//   for (auto& layer : model->layers()) fsdp::fully_shard(layer);
//   fsdp::fully_shard(model);
//   fsdp::to_empty(*model, torch::kCPU);
//   fsdp::models::load_moe_weights(*model, "Mixtral");
//   ... train ...
//   fsdp::models::save_moe_hf(*model, "out", {.dtype = at::kBFloat16});   // collective
#include <string>
#include <vector>

#include "models/llama/hf.h"
#include "models/moe/moe.h"

namespace fsdp::models {

// Whether <dir>/config.json names a mixture-of-experts architecture this folder supports.
bool is_moe_folder(const std::string& dir);

// <dir>/config.json as a MoEConfig: an architecture other than MixtralForCausalLM or
// Qwen3MoeForCausalLM, or a field the model cannot honour, refused in one line (MoEConfigError).
MoEConfig read_moe_config(const std::string& dir);

// load_hf_weights' checks and copy (models/llama/hf.h) for a MoE model: config.json must describe
// the model (architecture, sizes, experts, top k, dense layers), keys and shapes must match, and
// the experts this process does not hold (MoEConfig::local_experts_*) are neither read nor missed.
void load_moe_weights(MoECausalLMImpl& model, const std::string& dir, const HFLoadOptions& options = {});

// save_hf for a MoE model (collective; the same destination rules, files and errors): the Hub
// layout, every expert. Under expert parallelism (MoEConfig::set_expert_parallel, dense layers and
// root sharded over all ranks or whole, experts as the ranks hold them) the whole model is made
// sharded over the world, each expert gathered from its ranks one at a time, and exported: the
// same files as the model without expert parallelism. A model holding a range of the experts
// outside expert parallelism is refused (HFError).
std::vector<std::string> save_moe_hf(MoECausalLMImpl& model, const std::string& dir, const HFSaveOptions& options = {});

// fsdp-ckpt export-hf for a checkpoint of a MoE run (one that recorded its config.json,
// HFConfigState with json = config.to_json(...)): export_hf_from_checkpoint's files, checks and
// commit, the model's names and shapes from the recorded MoE config. Pick it when
// hf_architecture(recorded_hf_config(checkpoint_dir)) is a MoE architecture.
std::vector<std::string> export_moe_hf_from_checkpoint(const std::string& checkpoint_dir, const std::string& dir,
                                                       const HFSaveOptions& options = {});

}  // namespace fsdp::models
