#pragma once
// Which model train_gpt builds (--model, --init-from): the Llama configuration of a run, from
// the sizing options or from a Hugging Face folder's config.json, checked before any work.
//
// Example (main(), before the data and the memory preflight):
//   validate(options);
//   std::optional<fsdp::models::LlamaConfig> llama = resolve_model(options);   // fills the sizes
#include <optional>
#include <string>

#include "models/llama/llama_config.h"
#include "options.h"

namespace train_gpt {

// nullopt for --model gpt. For --model llama from scratch: the configuration the sizing options
// describe (max_position_embeddings = --seq-len, init_seed = --seed). For --init-from DIR: DIR's
// config.json, after checking that the folder exists and that its weights can be read (headers
// only), that --seq-len fits max_position_embeddings and that the data's ids fit its
// vocabulary; then o.layers, dim, heads, kv_heads, ffn_dim and vocab_size are set from it (the
// banner, the memory estimate and the rank check read them). Throws std::invalid_argument (one
// line: exit status 2).
std::optional<fsdp::models::LlamaConfig> resolve_model(Options& o);

// "Llama (LlamaForCausalLM) 2 layers, hidden 32, 4 heads / 2 KV heads (head 16), ffn 64, vocab 256"
std::string describe(const fsdp::models::LlamaConfig& c);

}  // namespace train_gpt
