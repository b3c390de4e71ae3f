#include "models/llama/llama_config.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

namespace fsdp::models {

namespace {

using json = nlohmann::json;

const std::map<std::string, std::string> kArchitectures = {
    {"LlamaForCausalLM", "llama"}, {"MistralForCausalLM", "mistral"}, {"Qwen2ForCausalLM", "qwen2"}};

// Reads config.json's fields with one-line errors "<source>: <field>: <problem>".
struct Fields {
  const json& root;
  std::string source;
  std::set<std::string> used;

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw LlamaConfigError(source + ": " + field + ": " + what);
  }
  // The field's value, or nullptr when absent or null.
  const json* get(const json& obj, const std::string& field) {
    if (&obj == &root) used.insert(field);
    auto it = obj.find(field);
    if (it == obj.end() || it->is_null()) return nullptr;
    return &*it;
  }
  // `field` of `obj` (the root when null) as T, checked by `is_kind`; `fallback` when absent.
  template <typename T, typename IsKind>
  T typed(const std::string& field, std::optional<T> fallback, const json* obj, const std::string& prefix,
          IsKind is_kind, const char* kind) {
    const std::string label = prefix + field;
    const json* v = get(obj ? *obj : root, field);
    if (!v) {
      if (!fallback) fail(label, "missing (required)");
      return *fallback;
    }
    if (!is_kind(*v)) fail(label, std::string("expected ") + kind + ", got " + v->dump());
    return v->get<T>();
  }
  int64_t integer(const std::string& field, std::optional<int64_t> fallback, const json* obj = nullptr,
                  const std::string& prefix = "") {
    return typed<int64_t>(
        field, fallback, obj, prefix, [](const json& v) { return v.is_number_integer(); }, "an integer");
  }
  double number(const std::string& field, std::optional<double> fallback, const json* obj = nullptr,
                const std::string& prefix = "") {
    return typed<double>(
        field, fallback, obj, prefix, [](const json& v) { return v.is_number(); }, "a number");
  }
  bool boolean(const std::string& field, bool fallback) {
    const json* v = get(root, field);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(field, std::string("expected true or false, got ") + v->dump());
    return v->get<bool>();
  }
  std::string string(const std::string& field, const std::string& fallback, const json* obj = nullptr,
                     const std::string& prefix = "") {
    const std::string label = prefix + field;
    const json* v = get(obj ? *obj : root, field);
    if (!v) return fallback;
    if (!v->is_string()) fail(label, std::string("expected a string, got ") + v->dump());
    return v->get<std::string>();
  }
};

// rope_scaling (4.x) or rope_parameters (5.x): the rope type and its llama3 parameters.
void read_rope(Fields& f, const json& rope, const std::string& label, LlamaConfig& c) {
  if (!rope.is_object()) f.fail(label, std::string("expected an object, got ") + rope.dump());
  const std::string prefix = label + ".";
  // 4.x wrote "type" before it wrote "rope_type".
  std::string type = f.string("rope_type", "", &rope, prefix);
  if (type.empty()) type = f.string("type", "default", &rope, prefix);
  if (rope.contains("rope_theta")) c.rope_theta = f.number("rope_theta", std::nullopt, &rope, prefix);
  if (type == "default") return;
  if (type != "llama3") f.fail(prefix + "rope_type", "'" + type + "' is not supported (supported: default, llama3)");
  c.rope_type = type;
  c.rope_factor = f.number("factor", std::nullopt, &rope, prefix);
  c.rope_low_freq_factor = f.number("low_freq_factor", std::nullopt, &rope, prefix);
  c.rope_high_freq_factor = f.number("high_freq_factor", std::nullopt, &rope, prefix);
  c.rope_original_max_position_embeddings = f.integer("original_max_position_embeddings", std::nullopt, &rope, prefix);
  if (rope.contains("attention_factor"))
    if (double a = f.number("attention_factor", 1.0, &rope, prefix); a != 1.0)
      f.fail(prefix + "attention_factor", "only 1 is supported for llama3 scaling, got " + std::to_string(a));
}

std::string dtype_field(Fields& f) {
  // 5.x writes "dtype", 4.x "torch_dtype"; either may be absent (float32).
  std::string dtype = f.string("dtype", "");
  if (dtype.empty()) dtype = f.string("torch_dtype", "float32");
  if (dtype != "float32" && dtype != "bfloat16" && dtype != "float16")
    f.fail("torch_dtype", "'" + dtype + "' is not supported (float32, bfloat16, float16)");
  return dtype;
}

// The fields a Llama-family model here cannot honour: refused rather than silently ignored.
void refuse_unsupported(Fields& f, LlamaConfig& c) {
  if (auto act = f.string("hidden_act", "silu"); act != "silu")
    f.fail("hidden_act", "'" + act + "' is not supported (only silu, the SwiGLU of Llama)");
  if (auto tp = f.integer("pretraining_tp", 1); tp != 1)
    f.fail("pretraining_tp", std::to_string(tp) + " is not supported (only 1)");
  if (auto p = f.number("attention_dropout", 0.0); p != 0.0)
    f.fail("attention_dropout", "attention dropout is not supported (set it to 0), got " + std::to_string(p));
  if (auto r = f.number("partial_rotary_factor", 1.0); r != 1.0)
    f.fail("partial_rotary_factor", "partial rotary embeddings are not supported (only 1), got " + std::to_string(r));
  if (f.get(f.root, "quantization_config"))
    f.fail("quantization_config", "quantized checkpoints are not supported; use unquantized weights");
  if (f.boolean("use_sliding_window", false))
    f.fail("use_sliding_window", "sliding-window attention is not supported; set it to false");
  // Mistral states its window in sliding_window alone; one at least as long as any sequence is
  // no window at all. Qwen2 keeps a value there that use_sliding_window (above) switches off.
  if (const json* w = f.get(f.root, "sliding_window");
      w && c.architecture == "MistralForCausalLM" &&
      (!w->is_number_integer() || w->get<int64_t>() < c.max_position_embeddings))
    f.fail("sliding_window", w->dump() + " is a sliding window in use, which is not supported; set it to null");
  f.used.insert("max_window_layers");  // only meaningful with use_sliding_window
  if (const json* types = f.get(f.root, "layer_types")) {
    if (!types->is_array()) f.fail("layer_types", "expected an array of strings");
    for (const auto& t : *types)
      if (t != "full_attention")
        f.fail("layer_types", t.dump() + " is not supported (only full_attention: no sliding window)");
  }
}

}  // namespace

