#pragma once
// Which model train_gpt builds (--model, --init-from): the Llama configuration of a run, from
// the sizing options or from a Hugging Face folder's config.json, checked before any work.
//
// Example (main(), before the data and the memory preflight):
//   validate(options);
//   std::optional<fsdp::models::LlamaConfig> llama = resolve_model(options);   // fills the sizes
#include <map>
#include <optional>
#include <string>

#include "fsdp/checkpoint/checkpoint.h"
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

// What a checkpoint records of its model, so that a resume never changes the model: a Llama run
// records config.json (the "hf" entry, models/llama/hf.h HFConfigState), a GPT run this record
// of its configuration as the "gpt" entry: {"model_type": "gpt", "n_layer": 2, "n_head": 2,
// "n_embd": 32, "vocab_size": 256, "block_size": 16} (checkpoint key "extra.gpt.config_json").
// Example:
//   GptConfigRecord gpt(gpt_config_json(o));
//   fsdp::checkpoint::save(dir, {model.ptr(), &opt, {{"trainer", &scalars}, {kGptConfigEntry, &gpt}}});
inline constexpr const char* kGptConfigEntry = "gpt";
class GptConfigRecord : public fsdp::checkpoint::Stateful {
 public:
  GptConfigRecord() = default;
  explicit GptConfigRecord(std::string json) : json(std::move(json)) {}
  std::map<std::string, at::Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, at::Tensor>& state) override;
  std::string json;
};

// The record of the GPT these options build (after resolve_vocab: o.vocab_size is set).
std::string gpt_config_json(const Options& o);

// A resume never changes the model: throws std::invalid_argument (one line, exit status 2) when
// the checkpoint `dir` records another model than the one this run builds (`llama`: its
// configuration, from --init-from's config.json or the sizing options; nullopt: the GPT of the
// sizing options), naming both and the first field that differs. Fields that shape no weight
// (max_position_embeddings, torch_dtype, the init seed) may differ. A checkpoint that records no
// model (saved before the record existed) is left to the shape check. Reads index.json and one
// small tensor: run it before anything is allocated.
void check_resume_model(const std::string& dir, const Options& o,
                        const std::optional<fsdp::models::LlamaConfig>& llama);

}  // namespace train_gpt
