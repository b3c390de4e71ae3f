#include "models/llama/llama_tp.h"

#include <stdexcept>

#include "models/tensor_parallel.h"

namespace fsdp::models {

tp::ParallelizePlan llama_tp_plan() {
  using tp::Replicate;
  using tp::Shard;
  return {
      // Vocabulary split; each rank's partial rows reduce-scattered along the sequence.
      {"model.embed_tokens", tp::RowwiseParallel{.input_layouts = Replicate(), .output_layouts = Shard(1)}},
      {"model.norm", tp::SequenceParallel{}},
      // Gathers the sequence, computes its vocabulary slice (loss_parallel takes it as it is).
      {"lm_head", tp::ColwiseParallel{.input_layouts = Shard(1), .output_layouts = Shard(-1)}},
      {"model.layers.*.input_layernorm", tp::SequenceParallel{}},
      // x gathered along the sequence; cos and sin are the same on every rank.
      {"model.layers.*.self_attn",
       tp::PrepareModuleInput{.input_layouts = {Shard(1), Replicate(), Replicate()},
                              .desired_input_layouts = {Replicate(), Replicate(), Replicate()}}},
      {"model.layers.*.self_attn.q_proj", tp::ColwiseParallel{}},
      {"model.layers.*.self_attn.k_proj", tp::ColwiseParallel{}},
      {"model.layers.*.self_attn.v_proj", tp::ColwiseParallel{}},
      {"model.layers.*.self_attn.o_proj",
       tp::RowwiseParallel{.input_layouts = std::nullopt, .output_layouts = Shard(1)}},
      {"model.layers.*.post_attention_layernorm", tp::SequenceParallel{}},
      {"model.layers.*.mlp",
       tp::PrepareModuleInput{.input_layouts = {Shard(1)}, .desired_input_layouts = {Replicate()}}},
      {"model.layers.*.mlp.gate_proj", tp::ColwiseParallel{}},
      {"model.layers.*.mlp.up_proj", tp::ColwiseParallel{}},
      {"model.layers.*.mlp.down_proj", tp::RowwiseParallel{.input_layouts = std::nullopt, .output_layouts = Shard(1)}},
  };
}

std::string llama_tp_problem(const LlamaConfig& c, int64_t tp_size) {
  if (tp_size < 1) return "the tp size must be at least 1, not " + std::to_string(tp_size);
  const std::string tp = "the tp size " + std::to_string(tp_size);
  if (c.tie_word_embeddings)
    return "tensor parallelism does not support tied embeddings (tie_word_embeddings: the head would multiply by "
           "the vocabulary-split embedding); use --tp-size 1";
  auto divides = [&](int64_t n, const std::string& what) -> std::string {
    if (n % tp_size == 0) return "";
    return tp + " does not divide the " + std::to_string(n) + " " + what + "; choose a tp size that divides it";
  };
  for (const auto& problem : {divides(c.num_attention_heads, "attention heads (each tp rank takes whole heads)"),
                              divides(c.num_key_value_heads, "key/value heads (each tp rank takes whole KV groups)"),
                              divides(c.intermediate_size, "MLP features (intermediate_size)"),
                              divides(c.vocab_size, "vocabulary entries (vocab_size)")})
    if (!problem.empty()) return problem;
  return "";
}

void parallelize_llama(Llama& model, const DeviceMesh& tp_mesh) {
  register_tp_module_types();
  if (tp_mesh.ndim() == 1) {
    const std::string problem = llama_tp_problem(model->config, tp_mesh.size(0));
    if (!problem.empty()) throw std::invalid_argument("parallelize_llama: " + problem);
  }
  tp::parallelize_module(model, tp_mesh, llama_tp_plan());
}

}  // namespace fsdp::models
