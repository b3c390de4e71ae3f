// Optimizer state in checkpoints and state dicts: the codec registry (built-in LibTorch optimizers
// plus registered ones) and the items save and load walk (see fsdp/checkpoint/optimizer_state.h
// for the keys).
#include "fsdp/checkpoint/optimizer_state.h"

#include <c10/util/Type.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <unordered_set>

#include "fsdp/compat/optim.h"
#include "fsdp/optim/fused.h"
#include "state_items.h"

namespace fsdp::checkpoint {

namespace {

using torch::optim::OptimizerOptions;
using torch::optim::OptimizerParamState;

template <typename Opt, typename State, typename Options>
OptimizerCodec adam_like(const char* name) {
  return OptimizerCodecBuilder<Opt, State, Options>(name)
      .state("exp_avg", [](State& s) -> at::Tensor& { return s.exp_avg(); })
      .state("exp_avg_sq", [](State& s) -> at::Tensor& { return s.exp_avg_sq(); })
      .state("max_exp_avg_sq", [](State& s) -> at::Tensor& { return s.max_exp_avg_sq(); })
      .state("step", [](State& s) -> int64_t& { return s.step(); })
      .hyperparameter("lr", [](Options& o) -> double& { return o.lr(); })
      .hyperparameter("betas", [](Options& o) -> std::tuple<double, double>& { return o.betas(); })
      .hyperparameter("eps", [](Options& o) -> double& { return o.eps(); })
      .hyperparameter("weight_decay", [](Options& o) -> double& { return o.weight_decay(); })
      .hyperparameter("amsgrad", [](Options& o) -> bool& { return o.amsgrad(); })
      .build();
}

template <typename Opt>
OptimizerCodec sgd_like(const char* name) {
  namespace o = torch::optim;
  return OptimizerCodecBuilder<Opt, o::SGDParamState, o::SGDOptions>(name)
      .state("momentum_buffer", [](o::SGDParamState& s) -> at::Tensor& { return s.momentum_buffer(); })
      .hyperparameter("lr", [](o::SGDOptions& x) -> double& { return x.lr(); })
      .hyperparameter("momentum", [](o::SGDOptions& x) -> double& { return x.momentum(); })
      .hyperparameter("dampening", [](o::SGDOptions& x) -> double& { return x.dampening(); })
      .hyperparameter("weight_decay", [](o::SGDOptions& x) -> double& { return x.weight_decay(); })
      .hyperparameter("nesterov", [](o::SGDOptions& x) -> bool& { return x.nesterov(); })
      .build();
}

std::vector<OptimizerCodec> builtin_codecs() {
  namespace o = torch::optim;
  std::vector<OptimizerCodec> codecs;
  codecs.push_back(adam_like<o::Adam, o::AdamParamState, o::AdamOptions>("Adam"));
  codecs.push_back(adam_like<o::AdamW, o::AdamWParamState, o::AdamWOptions>("AdamW"));
  codecs.push_back(sgd_like<o::SGD>("SGD"));
  // fsdp::optim's fused optimizers keep their base's state and options classes: the same keys, so a
  // checkpoint of torch::optim::AdamW loads into FusedAdamW and back (the name is only in messages).
  codecs.push_back(adam_like<fsdp::optim::FusedAdam, o::AdamParamState, o::AdamOptions>("FusedAdam"));
  codecs.push_back(adam_like<fsdp::optim::FusedAdamW, o::AdamWParamState, o::AdamWOptions>("FusedAdamW"));
  codecs.push_back(sgd_like<fsdp::optim::FusedSGD>("FusedSGD"));
  codecs.push_back(OptimizerCodecBuilder<o::Adagrad, o::AdagradParamState, o::AdagradOptions>("Adagrad")
                       .state("sum", [](o::AdagradParamState& s) -> at::Tensor& { return s.sum(); })
                       .state("step", [](o::AdagradParamState& s) -> int64_t& { return s.step(); })
                       .hyperparameter("lr", [](o::AdagradOptions& x) -> double& { return x.lr(); })
                       .hyperparameter("lr_decay", [](o::AdagradOptions& x) -> double& { return x.lr_decay(); })
                       .hyperparameter("weight_decay", [](o::AdagradOptions& x) -> double& { return x.weight_decay(); })
                       .hyperparameter("initial_accumulator_value",
                                       [](o::AdagradOptions& x) -> double& { return x.initial_accumulator_value(); })
                       .hyperparameter("eps", [](o::AdagradOptions& x) -> double& { return x.eps(); })
                       .build());
  codecs.push_back(
      OptimizerCodecBuilder<o::RMSprop, o::RMSpropParamState, o::RMSpropOptions>("RMSprop")
          .state("square_avg", [](o::RMSpropParamState& s) -> at::Tensor& { return s.square_avg(); })
          .state("momentum_buffer", [](o::RMSpropParamState& s) -> at::Tensor& { return s.momentum_buffer(); })
          .state("grad_avg", [](o::RMSpropParamState& s) -> at::Tensor& { return s.grad_avg(); })
          .state("step", [](o::RMSpropParamState& s) -> int64_t& { return s.step(); })
          .hyperparameter("lr", [](o::RMSpropOptions& x) -> double& { return x.lr(); })
          .hyperparameter("alpha", [](o::RMSpropOptions& x) -> double& { return x.alpha(); })
          .hyperparameter("eps", [](o::RMSpropOptions& x) -> double& { return x.eps(); })
          .hyperparameter("weight_decay", [](o::RMSpropOptions& x) -> double& { return x.weight_decay(); })
          .hyperparameter("momentum", [](o::RMSpropOptions& x) -> double& { return x.momentum(); })
          .hyperparameter("centered", [](o::RMSpropOptions& x) -> bool& { return x.centered(); })
          .build());
  return codecs;
}

struct Registry {
  std::mutex mu;
  // Codecs live until the process ends (deque-like stability: never erased, replaced in place by
  // a pointer swap), so a pointer handed out stays valid.
  std::vector<std::shared_ptr<const OptimizerCodec>> codecs;
  Registry() {
    for (auto& c : builtin_codecs()) codecs.push_back(std::make_shared<const OptimizerCodec>(std::move(c)));
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

// Every codec's field and hyperparameter names, with the codecs that have them (for telling a
// checkpoint of another optimizer apart).
std::map<std::string, std::string> all_names(bool fields) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::map<std::string, std::string> out;
  for (const auto& c : r.codecs) {
    std::vector<std::string> names;
    if (fields)
      for (const auto& f : c->fields) names.push_back(f.name);
    else
      for (const auto& h : c->hyperparameters) names.push_back(h.name);
    for (const auto& n : names) out[n] += (out[n].empty() ? "" : "/") + c->name;
  }
  return out;
}

std::string group_prefix(size_t g) { return "optim.param_groups." + std::to_string(g) + "."; }

// `owners`: the codecs' names joined by '/' (all_names).
[[noreturn]] void saved_by_another(const std::string& key, const std::string& owners, const OptimizerCodec& codec) {
  OptimizerMismatch mismatch{{}, codec.name};
  for (size_t at = 0; at <= owners.size();) {
    const size_t slash = std::min(owners.find('/', at), owners.size());
    if (slash > at) mismatch.saved_by.push_back(owners.substr(at, slash - at));
    at = slash + 1;
  }
  throw CheckpointError("checkpoint: the optimizer state was saved by " + owners + " (it has '" + key +
                            "'), but the optimizer given is " + codec.name +
                            "; build the optimizer it was saved with, or load without the optimizer "
                            "(LoadOptions::load_optimizer = false, or leave it out of the state dict call)",
                        std::move(mismatch));
}

}  // namespace

void register_optimizer(OptimizerCodec codec) {
  if (codec.type == typeid(void) || !codec.make_state)
    throw std::invalid_argument("fsdp::checkpoint::register_optimizer: codec '" + codec.name +
                                "' has no optimizer type or make_state; build it with OptimizerCodecBuilder");
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto entry = std::make_shared<const OptimizerCodec>(std::move(codec));
  for (auto& c : r.codecs) {
    if (c->type == entry->type) {
      c = entry;  // the old codec stays alive for whoever still holds it
      return;
    }
  }
  r.codecs.push_back(std::move(entry));
}

const OptimizerCodec* find_optimizer_codec(const torch::optim::Optimizer& optimizer) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const std::type_index type = typeid(optimizer);
  for (const auto& c : r.codecs)
    if (c->type == type) return c.get();
  return nullptr;
}

const OptimizerCodec& optimizer_codec(const torch::optim::Optimizer& optimizer) {
  if (const auto* codec = find_optimizer_codec(optimizer)) return *codec;
  if (dynamic_cast<const torch::optim::LBFGS*>(&optimizer))
    throw CheckpointError(
        "checkpoint: LBFGS's state cannot be sharded: it keeps its history (d, prev_flat_grad, old_dirs, old_stps) "
        "as flat vectors over all its parameters concatenated, which on each rank are different shards, and its "
        "line search needs the loss over all ranks; use another optimizer with fully_shard, or leave "
        "State::optimizer unset and keep LBFGS's state per rank yourself");
  throw CheckpointError("checkpoint: optimizer type '" + c10::demangle(typeid(optimizer).name()) +
                        "' has no registered state codec (built in: Adam, AdamW, SGD, Adagrad, RMSprop and "
                        "fsdp::optim's FusedAdam, FusedAdamW, FusedSGD); register "
                        "one with fsdp::checkpoint::register_optimizer (see fsdp/checkpoint/optimizer_state.h), or "
                        "leave State::optimizer unset and save its state yourself");
}

namespace detail {

namespace {

std::unordered_set<const void*> optimizer_params(const torch::optim::Optimizer& optimizer) {
  std::unordered_set<const void*> params;
  for (const auto& group : optimizer.param_groups())
    for (const auto& p : group.params()) params.insert(p.unsafeGetTensorImpl());
  return params;
}

}  // namespace

std::vector<LocalItem> optimizer_save_items(torch::optim::Optimizer& optimizer, torch::nn::Module& model,
                                            int global_rank) {
  const OptimizerCodec& codec = optimizer_codec(optimizer);
  std::vector<LocalItem> items;
  const auto in_optimizer = optimizer_params(optimizer);
  for (const auto& entry : model.named_parameters(/*recurse=*/true)) {
    const at::Tensor& p = entry.value();
    if (!in_optimizer.count(p.unsafeGetTensorImpl())) continue;
    auto found = optimizer.state().find(compat::optimizer_state_key(p));
    if (found == optimizer.state().end()) continue;  // never stepped (e.g. frozen): no state
    const std::string prefix = "optim." + entry.key() + ".";
    for (const auto& field : codec.fields) {
      at::Tensor value = field.get(*found->second);
      if (!value.defined()) continue;
      items.push_back(field.like_param ? like_param(prefix + field.name, p, value, global_rank)
                                       : whole(prefix + field.name, value, global_rank));
    }
  }
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g)
    for (const auto& h : codec.hyperparameters)
      items.push_back(whole(group_prefix(g) + h.name, h.get(groups[g].options()), global_rank));
  return items;
}

std::vector<LocalItem> optimizer_load_items(torch::optim::Optimizer& optimizer, torch::nn::Module& model,
                                            const std::function<bool(const std::string&)>& has_key) {
  const OptimizerCodec& codec = optimizer_codec(optimizer);
  std::set<std::string> own_fields, own_hypers;
  for (const auto& f : codec.fields) own_fields.insert(f.name);
  for (const auto& h : codec.hyperparameters) own_hypers.insert(h.name);
  const auto every_field = all_names(/*fields=*/true), every_hyper = all_names(/*fields=*/false);

  // Every check first: a refused load leaves the optimizer as it was (no half-made state).
  const auto in_optimizer = optimizer_params(optimizer);
  std::vector<std::pair<std::string, at::Tensor>> params;  // (fqn, parameter) in the optimizer
  for (const auto& entry : model.named_parameters(/*recurse=*/true))
    if (in_optimizer.count(entry.value().unsafeGetTensorImpl())) params.emplace_back(entry.key(), entry.value());
  for (const auto& [fqn, p] : params)
    for (const auto& [name, owners] : every_field)
      if (!own_fields.count(name) && has_key("optim." + fqn + "." + name))
        saved_by_another("optim." + fqn + "." + name, owners, codec);
  auto& groups = optimizer.param_groups();
  for (const auto& [name, owners] : every_hyper)
    if (!own_hypers.count(name) && has_key(group_prefix(0) + name))
      saved_by_another(group_prefix(0) + name, owners, codec);
  // Hyperparameters: all or nothing per checkpoint (older checkpoints have none).
  bool with_hyperparameters = false;
  for (const auto& h : codec.hyperparameters)
    with_hyperparameters = with_hyperparameters || has_key(group_prefix(0) + h.name);
  if (with_hyperparameters) {
    const std::string first = codec.hyperparameters.front().name;
    size_t saved_groups = 0;
    while (has_key(group_prefix(saved_groups) + first)) ++saved_groups;
    if (saved_groups != groups.size())
      throw CheckpointError("checkpoint: the optimizer state has " + std::to_string(saved_groups) +
                            " param group(s) but the optimizer given has " + std::to_string(groups.size()) +
                            "; build its param groups as when it was saved");
    for (size_t g = 0; g < groups.size(); ++g)
      for (const auto& h : codec.hyperparameters)
        if (!has_key(group_prefix(g) + h.name))
          throw CheckpointError("checkpoint: the optimizer state has no '" + group_prefix(g) + h.name +
                                    "' (saved by another optimizer than " + codec.name +
                                    "?); build the optimizer it was saved with",
                                OptimizerMismatch{{}, codec.name});
  }

  std::vector<LocalItem> items;
  for (const auto& [fqn, p] : params) {
    const std::string prefix = "optim." + fqn + ".";
    std::vector<const OptimizerCodec::Field*> present;
    for (const auto& f : codec.fields)
      if (has_key(prefix + f.name)) present.push_back(&f);
    if (present.empty()) continue;  // no state saved for it (never stepped, or frozen)
    auto& slot = optimizer.state()[compat::optimizer_state_key(p)];
    if (!slot) slot = codec.make_state();
    OptimizerParamState* state = slot.get();
    for (const auto* f : present) {
      at::Tensor value = f->like_param ? at::zeros_like(p, at::MemoryFormat::Contiguous)
                                       : at::scalar_tensor(0, at::TensorOptions().dtype(f->scalar_type));
      LocalItem item = f->like_param ? like_param(prefix + f->name, p, value, -1) : whole(prefix + f->name, value, -1);
      item.on_loaded = [state, set = f->set, value] { set(*state, value); };
      items.push_back(std::move(item));
    }
  }
  if (!with_hyperparameters) return items;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (const auto& h : codec.hyperparameters) {
      at::Tensor value = at::zeros({h.size}, at::kDouble);
      LocalItem item = whole(group_prefix(g) + h.name, value, -1);
      OptimizerOptions* options = &groups[g].options();
      item.on_loaded = [options, set = h.set, value] { set(*options, value); };
      items.push_back(std::move(item));
    }
  }
  return items;
}

std::vector<std::string> optimizer_candidate_keys(torch::optim::Optimizer& optimizer, torch::nn::Module& model) {
  std::vector<std::string> keys;
  const auto every_field = all_names(true), every_hyper = all_names(false);
  const auto in_optimizer = optimizer_params(optimizer);
  for (const auto& entry : model.named_parameters(/*recurse=*/true)) {
    if (!in_optimizer.count(entry.value().unsafeGetTensorImpl())) continue;
    for (const auto& [name, owners] : every_field) keys.push_back("optim." + entry.key() + "." + name);
  }
  for (size_t g = 0; g <= optimizer.param_groups().size(); ++g)  // one more: a checkpoint with more groups
    for (const auto& [name, owners] : every_hyper) keys.push_back(group_prefix(g) + name);
  return keys;
}

}  // namespace detail

}  // namespace fsdp::checkpoint
