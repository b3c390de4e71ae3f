// StateDictOptions' entry selection, and get_state_dict / set_state_dict (model + optimizer).
#include "state_dict_selection.h"

#include <map>
#include <optional>

namespace fsdp::checkpoint {

namespace detail {

namespace {

bool starts_with(const std::string& s, const std::string& prefix) { return s.rfind(prefix, 0) == 0; }

}  // namespace

ModelSelection select_model_items(std::vector<LocalItem> items, torch::nn::Module& model,
                                  const StateDictOptions& options) {
  ModelSelection out;
  if (!options.ignore_frozen_params && options.submodules.empty()) {
    out.items = std::move(items);
    return out;
  }
  std::set<std::string> frozen;
  if (options.ignore_frozen_params)
    for (const auto& p : model.named_parameters(/*recurse=*/true))
      if (!p.value().requires_grad()) frozen.insert(p.key());
  std::set<std::string> modules;
  for (const auto& m : model.named_modules(/*name_prefix=*/"", /*include_self=*/false)) modules.insert(m.key());
  for (const auto& name : options.submodules) {
    if (!modules.count(name)) {
      std::vector<std::string> names(modules.begin(), modules.end());
      throw CheckpointError("StateDictOptions::submodules: '" + name + "' is not a submodule of the model (" +
                            (names.empty() ? std::string("it has none") : "its submodules: " + key_list(names)) +
                            "); use the names of model.named_modules()");
    }
  }
  std::map<std::string, std::string> renamed_from;  // new name -> fqn, to catch collisions
  for (auto& item : items) {
    const std::string fqn = item.key.substr(std::string("model.").size());
    if (frozen.count(fqn)) {
      out.ignored.insert(fqn);
      continue;
    }
    std::optional<std::string> name;
    if (options.submodules.empty()) {
      name = fqn;
    } else {
      for (const auto& sub : options.submodules) {
        if (!starts_with(fqn, sub + ".")) continue;
        const std::string candidate = options.keep_submodule_prefixes ? fqn : fqn.substr(sub.size() + 1);
        if (!name || candidate.size() < name->size()) name = candidate;  // the innermost submodule
      }
    }
    if (!name) continue;
    auto [it, fresh] = renamed_from.emplace(*name, fqn);
    if (!fresh)
      throw CheckpointError(
          "StateDictOptions: '" + it->second + "' and '" + fqn + "' both become '" + *name +
          "' without submodule prefixes; select one of the submodules at a time, or keep the prefixes");
    item.key = "model." + *name;
    out.items.push_back(std::move(item));
  }
  return out;
}

}  // namespace detail

ModelOptimizerStateDict get_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                       const StateDictOptions& options) {
  ModelOptimizerStateDict out;
  out.model = get_model_state_dict(model, options);
  out.optimizer = get_optimizer_state_dict(model, optimizer, options);
  return out;
}

LoadResult set_state_dict(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                          const ModelOptimizerStateDict& state_dict, const StateDictOptions& options) {
  LoadResult result = set_model_state_dict(model, state_dict.model, options);
  LoadResult optim = set_optimizer_state_dict(model, optimizer, state_dict.optimizer, options);
  for (auto& k : optim.missing_keys) result.missing_keys.push_back("optim." + k);
  for (auto& k : optim.unexpected_keys) result.unexpected_keys.push_back("optim." + k);
  return result;
}

}  // namespace fsdp::checkpoint
