// --model gpt: the project's byte-level GPT (models/gpt.h), sized by the options, built from scratch.
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "model.h"
#include "models/gpt.h"
#include "models/gpt_tp.h"
#include "spec.h"

namespace train_gpt {

namespace {

using fsdp::models::GPT;

// The checkpoint's "gpt" entry: these options' GPT (after resolve_vocab: o.vocab_size is set).
std::string gpt_config_json(const Options& o) {
  nlohmann::json j = {{"model_type", "gpt"}, {"n_layer", o.layers},        {"n_head", o.heads},
                      {"n_embd", o.dim},     {"vocab_size", o.vocab_size}, {"block_size", o.seq_len}};
  return j.dump();
}

const char* const kGptKeys[] = {"n_layer", "n_head", "n_embd", "vocab_size", "block_size"};

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
  auto f = [&](const char* key) { return std::to_string(j[key].get<int64_t>()); };
  id.text = "GPT " + f("n_layer") + " layers, dim " + f("n_embd") + ", " + f("n_head") + " heads, vocab " +
            f("vocab_size") + ", seq-len " + f("block_size");
  return id;
}

class GptModel : public TrainModel {
 public:
  void validate(const Options& o) const override {
    auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
    for (const auto& name : o.sizing_given)
      if (name == "--kv-heads" || name == "--ffn-dim")
        fail(name + " sizes --model llama or moe only: add --model llama or --model moe");
    if (!o.export_hf.empty())
      fail(
          "--export-hf writes a Hugging Face Llama-family folder; the GPT has no Hugging Face architecture (use "
          "--model llama or --init-from)");
  }
  // A block: attention (4C^2 + 4C) and MLP (8C^2 + 5C), two LayerNorms; the root: token and
  // position embeddings, the head and the final LayerNorm.
  ParameterCount parameter_count(const Options& o) const override {
    const double C = static_cast<double>(o.dim), T = static_cast<double>(o.seq_len),
                 V = o.vocab_size > 0 ? static_cast<double>(o.vocab_size) : 256;
    return {12 * C * C + 13 * C, 2 * V * C + T * C + 2 * C};
  }
  void configure(const Options& o) override {
    config_.vocab_size = o.vocab_size;  // main() resolved it: 256 for bytes, else from the data (data.h)
    config_.block_size = o.seq_len;
    config_.n_layer = o.layers;
    config_.n_head = o.heads;
    config_.n_embd = o.dim;
    config_.init_seed = o.seed;
  }
  std::string describe(const Options& o) const override {
    return "GPT " + std::to_string(o.layers) + " layers, dim " + std::to_string(o.dim) + ", " +
           std::to_string(o.heads) + " heads";
  }
  ModelIdentity identity(const Options& o) const override { return gpt_identity(gpt_config_json(o), "this run"); }
  ModelIdentity recorded_identity(const std::string& json, const std::string& source) const override {
    return gpt_identity(json, source);
  }

  void build_meta() override {
    fsdp::models::GPTConfig config = config_;
    config.device = torch::kMeta;
    config.validate();
    gpt_ = GPT(config);
  }
  std::shared_ptr<torch::nn::Module> module() const override { return gpt_.ptr(); }
  // Heads and MLP split over the tp ranks (models/gpt_tp.h), on meta.
  void apply_tp(const fsdp::DeviceMesh& tp) override { fsdp::models::parallelize_gpt(gpt_, tp); }
  void apply_ac(int k) override {
    fsdp::activation::apply_activation_checkpointing(*gpt_, fsdp::activation::every_kth<fsdp::models::BlockImpl>(k));
  }
  std::vector<fsdp::FSDPModule> apply_fsdp(const fsdp::FullyShardOptions& options) override {
    std::vector<fsdp::FSDPModule> units;
    for (auto& block : gpt_->blocks) units.push_back(fsdp::fully_shard(block, options));  // blocks first,
    units.push_back(fsdp::fully_shard(gpt_, options));                                    // then the root
    return units;
  }
  fsdp::ReplicateModule apply_replicate() override { return fsdp::replicate(gpt_); }
  void init_weights() override { gpt_->reset_parameters(); }

  at::Tensor logits(const at::Tensor& idx) override { return fsdp::call(gpt_, idx); }
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const override {
    return fsdp::models::gpt_loss(logits.to(at::kFloat), targets);
  }
  // A forward method (fsdp/sharding/forward_method.h): gathered, then resharded on return.
  at::Tensor next_token_logits(const at::Tensor& idx) override {
    return fsdp::call_method(gpt_, &fsdp::models::GPTImpl::next_token_logits, idx);
  }

  // The "gpt" entry: {"model_type": "gpt", "n_layer": ..., ...} (model.h ConfigRecord).
  std::pair<std::string, std::shared_ptr<fsdp::checkpoint::Stateful>> checkpoint_record(
      const Options& o) const override {
    return {"gpt", std::make_shared<ConfigRecord>(gpt_config_json(o))};
  }

 private:
  fsdp::models::GPTConfig config_;
  GPT gpt_{nullptr};
};

}  // namespace

ModelSpec gpt_spec() {
  ModelSpec spec;
  spec.name = "gpt";
  spec.summary = "the byte-level GPT of models/gpt.h, from scratch (--layers, --dim, --heads)";
  spec.record_entry = "gpt";  // no Hugging Face architecture: no --init-from, no export
  spec.make = [] { return std::unique_ptr<TrainModel>(new GptModel()); };
  return spec;
}

}  // namespace train_gpt
