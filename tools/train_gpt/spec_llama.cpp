// --model llama: a Llama-family decoder with Hugging Face's names (models/llama/llama.h), from
// scratch (sized by the options) or from a Hugging Face folder (--init-from), exported back
// with --export-hf. Under --tp-size, torchtitan's plan: sequence parallel and loss_parallel.
#include <stdexcept>

#include "model.h"
#include "models/llama/hf.h"
#include "models/llama/llama_tp.h"
#include "spec.h"

namespace train_gpt {

namespace {

using fsdp::models::Llama;

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
  // config.json's sizes into o (model.h resolve_model), before the data is checked against its vocabulary.
  void read_init_from(Options& o) override { config_ = resolve_model(o); }
  void configure(const Options& o) override {
    if (config_) return;  // --init-from's config.json
    Options sized = o;
    config_ = resolve_model(sized);  // from scratch: the sizing options
  }
  std::string describe(const Options& o) const override {
    return train_gpt::describe(*config_) + (o.init_from.empty() ? " from scratch" : " from " + o.init_from);
  }
  void check_resume(const std::string& dir, const Options& o) const override { check_resume_model(dir, o, config_); }

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
  std::optional<fsdp::models::LlamaConfig> config_;
  Llama llama_{nullptr};
  std::optional<fsdp::DeviceMesh> tp_;
};

}  // namespace

ModelSpec llama_spec() {
  return {"llama",
          "a Llama-family decoder (Hugging Face's names: LlamaForCausalLM, Mistral, Qwen2), from\n"
          "scratch (--kv-heads, --ffn-dim) or --init-from a Hugging Face folder; --export-hf",
          [] { return std::unique_ptr<TrainModel>(new LlamaModel()); }};
}

}  // namespace train_gpt
