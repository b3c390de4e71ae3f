// --model moe: a mixture-of-experts decoder (models/moe/moe.h: MixtralForCausalLM,
// Qwen3MoeForCausalLM), from scratch (a Mixtral sized by --layers --dim --heads --kv-heads
// --ffn-dim --experts --top-k) or --init-from a Hugging Face folder, exported back with
// --export-hf. The loss trained is the model's: cross-entropy plus router_aux_loss_coef x the
// load-balancing loss of each forward (each micro-batch on each rank, as transformers computes
// it per forward). Each step reports the auxiliary loss and the expert load (step_stats()).
// fully_shard per decoder layer (the experts are ordinary parameters of their layer), then the root.
// --ep-size E: expert parallelism on the {"dp", "ep"} mesh (torchtitan's layout, as
// tests/models/test_moe_ep.cpp's load_ep_fsdp): each rank builds its ep rank's experts only (their
// global names kept), each expert fully_shard over mesh["dp"] (the ranks holding the same experts)
// with its gradient divided by the world size, the layers and the root over all ranks.
#include <iomanip>
#include <sstream>
#include <stdexcept>

#include "model.h"
#include "models/moe/hf_moe.h"
#include "spec.h"

namespace train_gpt {

namespace {

using fsdp::models::MoECausalLM;
using fsdp::models::MoEConfig;

std::string moe_i2s(int64_t v) { return std::to_string(v); }

std::string moe_number(double v) {
  std::ostringstream s;
  s << std::setprecision(12) << v;
  return s.str();
}

// From scratch: a Mixtral of the sizing options (max_position_embeddings = --seq-len, init_seed = --seed).
MoEConfig moe_from_options(const Options& o) {
  MoEConfig c;
  c.base.architecture = "MixtralForCausalLM";
  c.base.vocab_size = o.vocab_size;
  c.base.hidden_size = o.dim;
  c.base.intermediate_size = o.resolved_ffn_dim();  // Mixtral states the experts' width there
  c.base.num_hidden_layers = o.layers;
  c.base.num_attention_heads = o.heads;
  c.base.num_key_value_heads = o.resolved_kv_heads();
  c.base.max_position_embeddings = o.seq_len;
  c.base.init_seed = o.seed;
  c.moe_intermediate_size = o.resolved_ffn_dim();
  c.num_experts = o.experts;
  c.num_experts_per_tok = o.top_k;
  try {
    c.validate();
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("--model moe: ") + e.what());
  }
  return c;
}

// --init-from DIR (a Mixtral or Qwen3-MoE folder): its config.json after checking the weights'
// headers, --seq-len and byte data against it; o's sizes are set from it. Throws std::invalid_argument.
MoEConfig moe_from_folder(Options& o) {
  const std::string& dir = o.init_from;
  MoEConfig c;
  try {
    c = fsdp::models::read_moe_config(dir);
    fsdp::models::check_hf_weights(dir);
  } catch (const std::exception& e) {
    throw std::invalid_argument(std::string("--init-from: ") + e.what());
  }
  if (o.seq_len > c.base.max_position_embeddings)
    throw std::invalid_argument("--seq-len " + moe_i2s(o.seq_len) + " exceeds " + dir +
                                "/config.json's max_position_embeddings " + moe_i2s(c.base.max_position_embeddings) +
                                ": give --seq-len " + moe_i2s(c.base.max_position_embeddings) + " or less");
  if (!o.tokens() && c.base.vocab_size < 256)
    throw std::invalid_argument(dir + "/config.json's vocab_size " + moe_i2s(c.base.vocab_size) +
                                " is smaller than the 256 ids of byte data: train it on --data tokens:PATTERN");
  o.layers = c.base.num_hidden_layers;
  o.dim = c.base.hidden_size;
  o.heads = c.base.num_attention_heads;
  o.kv_heads = c.base.num_key_value_heads;
  o.ffn_dim = c.moe_intermediate_size;
  o.experts = c.num_experts;
  o.top_k = c.num_experts_per_tok;
  o.vocab_size = c.base.vocab_size;
  c.base.init_seed = o.seed;
  return c;
}

// "MoE (MixtralForCausalLM) 2 layers, hidden 32, 4 heads / 2 KV heads, 4 experts top 2 (width 48), vocab 256"
std::string describe_moe(const MoEConfig& c) {
  return "MoE (" + c.base.architecture + ") " + moe_i2s(c.base.num_hidden_layers) + " layers, hidden " +
         moe_i2s(c.base.hidden_size) + ", " + moe_i2s(c.base.num_attention_heads) + " heads / " +
         moe_i2s(c.base.num_key_value_heads) + " KV heads, " + moe_i2s(c.num_experts) + " experts top " +
         moe_i2s(c.num_experts_per_tok) + " (width " + moe_i2s(c.moe_intermediate_size) + "), aux coef " +
         moe_number(c.router_aux_loss_coef) + ", vocab " + moe_i2s(c.base.vocab_size) +
         (c.base.tie_word_embeddings ? ", tied embeddings" : "");
}

// The fields that shape the weights or the function.
ModelIdentity moe_identity(const MoEConfig& c) {
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  std::string dense;
  for (int64_t l : c.mlp_only_layers) dense += (dense.empty() ? "" : ",") + moe_i2s(l);
  return {"moe",
          describe_moe(c),
          {{"architecture", c.base.architecture},
           {"num_hidden_layers", moe_i2s(c.base.num_hidden_layers)},
           {"hidden_size", moe_i2s(c.base.hidden_size)},
           {"num_attention_heads", moe_i2s(c.base.num_attention_heads)},
           {"num_key_value_heads", moe_i2s(c.base.num_key_value_heads)},
           {"head_dim", moe_i2s(c.base.resolved_head_dim())},
           {"intermediate_size", moe_i2s(c.base.intermediate_size)},
           {"moe_intermediate_size", moe_i2s(c.moe_intermediate_size)},
           {"num_experts", moe_i2s(c.num_experts)},
           {"num_experts_per_tok", moe_i2s(c.num_experts_per_tok)},
           {"norm_topk_prob", b(c.norm_topk_prob)},
           {"router_aux_loss_coef", moe_number(c.router_aux_loss_coef)},
           {"decoder_sparse_step", moe_i2s(c.decoder_sparse_step)},
           {"mlp_only_layers", dense},
           {"vocab_size", moe_i2s(c.base.vocab_size)},
           {"tie_word_embeddings", b(c.base.tie_word_embeddings)},
           {"rms_norm_eps", moe_number(c.base.rms_norm_eps)},
           {"rope_theta", moe_number(c.base.rope_theta)}}};
}

class MoETrainModel : public TrainModel {
 public:
  void validate(const Options& o) const override {
    if (o.tp_size > 1)
      throw std::invalid_argument("--tp-size " + moe_i2s(o.tp_size) +
                                  ": --model moe has no tensor-parallel plan; use --tp-size 1 (FSDP over all ranks)");
    if (!o.init_from.empty()) return;
    const int64_t kv = o.resolved_kv_heads();
    if (kv > o.heads || o.heads % kv != 0)
      throw std::invalid_argument("--kv-heads " + moe_i2s(kv) + " does not divide --heads " + moe_i2s(o.heads));
    if ((o.dim / o.heads) % 2 != 0)
      throw std::invalid_argument("--dim / --heads = " + moe_i2s(o.dim / o.heads) +
                                  " is odd: rotary embeddings rotate pairs of dimensions; give an even head size");
    if (o.top_k > o.experts)
      throw std::invalid_argument("--top-k " + moe_i2s(o.top_k) + " exceeds --experts " + moe_i2s(o.experts) +
                                  ": each token goes to top-k distinct experts");
  }
  // A decoder layer: attention, the router, E experts of three projections, two norms; the root:
  // embeddings, the head and model.norm.
  ParameterCount parameter_count(const Options& o) const override {
    const double C = static_cast<double>(o.dim), H = static_cast<double>(o.heads),
                 V = o.vocab_size > 0 ? static_cast<double>(o.vocab_size) : 256,
                 F = static_cast<double>(o.resolved_ffn_dim()), KV = static_cast<double>(o.resolved_kv_heads()),
                 E = static_cast<double>(o.experts);
    return {2 * C * C + 2 * C * (C / H) * KV + E * (3 * C * F + C) + 2 * C, 2 * V * C + C};
  }
  void read_init_from(Options& o) override { config_ = moe_from_folder(o); }
  void configure(const Options& o) override {
    grad_accum_ = o.grad_accum;
    if (!config_) config_ = moe_from_options(o);
    if (config_->num_experts % o.ep_size != 0)
      throw std::invalid_argument(
          "--ep-size " + moe_i2s(o.ep_size) + " does not divide " +
          (o.init_from.empty() ? "--experts " : o.init_from + "/config.json's num_experts ") +
          moe_i2s(config_->num_experts) +
          " (each rank holds experts / ep of every layer); choose an ep size that divides them");
  }
  std::string describe(const Options& o) const override {
    return describe_moe(*config_) + (o.init_from.empty() ? " from scratch" : " from " + o.init_from) +
           (o.ep_size > 1 ? ", expert parallel over " + moe_i2s(o.ep_size) + " ranks (" +
                                moe_i2s(config_->num_experts / o.ep_size) + " experts each)"
                          : "");
  }
  ModelIdentity identity(const Options&) const override { return moe_identity(*config_); }
  ModelIdentity recorded_identity(const std::string& json, const std::string& source) const override {
    return moe_identity(MoEConfig::from_json(json, source + " (recorded config.json)"));
  }

