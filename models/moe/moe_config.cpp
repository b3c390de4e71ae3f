#include "models/moe/moe_config.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>

namespace fsdp::models {

namespace {

using json = nlohmann::json;

constexpr const char* kSupported = "MixtralForCausalLM, Qwen3MoeForCausalLM";

// Takes the MoE fields out of config.json's object (what is left is a Llama-family config), each
// checked with a one-line error "<source>: field: problem".
struct Taker {
  json& root;
  std::string source;

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw MoEConfigError(source + ": " + field + ": " + what);
  }
  std::optional<json> take(const std::string& field) {
    auto it = root.find(field);
    if (it == root.end()) return std::nullopt;
    json v = *it;
    root.erase(it);
    if (v.is_null()) return std::nullopt;
    return v;
  }
  int64_t integer(const std::string& field, std::optional<int64_t> fallback) {
    auto v = take(field);
    if (!v) {
      if (!fallback) fail(field, "missing (required)");
      return *fallback;
    }
    if (!v->is_number_integer()) fail(field, "expected an integer, got " + v->dump());
    return v->get<int64_t>();
  }
  double number(const std::string& field, double fallback) {
    auto v = take(field);
    if (!v) return fallback;
    if (!v->is_number()) fail(field, "expected a number, got " + v->dump());
    return v->get<double>();
  }
  bool boolean(const std::string& field, bool fallback) {
    auto v = take(field);
    if (!v) return fallback;
    if (!v->is_boolean()) fail(field, "expected true or false, got " + v->dump());
    return v->get<bool>();
  }
};

// Mixtral's fields: the experts' width is intermediate_size (left in for the Llama reader too).
void take_mixtral(Taker& t, MoEConfig& c) {
  c.num_experts = t.integer("num_local_experts", 8);
  c.num_experts_per_tok = t.integer("num_experts_per_tok", 2);
  c.norm_topk_prob = true;  // MixtralTopKRouter always renormalises
  if (double noise = t.number("router_jitter_noise", 0.0); noise != 0.0)
    t.fail("router_jitter_noise",
           "router jitter (random noise on the router's input in training) is not supported; "
           "set it to 0, got " +
               std::to_string(noise));
  if (!t.root.contains("max_position_embeddings")) t.root["max_position_embeddings"] = 4096 * 32;
  const int64_t max_pos =
      t.root["max_position_embeddings"].is_number_integer() ? t.root["max_position_embeddings"].get<int64_t>() : 0;
  if (auto w = t.take("sliding_window"); w && (!w->is_number_integer() || w->get<int64_t>() < max_pos))
    t.fail("sliding_window", w->dump() + " is a sliding window in use, which is not supported; set it to null");
  t.take("attention_bias");  // not Mixtral's: no biases
  t.take("norm_topk_prob");
}

// Qwen3-MoE's fields: experts' width moe_intermediate_size; dense layers by mlp_only_layers and
// decoder_sparse_step; the sliding window off.
void take_qwen3(Taker& t, MoEConfig& c) {
  // 4.x and the Hub write num_experts, 5.x num_local_experts (its attribute map reads either).
  c.num_experts = t.root.contains("num_experts") ? t.integer("num_experts", std::nullopt) : 128;
  c.num_experts = t.integer("num_local_experts", c.num_experts);
  c.num_experts_per_tok = t.integer("num_experts_per_tok", 8);
  c.norm_topk_prob = t.boolean("norm_topk_prob", false);
  c.moe_intermediate_size = t.integer("moe_intermediate_size", 768);
  c.decoder_sparse_step = t.integer("decoder_sparse_step", 1);
  c.mlp_only_layers.clear();
  if (auto layers = t.take("mlp_only_layers")) {
    if (!layers->is_array()) t.fail("mlp_only_layers", "expected an array of layer indices, got " + layers->dump());
    for (const auto& l : *layers) {
      if (!l.is_number_integer()) t.fail("mlp_only_layers", "expected layer indices, got " + l.dump());
      c.mlp_only_layers.push_back(l.get<int64_t>());
    }
  }
  if (t.boolean("use_sliding_window", false))
    t.fail("use_sliding_window", "sliding-window attention is not supported; set it to false");
  t.take("sliding_window");     // unused with use_sliding_window false
  t.take("max_window_layers");  // likewise
  if (!t.root.contains("max_position_embeddings")) t.root["max_position_embeddings"] = 32768;
}

}  // namespace

bool MoEConfig::is_sparse_layer(int64_t layer) const {
  if (mixtral()) return true;
  return std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) == mlp_only_layers.end() && num_experts > 0 &&
         (layer + 1) % decoder_sparse_step == 0;
}

