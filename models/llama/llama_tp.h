#pragma once
// Tensor parallelism for the Llama family (models/llama/llama.h), torchtitan's plan: per decoder
// layer q/k/v and gate/up column-wise, o and down row-wise (their outputs reduce-scattered along
// the sequence), the RMSNorms under sequence parallelism (activations between the blocks are
// split along the sequence: each tp rank normalises T / tp positions), the attention and the
// MLP gathering their input first; the embeddings row-wise (vocabulary split, output split along
// the sequence) and lm_head column-wise (input gathered, logits split over the vocabulary, for
// fsdp::tp::loss_parallel). Grouped KV heads are divided over tp like the query heads (each tp
// rank keeps whole groups). Parameter names and full shapes are unchanged, so checkpoints and
// Hugging Face folders move between TP and non-TP layouts.
//
//   auto mesh = fsdp::init_device_mesh({dp, tp}, {"dp", "tp"});
//   fsdp::models::parallelize_llama(model, mesh["tp"]);           // on meta, before fully_shard
//   for (auto& layer : model->layers()) fsdp::fully_shard(layer, {.mesh = mesh["dp"]});
//   fsdp::fully_shard(model, {.mesh = mesh["dp"]});
//   auto logits = fsdp::call(model, tokens);                      // [B, T, vocab / tp]
//   auto loss = fsdp::tp::loss_parallel(logits, targets, mesh["tp"]);
//
// The sequence length must be divisible by the tp size (sequence parallelism); tied embeddings
// are refused (the head would multiply by the row-wise embedding).
#include <cstdint>
#include <string>

#include "fsdp/mesh/device_mesh.h"
#include "fsdp/tensor_parallel/parallelize.h"
#include "models/llama/llama.h"

namespace fsdp::models {

// The plan above (names relative to the Llama).
tp::ParallelizePlan llama_tp_plan();

// One line naming what `tp_size` does not divide (heads, KV heads, intermediate size,
// vocabulary) or tied embeddings, or "" when the model splits.
std::string llama_tp_problem(const LlamaConfig& config, int64_t tp_size);

// Checks llama_tp_problem (std::invalid_argument) and applies llama_tp_plan over the 1-D tp mesh.
void parallelize_llama(Llama& model, const DeviceMesh& tp_mesh);

}  // namespace fsdp::models