  void apply_ep(const fsdp::DeviceMesh& mesh) override { ep_mesh_ = mesh; }
  void build_meta() override {
    MoEConfig config = *config_;
    config.base.device = torch::kMeta;
    if (ep_mesh_) config.set_expert_parallel(*ep_mesh_);  // this rank's experts, global names
    moe_ = MoECausalLM(config);
  }
  std::shared_ptr<torch::nn::Module> module() const override { return moe_.ptr(); }
  // Under expert parallelism: the whole model's (every expert), from a meta model holding them all.
  std::map<std::string, std::vector<int64_t>> parameter_shapes() const override {
    if (!ep_mesh_) return TrainModel::parameter_shapes();
    MoEConfig config = *config_;
    config.base.device = torch::kMeta;
    std::map<std::string, std::vector<int64_t>> shapes;
    for (const auto& p : MoECausalLM(config)->named_parameters()) shapes[p.key()] = p.value().sizes().vec();
    return shapes;
  }
  std::vector<at::Tensor> expert_parameters() const override {
    std::vector<at::Tensor> out;
    if (!ep_mesh_) return out;
    for (const auto& layer : moe_->model->layers)
      if (layer->moe)
        for (const auto& p : layer->moe->experts->parameters()) out.push_back(p);
    return out;
  }
  void apply_tp(const fsdp::DeviceMesh&) override {
    throw std::invalid_argument("--model moe has no tensor-parallel plan: use --tp-size 1");
  }
  // Every k-th decoder layer's attention, experts and dense MLP, not the whole layer: the router
  // stays outside the checkpointed functions, so its logits keep their graph for the auxiliary
  // loss (a reentrant recompute of the whole layer would leave the first forward's router logits
  // without one, and the router without the auxiliary loss's gradient), and under expert
  // parallelism the recompute runs the local experts only, no all-to-all again.
  void apply_ac(int k) override {
    const std::string prefix = "model.layers.";
    fsdp::activation::apply_activation_checkpointing(*moe_, [k, prefix](const std::string& name, torch::nn::Module& m) {
      const bool heavy = dynamic_cast<fsdp::models::LlamaAttentionImpl*>(&m) ||
                         dynamic_cast<fsdp::models::MoEExpertImpl*>(&m) ||
                         dynamic_cast<fsdp::models::LlamaMLPImpl*>(&m);
      if (!heavy || name.rfind(prefix, 0) != 0) return false;
      const int64_t layer = std::stoll(name.substr(prefix.size()));
      return (layer + 1) % k == 0;
    });
  }
  std::vector<fsdp::FSDPModule> apply_fsdp(const fsdp::FullyShardOptions& options) override {
    std::vector<fsdp::FSDPModule> units;
    fsdp::FullyShardOptions expert_options = options;
    if (ep_mesh_) expert_options.mesh = (*ep_mesh_)["dp"];
    for (auto& layer : moe_->layers()) {
      // Under EP each expert is a unit of its own over "dp", its gradient (already the sum over the
      // ep group's tokens) summed over dp and divided by the world size: the mean over all ranks.
      if (ep_mesh_ && layer->moe)
        for (auto& expert : layer->moe->experts->local) {
          units.push_back(fsdp::fully_shard(expert, expert_options));
          units.back().set_gradient_divide_factor(static_cast<double>(ep_mesh_->size()));
        }
      units.push_back(fsdp::fully_shard(layer, options));
    }
    units.push_back(fsdp::fully_shard(moe_, options));
    return units;
  }
  fsdp::ReplicateModule apply_replicate() override { return fsdp::replicate(moe_); }
  void init_weights() override { moe_->reset_parameters(); }
  void load_weights(const Options& o) override {
    fsdp::models::load_moe_weights(*moe_, o.init_from, {.allow_nonfinite = o.allow_nonfinite_weights});
  }

