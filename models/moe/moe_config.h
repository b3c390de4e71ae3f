#pragma once
// The configuration of a mixture-of-experts decoder (MixtralForCausalLM, Qwen3MoeForCausalLM), as
// Hugging Face's config.json states it: a Llama-family configuration (attention, norms, rotary
// embeddings, vocabulary; read by LlamaConfig's own reader, both transformers spellings) plus the
// experts and the router. A field or value the model cannot honour (a sliding window in use,
// router jitter, another activation, ...) is refused in one line naming the field.
//
// Example:
//   auto c = fsdp::models::MoEConfig::from_file("Mixtral/config.json");
//   c.base.device = torch::kMeta;            // build without memory, shard, then fsdp::to_empty
//   fsdp::models::MoECausalLM model(c);
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/comm/comm.h"
#include "fsdp/mesh/device_mesh.h"
#include "models/llama/llama_config.h"

namespace fsdp::models {

// A configuration this model cannot honour: one line naming the field (a LlamaConfigError, so
// callers catching those catch these too).
class MoEConfigError : public LlamaConfigError {
 public:
  using LlamaConfigError::LlamaConfigError;
};

struct MoEConfig {
  // Everything but the experts. base.architecture is "MixtralForCausalLM" or
  // "Qwen3MoeForCausalLM"; base.intermediate_size is the dense MLP's width (Qwen3's dense layers;
  // Mixtral has none and states its experts' width there); base.qk_norm is set for Qwen3.
  LlamaConfig base;
  int64_t num_experts = 4;             // Mixtral: num_local_experts; Qwen3: num_experts (5.x: num_local_experts)
  int64_t num_experts_per_tok = 2;     // top k
  int64_t moe_intermediate_size = 64;  // each expert's width (Mixtral: intermediate_size)
  bool norm_topk_prob = true;          // the top k probabilities renormalised to sum 1 (Mixtral: always)
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;     // written back; the trainer adds the auxiliary loss regardless
  int64_t decoder_sparse_step = 1;       // Qwen3: layer i is sparse when (i + 1) % step == 0 ...
  std::vector<int64_t> mlp_only_layers;  // ... and i is not listed here (else a dense MLP)

  // Not in config.json: the experts this process holds, [local_experts_first, + count); count 0:
  // all. A process holding a part runs its experts' tokens only (expert parallelism dispatches
  // the rest); the parameters keep their global names (experts.E).
  int64_t local_experts_first = 0;
  int64_t local_experts_count = 0;
  // Expert parallelism (fsdp::ep): the group the experts are spread over; null or a group of one:
  // none. Set it with set_expert_parallel, which also sets the local range.
  std::shared_ptr<fsdp::comm::Comm> ep;

  // Rank r of `group` (n ranks) holds experts [r*E/n, (r+1)*E/n) of every sparse layer, and the
  // blocks send their tokens to the experts' ranks (fsdp::ep::dispatch / combine); a group of one
  // (or null) is no expert parallelism. E not divisible by n: MoEConfigError naming both. The
  // mesh form takes its "ep" dimension. Collective use: every rank of the group builds the model.
  void set_expert_parallel(std::shared_ptr<fsdp::comm::Comm> group);
  void set_expert_parallel(const fsdp::DeviceMesh& mesh) { set_expert_parallel(mesh.comm("ep")); }
  bool expert_parallel() const { return ep && ep->size() > 1; }

  bool mixtral() const { return base.architecture == "MixtralForCausalLM"; }
  std::string model_type() const { return mixtral() ? "mixtral" : "qwen3_moe"; }
  bool is_sparse_layer(int64_t layer) const;
  int64_t local_count() const { return local_experts_count > 0 ? local_experts_count : num_experts; }

  void validate() const;  // throws MoEConfigError naming the bad field

  // config.json text / file -> config; throws MoEConfigError / LlamaConfigError
  // ("<source>: field: problem").
  static MoEConfig from_json(const std::string& text, const std::string& source = "config.json");
  static MoEConfig from_file(const std::string& path);
  // config.json as transformers writes it (which 4.x and 5.x both read), torch_dtype set to `dtype`.
  std::string to_json(const std::string& dtype) const;
};

// The architecture config.json names ("" when it names none or is not JSON): for callers that pick
// a model family by it.
std::string hf_architecture(const std::string& config_json_text);

}  // namespace fsdp::models
