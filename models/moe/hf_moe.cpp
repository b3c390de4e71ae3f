#include "models/moe/hf_moe.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/sharding/fully_shard.h"
#include "models/llama/hf_folder.h"

namespace fsdp::models {

namespace fs = std::filesystem;

namespace {

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// config.json against the model asked for: the fields that decide what the weights mean.
void check_config(const MoEConfig& file, const MoEConfig& model, const std::string& source) {
  auto same = [&](const char* field, const auto& a, const auto& b) {
    if (a != b) {
      std::ostringstream msg;
      msg << source << ": " << field << " differs from the model's (";
      if constexpr (std::is_same_v<std::decay_t<decltype(a)>, std::vector<int64_t>>)
        msg << a.size() << " vs " << b.size() << " entries";
      else
        msg << a << " vs " << b;
      msg << "); build the model from this config.json (read_moe_config)";
      throw HFError(msg.str());
    }
  };
  const auto &f = file.base, &m = model.base;
  same("architectures", f.architecture, m.architecture);
  same("vocab_size", f.vocab_size, m.vocab_size);
  same("hidden_size", f.hidden_size, m.hidden_size);
  same("intermediate_size", f.intermediate_size, m.intermediate_size);
  same("num_hidden_layers", f.num_hidden_layers, m.num_hidden_layers);
  same("num_attention_heads", f.num_attention_heads, m.num_attention_heads);
  same("num_key_value_heads", f.num_key_value_heads, m.num_key_value_heads);
  same("head_dim", f.resolved_head_dim(), m.resolved_head_dim());
  same("tie_word_embeddings", f.tie_word_embeddings, m.tie_word_embeddings);
  same("attention_bias", f.attention_bias, m.attention_bias);
  same("rms_norm_eps", f.rms_norm_eps, m.rms_norm_eps);
  same("rope_theta", f.rope_theta, m.rope_theta);
  same("num_experts", file.num_experts, model.num_experts);
  same("num_experts_per_tok", file.num_experts_per_tok, model.num_experts_per_tok);
  same("moe_intermediate_size", file.moe_intermediate_size, model.moe_intermediate_size);
  same("norm_topk_prob", file.norm_topk_prob, model.norm_topk_prob);
  same("decoder_sparse_step", file.decoder_sparse_step, model.decoder_sparse_step);
  same("mlp_only_layers", file.mlp_only_layers, model.mlp_only_layers);
}

// "model.layers.N.<block>.experts.E.<...>" -> E; -1 for any other key.
int64_t expert_of(const std::string& key) {
  const std::string mark = ".experts.";
  const auto at = key.find(mark);
  if (at == std::string::npos) return -1;
  const auto start = at + mark.size(), end = key.find('.', start);
  if (end == std::string::npos || end == start) return -1;
  int64_t e = 0;
  for (size_t i = start; i < end; ++i) {
    if (key[i] < '0' || key[i] > '9') return -1;
    e = e * 10 + (key[i] - '0');
  }
  return e;
}

// Copies into `dst` (a parameter: a shard or whole) its rows of `full`, the whole tensor.
void copy_rows(const at::Tensor& dst, const at::Tensor& full) {
  at::NoGradGuard no_grad;
  if (auto info = fsdp::shard_info(dst)) {
    if (info->local_rows > 0) dst.copy_(full.narrow(info->shard_dim, info->dim0_offset, info->local_rows));
  } else {
    dst.copy_(full);
  }
}

// `dst` (the whole model's, sharded over the world) from `src`, the same parameter of the expert-
// parallel model: the same rows of a parameter sharded alike, or its rows of a whole one.
void copy_dense(const std::string& name, const at::Tensor& dst, const at::Tensor& src) {
  const auto a = fsdp::shard_info(dst), b = fsdp::shard_info(src);
  if (!b) return copy_rows(dst, src);
  if (!a || a->shard_dim != b->shard_dim || a->dim0_offset != b->dim0_offset || a->local_rows != b->local_rows)
    throw HFError("save_moe_hf: '" + name +
                  "' of the expert-parallel model is sharded otherwise than fully_shard over the world shards it; "
                  "shard the dense layers and the root over all ranks (the default mesh), as train_gpt does");
  at::NoGradGuard no_grad;
  dst.copy_(src);
}

// The experts of sparse layer `moe` (the expert-parallel model's) into `whole`'s (every expert, each
// rank its rows): local expert l of every ep rank at a time, gathered whole over its shard group
// (where fully_shard split it) and broadcast over the ep group, so that a rank holds at most
// ep x one expert beyond its shards.
void copy_experts(SparseMoeBlockImpl& moe, SparseMoeBlockImpl& whole, comm::Comm& ep) {
  auto& local = moe.experts->local;
  const int64_t count = static_cast<int64_t>(local.size());
  for (int64_t l = 0; l < count; ++l) {
    const fsdp::checkpoint::StateDict full =
        fsdp::checkpoint::get_model_state_dict(*local[static_cast<size_t>(l)], {.full_state_dict = true});
    for (int r = 0; r < ep.size(); ++r) {
      MoEExpertImpl& target = *whole.experts->local[static_cast<size_t>(r * count + l)];
      for (const auto& [name, value] : full) {
        at::Tensor t = ep.rank() == r ? value.contiguous() : at::empty_like(value, at::MemoryFormat::Contiguous);
        ep.broadcast(t, r);
        copy_rows(target.named_parameters()[name], t);
      }
    }
  }
}

// An expert-parallel model as the whole model (every expert) sharded over the world, for its
// export: dense parameters copied from their shards, experts gathered from their ranks.
MoECausalLM gather_experts(MoECausalLMImpl& model) {
  MoEConfig c = model.config;
  const std::shared_ptr<comm::Comm> ep = c.ep;
  c.ep = nullptr;
  c.local_experts_first = 0;
  c.local_experts_count = 0;
  c.base.device = torch::kMeta;
  MoECausalLM whole(c);
  for (auto& layer : whole->layers()) fsdp::fully_shard(layer);
  fsdp::fully_shard(whole);
  const auto params = model.parameters();
  fsdp::to_empty(*whole, params.empty() ? torch::Device(torch::kCPU) : params.front().device());
  auto live = model.named_parameters();
  for (const auto& p : whole->named_parameters())
    if (expert_of(p.key()) < 0) copy_dense(p.key(), p.value(), live[p.key()]);
  for (size_t i = 0; i < model.layers().size(); ++i)
    if (model.layers()[i]->moe) copy_experts(*model.layers()[i]->moe, *whole->layers()[i]->moe, *ep);
  return whole;
}

}  // namespace

bool is_moe_folder(const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  if (!detail::check_regular_file(path)) return false;
  const std::string arch = hf_architecture(read_text(path));
  return arch == "MixtralForCausalLM" || arch == "Qwen3MoeForCausalLM";
}

MoEConfig read_moe_config(const std::string& dir) {
  const fs::path path = fs::path(dir) / "config.json";
  if (!detail::check_regular_file(path)) {
    const std::string note = detail::interrupted_export_note(dir);
    if (!note.empty()) throw HFError(path.string() + ": missing" + note);
  }
  return MoEConfig::from_file(path.string());
}

void load_moe_weights(MoECausalLMImpl& model, const std::string& dir, const HFLoadOptions& options) {
  const std::string config_path = (fs::path(dir) / "config.json").string();
  const MoEConfig& c = model.config;
  HFModelSpec spec;
  spec.check_config = [&] { check_config(read_moe_config(dir), c, config_path); };
  spec.ignored = [&](const std::string& key) {
    if (key.size() >= 21 && key.compare(key.size() - 21, 21, ".rotary_emb.inv_freq") == 0) return true;
    if (c.base.tie_word_embeddings && key == "lm_head.weight") return true;
    const int64_t e = expert_of(key);  // another process's expert: not read here
    return e >= 0 && (e < c.local_experts_first || e >= c.local_experts_first + c.local_count());
  };
  load_hf_module(model, dir, spec, options);
}

std::vector<std::string> save_moe_hf(MoECausalLMImpl& model, const std::string& dir, const HFSaveOptions& options) {
  const MoEConfig& c = model.config;
  const std::string dtype = options.dtype == at::kBFloat16 ? "bfloat16" : "float32";
  if (c.local_count() != c.num_experts && c.expert_parallel()) {
    MoECausalLM whole = gather_experts(model);
    return save_hf_module(*whole, c.to_json(dtype), dir, options);
  }
  if (c.local_count() != c.num_experts)
    throw HFError("save_moe_hf: this process holds experts [" + std::to_string(c.local_experts_first) + ", " +
                  std::to_string(c.local_experts_first + c.local_count()) + ") of " + std::to_string(c.num_experts) +
                  "; an export needs every expert: build it under expert parallelism (set_expert_parallel), whose "
                  "export gathers them, or with all of them");
  return save_hf_module(model, c.to_json(dtype), dir, options);
}

std::vector<std::string> export_moe_hf_from_checkpoint(const std::string& checkpoint_dir, const std::string& dir,
                                                       const HFSaveOptions& options) {
  const std::string dtype = options.dtype == at::kBFloat16 ? "bfloat16" : "float32";
  auto describe = [&](const std::string& json, const std::string& source) {
    MoEConfig config = MoEConfig::from_json(json, source);
    config.base.device = torch::kMeta;
    MoECausalLM model(config);
    return HFCheckpointModel{model.ptr(), config.to_json(dtype)};
  };
  return export_hf_module_from_checkpoint(checkpoint_dir, dir, describe, options);
}

}  // namespace fsdp::models
