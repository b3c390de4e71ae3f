#include "models/gpt_tp.h"

#include <stdexcept>

#include "models/tensor_parallel.h"

namespace fsdp::models {

tp::ParallelizePlan gpt_tp_plan() {
  return {
      {"h.*.attn.c_attn", tp::ColwiseParallel{.fused = 3}},  // [q | k | v]: heads split in each
      {"h.*.attn.c_proj", tp::RowwiseParallel{}},
      {"h.*.mlp.c_fc", tp::ColwiseParallel{}},
      {"h.*.mlp.c_proj", tp::RowwiseParallel{}},
  };
}

std::string gpt_tp_problem(const GPTConfig& config, int64_t tp_size) {
  if (tp_size < 1) return "the tp size must be at least 1, not " + std::to_string(tp_size);
  if (config.n_head % tp_size != 0) {
    return "the tp size " + std::to_string(tp_size) + " does not divide the " + std::to_string(config.n_head) +
           " attention heads (each tp rank takes whole heads); choose a tp size that divides the head count";
  }
  if (config.n_embd % tp_size != 0) {
    return "the tp size " + std::to_string(tp_size) + " does not divide the embedding width " +
           std::to_string(config.n_embd) + "; choose a tp size that divides it";
  }
  return "";
}

void parallelize_gpt(GPT& gpt, const DeviceMesh& tp_mesh) {
  register_tp_module_types();
  if (tp_mesh.ndim() == 1) {
    const std::string problem = gpt_tp_problem(gpt->config, tp_mesh.size(0));
    if (!problem.empty()) throw std::invalid_argument("parallelize_gpt: " + problem);
  }
  if (gpt->blocks.empty()) return;  // nothing to split (parallelize_module refuses unmatched entries)
  tp::parallelize_module(gpt, tp_mesh, gpt_tp_plan());
}

}  // namespace fsdp::models