std::string LlamaConfig::model_type() const {
  auto it = kArchitectures.find(architecture);
  return it == kArchitectures.end() ? "" : it->second;
}

void LlamaConfig::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw LlamaConfigError("LlamaConfig: " + what);
  };
  need(kArchitectures.count(architecture) > 0,
       "architecture '" + architecture + "' is not supported (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)");
  need(vocab_size > 0, "vocab_size must be positive");
  need(hidden_size > 0 && intermediate_size > 0, "hidden_size and intermediate_size must be positive");
  need(num_hidden_layers >= 0, "num_hidden_layers must not be negative");
  need(num_attention_heads > 0 && num_key_value_heads > 0,
       "num_attention_heads and num_key_value_heads must be positive");
  need(num_attention_heads % num_key_value_heads == 0, "num_key_value_heads (" + std::to_string(num_key_value_heads) +
                                                           ") must divide num_attention_heads (" +
                                                           std::to_string(num_attention_heads) + ")");
  need(head_dim > 0 || hidden_size % num_attention_heads == 0,
       "num_attention_heads (" + std::to_string(num_attention_heads) + ") must divide hidden_size (" +
           std::to_string(hidden_size) + ") unless head_dim is given");
  need(resolved_head_dim() % 2 == 0, "head_dim must be even (rotary embeddings rotate pairs)");
  need(rms_norm_eps > 0, "rms_norm_eps must be positive");
  need(rope_theta > 0, "rope_theta must be positive");
  need(rope_type == "default" || rope_type == "llama3", "rope_type '" + rope_type + "' is not supported");
  need(rope_type != "llama3" || (rope_factor > 0 && rope_high_freq_factor > rope_low_freq_factor &&
                                 rope_original_max_position_embeddings > 0),
       "llama3 rope scaling needs factor > 0, high_freq_factor > low_freq_factor, "
       "original_max_position_embeddings > 0");
  need(max_position_embeddings > 0, "max_position_embeddings must be positive");
}

