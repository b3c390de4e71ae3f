#pragma once
// The configuration of a Llama-family decoder (Llama, Mistral without a sliding window, Qwen2), as
// Hugging Face's config.json states it. Both transformers spellings are read: 4.x (`rope_theta`
// and `rope_scaling` at the top, `torch_dtype`) and 5.x (`rope_parameters` holding both, `dtype`).
// A field this model cannot honour (another architecture, a sliding window in use, an unknown
// rope type, another activation, ...) is refused in one line naming the field.
//
// Example:
//   auto c = fsdp::models::LlamaConfig::from_file("TinyLlama/config.json");
//   c.device = torch::kMeta;                 // build without memory, shard, then fsdp::to_empty
//   fsdp::models::Llama model(c);
#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>

namespace fsdp::models {

// Every problem with a configuration: one line naming the field and, where there is one, the fix.
class LlamaConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct LlamaConfig {
  // "LlamaForCausalLM", "MistralForCausalLM" or "Qwen2ForCausalLM" (its model_type follows).
  std::string architecture = "LlamaForCausalLM";
  int64_t vocab_size = 256;
  int64_t hidden_size = 64;
  int64_t intermediate_size = 128;
  int64_t num_hidden_layers = 2;
  int64_t num_attention_heads = 4;
  int64_t num_key_value_heads = 2;  // grouped-query attention: heads per KV head = heads / kv heads
  int64_t head_dim = 0;             // 0: hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // rope_scaling: "default" (none) or "llama3" (Llama 3.1's frequency-dependent scaling).
  std::string rope_type = "default";
  double rope_factor = 8.0;
  double rope_low_freq_factor = 1.0;
  double rope_high_freq_factor = 4.0;
  int64_t rope_original_max_position_embeddings = 8192;
  int64_t max_position_embeddings = 2048;
  bool tie_word_embeddings = false;  // lm_head uses model.embed_tokens.weight (no lm_head.weight)
  bool attention_bias = false;       // q/k/v biases (Llama: o_proj too; Qwen2: always, o_proj never)
  bool mlp_bias = false;             // gate/up/down biases
  // RMSNorm of each query and key head before the rotation (self_attn.q_norm / k_norm, [head_dim]):
  // Qwen3's attention. Not a field of config.json: the architectures that have it (models/moe) set it.
  bool qk_norm = false;
  std::string torch_dtype = "float32";  // the dtype the weights were saved in, as written
  double initializer_range = 0.02;      // std of reset_parameters' normal init
  // Fields this model does not interpret (token ids, ...), as JSON text, written back on export.
  std::map<std::string, std::string> passthrough;

  // Not in config.json: how this process builds the model.
  bool fused_attention = true;         // LibTorch's fused attention where it has one (compat/attention.h)
  torch::Device device = torch::kCPU;  // torch::kMeta: build without memory, initialise later
  uint64_t init_seed = 0;              // reset_parameters' seed (same values for any sharding)

  int64_t resolved_head_dim() const { return head_dim > 0 ? head_dim : hidden_size / num_attention_heads; }
  bool qkv_bias() const { return attention_bias; }
  bool o_bias() const { return attention_bias && architecture != "Qwen2ForCausalLM"; }
  std::string model_type() const;  // "llama", "mistral", "qwen2"

  void validate() const;  // throws LlamaConfigError naming the bad field

  // config.json text / file -> config; throws LlamaConfigError ("<source>: field: problem").
  static LlamaConfig from_json(const std::string& text, const std::string& source = "config.json");
  static LlamaConfig from_file(const std::string& path);
  // config.json in transformers 4.x's spelling (which 5.x reads too), `torch_dtype` set to `dtype`.
  std::string to_json(const std::string& dtype) const;
};

}  // namespace fsdp::models
