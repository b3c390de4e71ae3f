#pragma once
// The architectures train_gpt trains, one ModelSpec each (torchtitan's TrainSpec and its
// parallelize_llama): how the model is configured, built on the meta device, parallelised,
// initialised or loaded, run, recorded in a checkpoint and exported. The trainer (train_gpt.cpp)
// only calls these steps, in this order, and never names a model type:
//
//   const ModelSpec& spec = o.init_from.empty() ? model_spec(o.model)   // the --model value, or
//                                               : spec_for_init_from(o); // DIR/config.json's architectures
//   auto model = spec.make();
//   model->validate(o);                           // its own checks of the options
//   model->read_init_from(o);                     // --init-from DIR: its config sizes o (before the data)
//   model->configure(o);                          // after the data: the configuration of this run
//   model->apply_ep(ep_mesh);                     // --ep-size > 1: the {"dp", "ep"} mesh
//   model->build_meta();                          // on the meta device: no memory
//   model->apply_tp(tp_mesh);                     // --tp-size > 1
//   model->apply_ac(k);                           // --activation-checkpointing: every k-th block
//   units = model->apply_fsdp(shard_options);     // blocks, then the root  (or apply_replicate())
//   fsdp::to_empty(*model->module(), device);     // this rank's shards only
//   model->init_weights();   model->load_weights(o);   // seeded values; --init-from's weights
//   loss = model->loss(model->logits(idx), targets);
//
// The registry is the one place that knows the architectures: which --model name and which
// Hugging Face "architectures" each answers to, what its checkpoints record of the model (a JSON
// configuration under one Stateful entry, opaque to the trainer) and how fsdp-ckpt export-hf writes
// such a checkpoint. Adding an architecture is one file (spec_<name>.cpp, defining a TrainModel
// and its ModelSpec) and its line in spec.cpp's table.
#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/fsdp.h"
#include "options.h"
#include "preflight.h"

namespace train_gpt {

// A model as the resume check compares it: the architecture (its --model name), a sentence for
// messages, and the fields that must match (in order; the first that differs is named).
struct ModelIdentity {
  std::string kind;
  std::string text;
  std::vector<std::pair<std::string, std::string>> fields;
};

// fsdp-ckpt export-hf's choices.
struct HFExportOptions {
  bool bf16 = false;                        // the files' dtype: bf16, else fp32
  std::optional<uint64_t> max_shard_bytes;  // split into files of at most this size (default: 5 GB)
};

// One architecture's model in one run: configured, then built and parallelised once.
class TrainModel {
 public:
  virtual ~TrainModel() = default;

  // ---- configuration (main(), before any work)
  // The architecture's own checks of the options (after options.h validate()): sizes it cannot
  // build, options it has no use for. Throws std::invalid_argument with one line.
  virtual void validate(const Options& o) const {}
  // --init-from DIR: checks the folder and sets o's sizes and vocabulary from its config, before
  // the data is checked against them. Throws std::invalid_argument (one line); the default refuses
  // (this architecture has no pretrained folders).
  virtual void read_init_from(Options& o);
  // The configuration this run builds: what read_init_from read, else the sizing options (called
  // after the data fixed o.vocab_size). Throws std::invalid_argument on a size it cannot build.
  virtual void configure(const Options& o) = 0;
  // Parameters of one block and of the rest, for the memory preflight (preflight.h); from the
  // options (configure() may not have run).
  virtual ParameterCount parameter_count(const Options& o) const = 0;
  // The banner's description, e.g. "GPT 4 layers, dim 128, 4 heads" (report.h adds ", seq T").
  virtual std::string describe(const Options& o) const = 0;
  // The model this run builds, as the resume check compares it (model.h check_resume_model):
  // after configure().
  virtual ModelIdentity identity(const Options& o) const = 0;
  // The model a checkpoint of this architecture records (`json`: what checkpoint_record saved);
  // throws std::invalid_argument (one line naming `source`) when it cannot be read.
  virtual ModelIdentity recorded_identity(const std::string& json, const std::string& source) const = 0;