void MoEConfig::validate() const {
  auto need = [](bool ok, const std::string& what) {
    if (!ok) throw MoEConfigError("MoEConfig: " + what);
  };
  need(base.architecture == "MixtralForCausalLM" || base.architecture == "Qwen3MoeForCausalLM",
       "architecture '" + base.architecture + "' is not supported (" + kSupported + ")");
  LlamaConfig llama = base;  // attention, norms, rotary: the Llama family's checks
  llama.architecture = "LlamaForCausalLM";
  llama.validate();
  need(num_experts > 0, "num_experts must be positive, got " + std::to_string(num_experts));
  need(num_experts_per_tok > 0 && num_experts_per_tok <= num_experts,
       "num_experts_per_tok (" + std::to_string(num_experts_per_tok) + ") must be in 1..num_experts (" +
           std::to_string(num_experts) + ")");
  need(moe_intermediate_size > 0, "moe_intermediate_size must be positive");
  need(decoder_sparse_step >= 1, "decoder_sparse_step must be at least 1, got " + std::to_string(decoder_sparse_step));
  for (int64_t l : mlp_only_layers)
    need(l >= 0 && l < base.num_hidden_layers, "mlp_only_layers names layer " + std::to_string(l) + ", outside 0.." +
                                                   std::to_string(base.num_hidden_layers - 1));
  need(router_aux_loss_coef >= 0, "router_aux_loss_coef must not be negative");
  need(local_experts_first >= 0 && local_experts_count >= 0 && local_experts_first + local_count() <= num_experts,
       "local experts [" + std::to_string(local_experts_first) + ", " +
           std::to_string(local_experts_first + local_count()) + ") are not within the " + std::to_string(num_experts) +
           " experts");
  if (expert_parallel()) {
    const int64_t n = ep->size(), per = num_experts / n;
    need(num_experts % n == 0, "num_experts " + std::to_string(num_experts) + " is not divisible by the ep size " +
                                   std::to_string(n) + "; choose an ep size that divides the number of experts");
    need(local_experts_first == ep->rank() * per && local_count() == per,
         "local experts [" + std::to_string(local_experts_first) + ", " +
             std::to_string(local_experts_first + local_count()) + ") are not ep rank " + std::to_string(ep->rank()) +
             "'s block of " + std::to_string(per) + "; set them with set_expert_parallel");
  }
}

void MoEConfig::set_expert_parallel(std::shared_ptr<fsdp::comm::Comm> group) {
  ep = std::move(group);
  local_experts_first = 0;
  local_experts_count = 0;
  if (!expert_parallel()) return;
  const int64_t n = ep->size();
  if (num_experts % n != 0)
    throw MoEConfigError("MoEConfig: num_experts " + std::to_string(num_experts) + " is not divisible by the ep size " +
                         std::to_string(n) + "; choose an ep size that divides the number of experts");
  local_experts_count = num_experts / n;
  local_experts_first = ep->rank() * local_experts_count;
}

MoEConfig MoEConfig::from_json(const std::string& text, const std::string& source) {
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw MoEConfigError(source + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) throw MoEConfigError(source + ": expected a JSON object");
  MoEConfig c;
  const std::string arch = hf_architecture(text);
  if (arch != "MixtralForCausalLM" && arch != "Qwen3MoeForCausalLM")
    throw MoEConfigError(
        source + ": architectures: " + (arch.empty() ? root.value("architectures", json()).dump() : "'" + arch + "'") +
        " is not supported (" + kSupported + ")");
  c.base.architecture = arch;
  if (root.value("model_type", c.model_type()) != c.model_type())
    throw MoEConfigError(source + ": model_type: " + root["model_type"].dump() + " does not match architecture " +
                         arch + " ('" + c.model_type() + "')");
  Taker t{root, source};
  if (c.mixtral())
    take_mixtral(t, c);
  else
    take_qwen3(t, c);
  c.router_aux_loss_coef = t.number("router_aux_loss_coef", 0.001);
  c.output_router_logits = t.boolean("output_router_logits", false);
  t.take("mlp_bias");  // neither architecture has MLP biases
  // The rest is a Llama-family config: read by LlamaConfig's reader as a Llama.
  root["architectures"] = {"LlamaForCausalLM"};
  root["model_type"] = "llama";
  c.base = LlamaConfig::from_json(root.dump(), source);
  c.base.architecture = arch;
  c.base.qk_norm = !c.mixtral();
  if (c.mixtral()) c.moe_intermediate_size = c.base.intermediate_size;
  try {
    c.validate();
  } catch (const MoEConfigError& e) {
    throw MoEConfigError(source + ": " + std::string(e.what()).substr(std::string("MoEConfig: ").size()));
  }
  return c;
}

MoEConfig MoEConfig::from_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw MoEConfigError(path + ": cannot open (a Hugging Face model folder holds config.json)");
  std::stringstream text;
  text << in.rdbuf();
  return from_json(text.str(), path);
}

std::string MoEConfig::to_json(const std::string& dtype) const {
  validate();
  LlamaConfig llama = base;
  llama.architecture = "LlamaForCausalLM";
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(llama.to_json(dtype));
  j["architectures"] = {base.architecture};
  j["model_type"] = model_type();
  j.erase("mlp_bias");
  j["sliding_window"] = nullptr;
  if (mixtral()) {
    j.erase("attention_bias");
    j["num_local_experts"] = num_experts;
    j["router_jitter_noise"] = 0.0;
  } else {
    j["num_experts"] = num_experts;
    j["moe_intermediate_size"] = moe_intermediate_size;
    j["norm_topk_prob"] = norm_topk_prob;
    j["decoder_sparse_step"] = decoder_sparse_step;
    j["mlp_only_layers"] = mlp_only_layers;
    j["use_sliding_window"] = false;
  }
  j["num_experts_per_tok"] = num_experts_per_tok;
  j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["output_router_logits"] = output_router_logits;
  return j.dump(2) + "\n";
}

std::string hf_architecture(const std::string& config_json_text) {
  try {
    const json root = json::parse(config_json_text);
    if (!root.is_object()) return "";
    auto it = root.find("architectures");
    if (it == root.end() || !it->is_array() || it->size() != 1 || !(*it)[0].is_string()) return "";
    return (*it)[0].get<std::string>();
  } catch (const json::exception&) {
    return "";
  }
}

}  // namespace fsdp::models
