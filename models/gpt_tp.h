#pragma once
// Tensor parallelism for the example GPT (models/gpt.h), Megatron-style: per block the fused
// q|k|v projection c_attn column-wise with its three blocks split separately (rank r holds heads
// [r H/T, (r+1) H/T) of q, of k and of v: ColwiseParallel{.fused = 3}), the attention's output
// projection row-wise (all-reduced), the MLP's c_fc column-wise and c_proj row-wise. Embeddings,
// LayerNorms and lm_head stay replicated. Parameter names and full shapes are unchanged, so
// checkpoints move between TP and non-TP layouts.
//
//   auto mesh = fsdp::init_device_mesh({dp, tp}, {"dp", "tp"});
//   fsdp::models::parallelize_gpt(gpt, mesh["tp"]);                  // on meta, before fully_shard
//   for (auto& b : gpt->blocks) fsdp::fully_shard(b, {.mesh = mesh["dp"]});
//
// The attention computes with its local heads (c_attn's local width / head dim), so the model
// source is the same for every layout.
#include <cstdint>
#include <string>

#include "fsdp/mesh/device_mesh.h"
#include "fsdp/tensor_parallel/parallelize.h"
#include "models/gpt.h"

namespace fsdp::models {

// The plan above (names relative to the GPT).
tp::ParallelizePlan gpt_tp_plan();

// One line naming what `tp_size` does not divide (n_head, n_embd), or "" when the GPT splits.
std::string gpt_tp_problem(const GPTConfig& config, int64_t tp_size);

// Registers the model's module types, checks gpt_tp_problem (std::invalid_argument) and applies
// gpt_tp_plan over the 1-D `tp_mesh`.
void parallelize_gpt(GPT& gpt, const DeviceMesh& tp_mesh);

}  // namespace fsdp::models