  at::Tensor logits(const at::Tensor& idx) override { return fsdp::call(moe_, idx); }
  // The model's loss (cross-entropy + router_aux_loss_coef x aux); a training forward (grad
  // mode) also adds its auxiliary loss and expert counts to the step's figures.
  at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const override {
    at::Tensor loss = moe_->loss(logits, targets);
    if (at::GradMode::is_enabled()) accumulate_router_figures();
    return loss;
  }
  at::Tensor next_token_logits(const at::Tensor& idx) override { return fsdp::call(moe_, idx).select(1, -1); }

  // [aux loss summed over this step's training forwards, tokens routed to expert 0..E-1 summed
  // over the sparse layers], then reset.
  at::Tensor step_stats() override {
    at::Tensor out = figures_.defined() ? figures_ : at::zeros({1 + config_->num_experts}, at::kDouble);
    figures_ = at::Tensor();
    return out;
  }

  std::pair<std::string, std::shared_ptr<fsdp::checkpoint::Stateful>> checkpoint_record(const Options&) const override {
    auto record = std::make_shared<fsdp::models::HFConfigState>();
    record->json = moe_->config.to_json("float32");
    return {fsdp::models::kHFConfigEntry, record};
  }
  void export_hf(const Options& o) override {
    fsdp::models::HFSaveOptions save;
    save.dtype = o.export_dtype == "bf16" ? at::kBFloat16 : at::kFloat;
    save.copy_from = o.init_from;
    fsdp::models::save_moe_hf(*moe_, o.export_hf, save);
  }