LlamaConfig LlamaConfig::from_json(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw LlamaConfigError(source + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) throw LlamaConfigError(source + ": expected a JSON object");
  Fields f{root, source, {}};
  LlamaConfig c;
  c.passthrough.clear();

  const json* archs = f.get(root, "architectures");
  if (!archs || !archs->is_array() || archs->size() != 1 || !(*archs)[0].is_string())
    f.fail("architectures", "expected one architecture, e.g. [\"LlamaForCausalLM\"], got " +
                                (archs ? archs->dump() : std::string("nothing")));
  c.architecture = (*archs)[0].get<std::string>();
  if (!kArchitectures.count(c.architecture))
    f.fail("architectures",
           "'" + c.architecture + "' is not supported (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)");
  if (auto type = f.string("model_type", c.model_type()); type != c.model_type())
    f.fail("model_type",
           "'" + type + "' does not match architecture " + c.architecture + " ('" + c.model_type() + "')");

  const bool llama = c.architecture == "LlamaForCausalLM", qwen2 = c.architecture == "Qwen2ForCausalLM";
  c.vocab_size = f.integer("vocab_size", std::nullopt);
  c.hidden_size = f.integer("hidden_size", std::nullopt);
  c.intermediate_size = f.integer("intermediate_size", std::nullopt);
  c.num_hidden_layers = f.integer("num_hidden_layers", std::nullopt);
  c.num_attention_heads = f.integer("num_attention_heads", std::nullopt);
  c.num_key_value_heads = f.integer("num_key_value_heads", c.num_attention_heads);
  c.head_dim = f.integer("head_dim", 0);
  c.rms_norm_eps = f.number("rms_norm_eps", 1e-6);
  c.max_position_embeddings = f.integer("max_position_embeddings", llama ? 2048 : qwen2 ? 32768 : 4096 * 32);
  c.tie_word_embeddings = f.boolean("tie_word_embeddings", false);
  // Qwen2 always has q/k/v biases; Mistral never; Llama when attention_bias says so.
  c.attention_bias = qwen2 || (llama && f.boolean("attention_bias", false));
  c.mlp_bias = llama && f.boolean("mlp_bias", false);
  if (!llama) {  // not fields of these architectures: dropped rather than written back
    f.used.insert("attention_bias");
    f.used.insert("mlp_bias");
  }
  c.initializer_range = f.number("initializer_range", 0.02);
  c.rope_theta = f.number("rope_theta", 10000.0);
  c.rope_type = "default";
  if (const json* rope = f.get(root, "rope_scaling")) read_rope(f, *rope, "rope_scaling", c);
  if (const json* rope = f.get(root, "rope_parameters")) read_rope(f, *rope, "rope_parameters", c);
  c.torch_dtype = dtype_field(f);
  refuse_unsupported(f, c);
  f.used.insert("transformers_version");  // export writes none: not the version that made the file
  for (const auto& [key, value] : root.items())
    if (!f.used.count(key)) c.passthrough[key] = value.dump();
  try {
    c.validate();
  } catch (const LlamaConfigError& e) {
    throw LlamaConfigError(source + ": " + std::string(e.what()).substr(std::string("LlamaConfig: ").size()));
  }
  return c;
}

LlamaConfig LlamaConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw LlamaConfigError(path + ": cannot open (a Hugging Face model folder holds config.json)");
  std::stringstream text;
  text << in.rdbuf();
  return from_json(text.str(), path);
}

std::string LlamaConfig::to_json(const std::string& dtype) const {
  validate();
  nlohmann::ordered_json j;
  j["architectures"] = {architecture};
  j["model_type"] = model_type();
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = resolved_head_dim();
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  if (rope_type == "llama3")
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope_factor},
                         {"low_freq_factor", rope_low_freq_factor},
                         {"high_freq_factor", rope_high_freq_factor},
                         {"original_max_position_embeddings", rope_original_max_position_embeddings}};
  else
    j["rope_scaling"] = nullptr;
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  if (architecture == "LlamaForCausalLM") {
    j["attention_bias"] = attention_bias;
    j["mlp_bias"] = mlp_bias;
  }
  if (architecture == "MistralForCausalLM") j["sliding_window"] = nullptr;  // transformers' default is 4096
  if (architecture == "Qwen2ForCausalLM") j["use_sliding_window"] = false;
  j["initializer_range"] = initializer_range;
  j["torch_dtype"] = dtype;
  for (const auto& [key, text] : passthrough)
    if (!j.contains(key)) j[key] = nlohmann::ordered_json::parse(text);
  return j.dump(2) + "\n";
}

}  // namespace fsdp::models