  // ---- build and parallelise (in this order; every step on the meta device)
  // Expert parallelism over `mesh` ({"dp", "ep"}: --ep-size > 1), before build_meta: this rank
  // builds only its ep rank's experts, and apply_fsdp shards each over mesh["dp"]. The default
  // refuses (an architecture without experts; main() refuses it earlier through ModelSpec::experts).
  virtual void apply_ep(const fsdp::DeviceMesh& mesh);
  virtual void build_meta() = 0;
  virtual std::shared_ptr<torch::nn::Module> module() const = 0;
  // Every parameter of the whole model, "<fqn>" -> shape (after build_meta): the checkpoint's
  // "model." keys and the banner's count. The default: module()'s; under expert parallelism every
  // expert, also those other ranks hold.
  virtual std::map<std::string, std::vector<int64_t>> parameter_shapes() const;
  // The parameters that only some ranks hold (an ep group's experts): the trainer's gradient norm
  // sums them over the world (fsdp::clip_grad_norm_ sums a part over its shard group only). Empty:
  // every parameter is the world's (the default).
  virtual std::vector<at::Tensor> expert_parameters() const { return {}; }
  // Tensor parallel over `tp` (the "tp" dimension of {"dp", "tp"}).
  virtual void apply_tp(const fsdp::DeviceMesh& tp) = 0;
  // Activation checkpointing of every k-th block (k >= 1; 1: every block).
  virtual void apply_ac(int k) = 0;
  // fully_shard the blocks, then the root; returns the units in that order.
  virtual std::vector<fsdp::FSDPModule> apply_fsdp(const fsdp::FullyShardOptions& options) = 0;
  // --parallel replicate (after init_weights: whole parameters on every rank).
  virtual fsdp::ReplicateModule apply_replicate() = 0;
  // After fsdp::to_empty: the seeded initialisation, the same values at any world size.
  virtual void init_weights() = 0;
  // --init-from: each rank reads its rows of the folder's weights. The default refuses.
  virtual void load_weights(const Options& o);

  // ---- the step
  // idx [B, T] -> logits [B, T, vocab] (or this rank's vocabulary slice under TP), through the root's hooks.
  virtual at::Tensor logits(const at::Tensor& idx) = 0;
  // The mean cross-entropy of logits against targets [B, T].
  virtual at::Tensor loss(const at::Tensor& logits, const at::Tensor& targets) const = 0;
  // The last position's logits [B, vocab], whole on every rank, for sampling.
  virtual at::Tensor next_token_logits(const at::Tensor& idx) = 0;
  // Optional per-step figures (called once per optimizer step on every rank, after the step):
  // undefined for none (the default), else a float64 CPU tensor [1 + E] that the trainer sums
  // over the ranks: the router's auxiliary loss summed over this rank's training forwards of the
  // step (each micro-batch's aux / --grad-accum), then the tokens routed to each of E experts
  // summed over the layers (--model moe). Resets the figures for the next step.
  virtual at::Tensor step_stats() { return {}; }

  // ---- checkpoints and export
  // What a checkpoint records of the model (its configuration as JSON text, under the tensor
  // "config_json" of the Stateful entry ModelSpec::record_entry), so that a resume can refuse
  // another model and fsdp-ckpt export-hf finds the architecture.
  virtual std::pair<std::string, std::shared_ptr<fsdp::checkpoint::Stateful>> checkpoint_record(
      const Options& o) const = 0;
  // --export-hf: the trained model as a Hugging Face folder (collective). The default refuses.
  virtual void export_hf(const Options& o);
};

// An architecture the trainer offers.
struct ModelSpec {
  std::string name;     // --model NAME
  std::string summary;  // what --help says of it
  // The Hugging Face config.json "architectures" values it reads (--init-from picks it by them) and
  // records; empty: none (no --init-from, no export).
  std::vector<std::string> hf_architectures;
  // The Stateful entry its checkpoint_record() saves ("extra.<entry>.config_json"); several specs
  // may share one (config.json), told apart by hf_architectures.
  std::string record_entry;
  std::function<std::unique_ptr<TrainModel>()> make;
  // It has experts: --ep-size applies (TrainModel::apply_ep); false: --ep-size > 1 is refused.
  bool experts = false;
  // fsdp-ckpt export-hf: a checkpoint of this architecture as a Hugging Face folder `out` (not
  // collective); returns the files written. Null: the architecture has no Hugging Face form.
  std::function<std::vector<std::string>(const std::string& checkpoint, const std::string& out,
                                         const HFExportOptions& options)>
      export_checkpoint;
};

// The registry (spec.cpp), in --help's order.
const std::vector<ModelSpec>& model_specs();
// The spec registered as `name`; throws std::invalid_argument naming the registered ones.
const ModelSpec& model_spec(const std::string& name);
// --init-from DIR: the spec whose hf_architectures hold DIR/config.json's architecture (checked:
// the folder, config.json a regular file, JSON with one architecture). Throws std::invalid_argument
// (one line: an unknown architecture lists the known ones; a config.json that is no regular file,
// checked by stat before it is opened). A --model given that is not the folder's is refused too.
const ModelSpec& spec_for_init_from(const Options& o);

// What checkpoint `dir` records of its model: the spec that recorded it and the JSON text;
// nullopt when it records none (saved before the record existed). Throws std::invalid_argument
// for a record no spec reads (naming the known architectures), CheckpointError for a damaged one.
struct RecordedModel {
  const ModelSpec* spec = nullptr;
  std::string json;
};
std::optional<RecordedModel> recorded_model(const std::string& dir);

// The architectures' specs, each defined in its own file (spec_gpt.cpp, spec_llama.cpp, spec_moe.cpp).
ModelSpec gpt_spec();
ModelSpec llama_spec();
ModelSpec moe_spec();

}  // namespace train_gpt