 private:
  void accumulate_router_figures() const {
    at::NoGradGuard no_grad;
    const int64_t E = config_->num_experts;
    at::Tensor counts = at::zeros({E}, at::kLong);
    for (const auto& layer : moe_->model->layers) {
      if (!layer->moe || !layer->moe->router_logits.defined()) continue;
      const at::Tensor idx =
          std::get<1>(layer->moe->router_logits.to(at::kFloat).topk(config_->num_experts_per_tok, -1));
      counts += at::bincount(idx.reshape({-1}).cpu(), {}, E);
    }
    const at::Tensor aux = moe_->aux_loss().detach().to(at::kDouble).cpu().reshape({1}) / grad_accum_;
    at::Tensor f = at::cat({aux, counts.to(at::kDouble)});
    figures_ = figures_.defined() ? figures_ + f : f;
  }

  std::optional<MoEConfig> config_;
  std::optional<fsdp::DeviceMesh> ep_mesh_;  // --ep-size > 1
  MoECausalLM moe_{nullptr};
  int64_t grad_accum_ = 1;
  mutable at::Tensor figures_;
};

}  // namespace

ModelSpec moe_spec() {
  ModelSpec spec;
  spec.name = "moe";
  spec.summary =
      "a mixture-of-experts decoder (Hugging Face's MixtralForCausalLM, Qwen3MoeForCausalLM), from\n"
      "scratch (a Mixtral: --experts, --top-k, --kv-heads, --ffn-dim) or --init-from a folder; --export-hf";
  spec.hf_architectures = {"MixtralForCausalLM", "Qwen3MoeForCausalLM"};
  spec.record_entry = fsdp::models::kHFConfigEntry;  // config.json, shared with llama
  spec.experts = true;
  spec.make = [] { return std::unique_ptr<TrainModel>(new MoETrainModel()); };
  spec.export_checkpoint = [](const std::string& checkpoint, const std::string& out, const HFExportOptions& o) {
    fsdp::models::HFSaveOptions save;
    save.dtype = o.bf16 ? at::kBFloat16 : at::kFloat;
    if (o.max_shard_bytes) save.max_shard_size = *o.max_shard_bytes;
    return fsdp::models::export_moe_hf_from_checkpoint(checkpoint, out, save);
  };
  return spec;
}

}  // namespace train_gpt
