#include "model.h"

#include <cstring>
#include <filesystem>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/inspect.h"
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

std::map<std::string, at::Tensor> GptConfigRecord::state_dict() const {
  at::Tensor bytes = at::empty({static_cast<int64_t>(json.size())}, at::kByte);
  std::memcpy(bytes.data_ptr<uint8_t>(), json.data(), json.size());
  return {{"config_json", bytes}};
}

void GptConfigRecord::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  auto it = state.find("config_json");
  if (it == state.end()) return;
  const at::Tensor bytes = it->second.to(at::kCPU, at::kByte).contiguous();
  json.assign(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
}

namespace {

using Fields = std::vector<std::pair<std::string, std::string>>;

// A model as the resume check compares it: a sentence for the message and the fields that must match.
struct ModelIdentity {
  std::string kind;  // "gpt" or "llama"
  std::string text;
  Fields fields;
};

const char* const kGptKeys[] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};

std::string number(double v) {
  std::ostringstream s;
  s << std::setprecision(12) << v;
  return s.str();
}

ModelIdentity llama_identity(const fsdp::models::LlamaConfig& c) {
  auto i = [](int64_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  const std::string rope = c.rope_type != "llama3"
                               ? c.rope_type
                               : "llama3 " + number(c.rope_factor) + "/" + number(c.rope_low_freq_factor) + "/" +
                                     number(c.rope_high_freq_factor) + "/" + i(c.rope_original_max_position_embeddings);
  return {"llama",
          describe(c),
          {{"architecture", c.architecture},
           {"num_hidden_layers", i(c.num_hidden_layers)},
           {"hidden_size", i(c.hidden_size)},
           {"num_attention_heads", i(c.num_attention_heads)},
           {"num_key_value_heads", i(c.num_key_value_heads)},
           {"head_dim", i(c.resolved_head_dim())},
           {"intermediate_size", i(c.intermediate_size)},
           {"vocab_size", i(c.vocab_size)},
           {"tie_word_embeddings", b(c.tie_word_embeddings)},
           {"attention_bias", b(c.attention_bias)},
           {"mlp_bias", b(c.mlp_bias)},
           {"rms_norm_eps", number(c.rms_norm_eps)},
           {"rope_theta", number(c.rope_theta)},
           {"rope_scaling", rope}}};
}

ModelIdentity gpt_identity(const std::string& json, const std::string& source) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": its recorded GPT configuration is not JSON (" + e.what() + ")");
  }
  ModelIdentity id{"gpt", "", {}};
  for (const char* key : kGptKeys) {
    if (!j.contains(key) || !j[key].is_number_integer())
      throw std::invalid_argument(source + ": its recorded GPT configuration has no integer '" + key + "'");
    id.fields.emplace_back(key, std::to_string(j[key].get<int64_t>()));
  }
  auto f = [&](const char* key) { return j[key].get<int64_t>(); };
  id.text = "GPT " + std::to_string(f("n_layer")) + " layers, dim " + std::to_string(f("n_embd")) + ", " +
            std::to_string(f("n_head")) + " heads, vocab " + std::to_string(f("vocab_size")) + ", seq-len " +
            std::to_string(f("block_size"));
  return id;
}

// What `dir` records of its model; nullopt when it records nothing (saved before the record existed).
std::optional<ModelIdentity> recorded_model(const std::string& dir) {
  fsdp::checkpoint::CheckpointReader reader(dir);
  auto text = [&](const std::string& key) {
    const at::Tensor bytes = reader.read(key).to(at::kByte).contiguous();
    return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
  };
  const std::string source = "checkpoint " + dir;
  if (reader.info().find(fsdp::models::kHFConfigKey)) {
    // LlamaConfigError is a std::invalid_argument: one line, exit status 2.
    return llama_identity(
        fsdp::models::LlamaConfig::from_json(text(fsdp::models::kHFConfigKey), source + " (recorded config.json)"));
  }
  const std::string gpt_key = std::string("extra.") + kGptConfigEntry + ".config_json";
  if (reader.info().find(gpt_key)) return gpt_identity(text(gpt_key), source);
  return std::nullopt;
}

}  // namespace

std::string gpt_config_json(const Options& o) {
  nlohmann::json j = {{"model_type", "gpt"}, {"n_layer", o.layers},        {"n_head", o.heads},
                      {"n_embd", o.dim},     {"vocab_size", o.vocab_size}, {"block_size", o.seq_len}};
  return j.dump();
}

void check_resume_model(const std::string& dir, const Options& o,
                        const std::optional<fsdp::models::LlamaConfig>& llama) {
  const std::optional<ModelIdentity> there = recorded_model(dir);
  if (!there) return;  // an older checkpoint: the shape check decides
  ModelIdentity here = llama ? llama_identity(*llama) : gpt_identity(gpt_config_json(o), "this run");
  here.text += !o.init_from.empty() ? " from --init-from " + o.init_from
               : llama              ? " (--model llama and its size options)"
                                    : " (--model gpt and its size options)";
  std::string field;
  if (there->kind == here.kind) {
    for (size_t k = 0; k < here.fields.size() && field.empty(); ++k) {
      if (here.fields[k].second != there->fields[k].second)
        field =
            " (" + here.fields[k].first + " " + there->fields[k].second + " there, " + here.fields[k].second + " here)";
    }
    if (field.empty()) return;
  }
  throw std::invalid_argument("checkpoint " + dir + " holds another model than this run's: it holds " + there->text +
                              ", this run builds " + here.text + field +
                              "; a resume never changes the model: resume with the --model, --init-from or size "
                              "options it was trained with, or give another --checkpoint-dir");
}

}  // namespace train_gpt
