// --model llama: a Llama-family decoder with Hugging Face's names (models/llama/llama.h), from
// scratch (sized by the options) or from a Hugging Face folder (--init-from), exported back
// with --export-hf. Under --tp-size, torchtitan's plan: sequence parallel and loss_parallel.
#include <iomanip>
#include <sstream>
#include <stdexcept>

#include "model.h"
#include "models/llama/hf.h"
#include "models/llama/llama_tp.h"
#include "spec.h"

namespace train_gpt {

namespace {

using fsdp::models::Llama;
using fsdp::models::LlamaConfig;

// From scratch: the configuration the sizing options describe (max_position_embeddings =
// --seq-len, init_seed = --seed).
LlamaConfig llama_from_options(const Options& o) {
  LlamaConfig c;
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

// --init-from DIR (spec_for_init_from checked the folder and config.json's architecture): its
// config.json, after checking that its weights can be read (headers only), that --seq-len fits
// max_position_embeddings and that byte data fits its vocabulary; then o's sizes are set from it
// (the banner, the memory estimate and the data's check read them). Throws std::invalid_argument.
LlamaConfig llama_from_folder(Options& o) {
  const std::string& dir = o.init_from;
  LlamaConfig c;
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

// "Llama (LlamaForCausalLM) 2 layers, hidden 32, 4 heads / 2 KV heads (head 16), ffn 64, vocab 256"
std::string describe_config(const LlamaConfig& c) {
  auto i = [](int64_t v) { return std::to_string(v); };
  return "Llama (" + c.architecture + ") " + i(c.num_hidden_layers) + " layers, hidden " + i(c.hidden_size) + ", " +
         i(c.num_attention_heads) + " heads / " + i(c.num_key_value_heads) + " KV heads (head " +
         i(c.resolved_head_dim()) + "), ffn " + i(c.intermediate_size) + ", vocab " + i(c.vocab_size) +
         (c.tie_word_embeddings ? ", tied embeddings" : "");
}

std::string number(double v) {
  std::ostringstream s;
  s << std::setprecision(12) << v;
  return s.str();
}

// The fields that shape the weights or the function (max_position_embeddings, torch_dtype and
// the init seed may differ).
ModelIdentity llama_identity(const LlamaConfig& c) {
  auto i = [](int64_t v) { return std::to_string(v); };
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  const std::string rope = c.rope_type != "llama3"
                               ? c.rope_type
                               : "llama3 " + number(c.rope_factor) + "/" + number(c.rope_low_freq_factor) + "/" +
                                     number(c.rope_high_freq_factor) + "/" + i(c.rope_original_max_position_embeddings);
  return {"llama",
          describe_config(c),
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

class LlamaModel : public TrainModel {
 public:
  void validate(const Options& o) const override {
    auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
    if (o.init_from.empty()) {
      const int64_t kv = o.resolved_kv_heads();
      if (kv > o.heads || o.heads % kv != 0)
        fail("--kv-heads " + std::to_string(kv) + " does not divide --heads " + std::to_string(o.heads) +
             " (grouped-query attention: each key/value head serves --heads / --kv-heads query heads)");
      if ((o.dim / o.heads) % 2 != 0)
        fail("--dim / --heads = " + std::to_string(o.dim / o.heads) +
             " is odd: rotary embeddings rotate pairs of dimensions, so --model llama needs an even head size");
    }
    if (o.tp_size > 1 && o.seq_len % o.tp_size != 0)
      fail("--tp-size " + std::to_string(o.tp_size) + " does not divide --seq-len " + std::to_string(o.seq_len) +
           " (--model llama under tensor parallelism splits each sequence over the tp ranks: sequence parallel)");
  }
  // A decoder layer: q and o, k and v (grouped), gate/up/down, two norms; the root: embeddings,
  // the head and model.norm (the sizes from --init-from's config.json once read_init_from ran).
  ParameterCount parameter_count(const Options& o) const override {
    const double C = static_cast<double>(o.dim), H = static_cast<double>(o.heads),
                 V = o.vocab_size > 0 ? static_cast<double>(o.vocab_size) : 256,
                 F = static_cast<double>(o.resolved_ffn_dim()), KV = static_cast<double>(o.resolved_kv_heads());
    return {2 * C * C + 2 * C * (C / H) * KV + 3 * C * F + 2 * C, 2 * V * C + C};
  }
  // config.json's sizes into o, before the data is checked against its vocabulary.
  void read_init_from(Options& o) override { config_ = llama_from_folder(o); }
  void configure(const Options& o) override {
    if (!config_) config_ = llama_from_options(o);  // else --init-from's config.json
  }
  std::string describe(const Options& o) const override {
    return describe_config(*config_) + (o.init_from.empty() ? " from scratch" : " from " + o.init_from);
  }
  ModelIdentity identity(const Options&) const override { return llama_identity(*config_); }
  // LlamaConfigError is a std::invalid_argument: one line, exit status 2.
  ModelIdentity recorded_identity(const std::string& json, const std::string& source) const override {
    return llama_identity(LlamaConfig::from_json(json, source + " (recorded config.json)"));
  }

  void build_meta() override {
    fsdp::models::LlamaConfig config = *config_;
    config.device = torch::kMeta;
    llama_ = Llama(config);
  }
  std::shared_ptr<torch::nn::Module> module() const override { return llama_.ptr(); }
  void apply_tp(const fsdp::DeviceMesh& tp) override {
    fsdp::models::parallelize_llama(llama_, tp);  // sequence parallel and loss_parallel included
    tp_ = tp;
  }
  void apply_ac(int k) override {
    fsdp::activation::apply_activation_checkpointing(
        *llama_, fsdp::activation::every_kth<fsdp::models::LlamaDecoderLayerImpl>(k));
  }
  // Decoder layers, then the root (which keeps the embeddings, model.norm and lm_head: with tied
  // embeddings the head reads model.embed_tokens.weight during the root's forward).
  std::vector<fsdp::FSDPModule> apply_fsdp(const fsdp::FullyShardOptions& options) override {
    std::vector<fsdp::FSDPModule> units;
    for (auto& layer : llama_->layers()) units.push_back(fsdp::fully_shard(layer, options));
    units.push_back(fsdp::fully_shard(llama_, options));
    return units;
  }
  fsdp::ReplicateModule apply_replicate() override { return fsdp::replicate(llama_); }
  void init_weights() override { llama_->reset_parameters(); }
  void load_weights(const Options& o) override {
    fsdp::models::load_hf_weights(*llama_, o.init_from, {.allow_nonfinite = o.allow_nonfinite_weights});
  }

  at::Tensor logits(const at::Tensor& idx) override { return fsdp::call(llama_, idx); }
  // Under TP the logits are split over the vocabulary (loss_parallel).
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const override {
    if (tp_) return fsdp::tp::loss_parallel(logits.to(at::kFloat), targets, *tp_);
    return fsdp::models::gpt_loss(logits.to(at::kFloat), targets);
  }
  at::Tensor next_token_logits(const at::Tensor& idx) override {
    if (!tp_) return fsdp::call(llama_, idx).select(1, -1);
    // Sequence parallel: a length divisible by the tp size (the last positions, or the first token repeated).
    const int64_t tp = tp_->size(0), len = idx.size(1);
    at::Tensor window = len >= tp ? idx.narrow(1, len - len / tp * tp, len / tp * tp)
                                  : at::cat({idx.narrow(1, 0, 1).expand({idx.size(0), tp - len}), idx}, 1);
    at::Tensor local = fsdp::call(llama_, window.contiguous()).select(1, -1).contiguous();
    return fsdp::tp::gather_replicated_along_dim(local, 1, tp_->comm());
  }

  // The "hf" entry: config.json (models/llama/hf.h HFConfigState).
  std::pair<std::string, std::shared_ptr<fsdp::checkpoint::Stateful>> checkpoint_record(const Options&) const override {
    return {fsdp::models::kHFConfigEntry, std::make_shared<fsdp::models::HFConfigState>(llama_->config)};
  }
  void export_hf(const Options& o) override {
    fsdp::models::HFSaveOptions save;
    save.dtype = o.export_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    save.copy_from = o.init_from;
    fsdp::models::save_hf(*llama_, o.export_hf, save);
  }

 private:
  std::optional<LlamaConfig> config_;
  Llama llama_{nullptr};
  std::optional<fsdp::DeviceMesh> tp_;
};

}  // namespace

ModelSpec llama_spec() {
  ModelSpec spec;
  spec.name = "llama";
  spec.summary =
      "a Llama-family decoder (Hugging Face's names: LlamaForCausalLM, Mistral, Qwen2), from\n"
      "scratch (--kv-heads, --ffn-dim) or --init-from a Hugging Face folder; --export-hf";
  spec.hf_architectures = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"};
  spec.record_entry = fsdp::models::kHFConfigEntry;  // config.json
  spec.make = [] { return std::unique_ptr<TrainModel>(new LlamaModel()); };
  spec.export_checkpoint = [](const std::string& checkpoint, const std::string& out, const HFExportOptions& o) {
    fsdp::models::HFSaveOptions save;
    save.dtype = o.bf16 ? at::kBFloat16 : at::kFloat;
    if (o.max_shard_bytes) save.max_shard_size = *o.max_shard_bytes;
    return fsdp::models::export_hf_from_checkpoint(checkpoint, out, save);
  };
  return spec;
}

}  // namespace train_gpt
