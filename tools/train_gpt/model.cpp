#include "model.h"

#include <filesystem>
#include <stdexcept>

#include "models/llama/hf.h"

namespace train_gpt {

namespace fs = std::filesystem;

std::optional<fsdp::models::LlamaConfig> resolve_model(Options& o) {
  if (!o.llama()) return std::nullopt;
  fsdp::models::LlamaConfig c;
  if (o.init_from.empty()) {
    c.vocab_size = o.vocab_size;  // resolve_vocab() ran: 256 for bytes, else the shards'
    c.hidden_size = o.dim;
    c.intermediate_size = o.resolved_ffn_dim();
    c.num_hidden_layers = o.layers;
    c.num_attention_heads = o.heads;
    c.num_key_value_heads = o.resolved_kv_heads();
    c.max_position_embeddings = o.seq_len;
    c.init_seed = o.seed;
    try {
      c.validate();
    } catch (const std::exception& e) {
      throw std::invalid_argument(std::string("--model llama: ") + e.what());
    }
    return c;
  }
  const std::string& dir = o.init_from;
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    throw std::invalid_argument("--init-from " + dir + ": " +
                                (fs::exists(dir, ec) ? "not a folder" : "no such folder") +
                                " (give a Hugging Face model folder: config.json and model.safetensors or its index)");
  if (!fs::exists(fs::path(dir) / "config.json", ec))
    throw std::invalid_argument("--init-from " + dir +
                                ": no config.json (a Hugging Face model folder holds config.json and the weights)");
  try {
    c = fsdp::models::read_hf_config(dir);
    fsdp::models::check_hf_weights(dir);
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("--init-from: ") + e.what());
  }
  if (o.seq_len > c.max_position_embeddings)
    throw std::invalid_argument("--seq-len " + std::to_string(o.seq_len) + " exceeds " + dir +
                                "/config.json's max_position_embeddings " + std::to_string(c.max_position_embeddings) +
                                ": give --seq-len " + std::to_string(c.max_position_embeddings) + " or less");
  if (!o.tokens() && c.vocab_size < 256)
    throw std::invalid_argument(dir + "/config.json's vocab_size " + std::to_string(c.vocab_size) +
                                " is smaller than the 256 ids of byte data: train it on --data tokens:PATTERN "
                                "(ids below its vocabulary)");
  o.layers = c.num_hidden_layers;
  o.dim = c.hidden_size;
  o.heads = c.num_attention_heads;
  o.kv_heads = c.num_key_value_heads;
  o.ffn_dim = c.intermediate_size;
  o.vocab_size = c.vocab_size;  // the data's ids are checked against it (resolve_vocab)
  c.init_seed = o.seed;
  return c;
}

std::string describe(const fsdp::models::LlamaConfig& c) {
  auto i = [](int64_t v) { return std::to_string(v); };
  return "Llama (" + c.architecture + ") " + i(c.num_hidden_layers) + " layers, hidden " + i(c.hidden_size) + ", " +
         i(c.num_attention_heads) + " heads / " + i(c.num_key_value_heads) + " KV heads (head " +
         i(c.resolved_head_dim()) + "), ffn " + i(c.intermediate_size) + ", vocab " + i(c.vocab_size) +
         (c.tie_word_embeddings ? ", tied embeddings" : "");
}

}  // namespace train_gpt
