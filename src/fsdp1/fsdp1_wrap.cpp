// FSDP1's auto-wrap policies and their bottom-up application (PyTorch's _recursive_wrap in
// torch/distributed/fsdp/wrap.py): a module's children are visited first, and a module is asked
// whether it becomes a unit with the count of its parameters that no unit below it took.
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/fsdp1/fsdp1.h"

namespace fsdp {

namespace {

bool is_any(const std::vector<ModuleType>& types, const torch::nn::Module& m) {
  return std::any_of(types.begin(), types.end(), [&](const ModuleType& t) { return t(m); });
}

// Distinct parameters of `module` (tied weights once), as module.parameters() in Python.
int64_t numel_of(torch::nn::Module& module, const std::unordered_set<const c10::TensorImpl*>& ignored) {
  std::unordered_set<const c10::TensorImpl*> seen;
  int64_t n = 0;
  for (const auto& p : module.parameters()) {
    if (ignored.count(p.unsafeGetTensorImpl()) || !seen.insert(p.unsafeGetTensorImpl()).second) continue;
    n += p.numel();
  }
  return n;
}

struct Walk {
  const AutoWrapPolicy& policy;
  const std::function<void(const std::shared_ptr<torch::nn::Module>&)>& wrap;
  std::unordered_set<const torch::nn::Module*> ignored_modules;
  std::unordered_set<const c10::TensorImpl*> ignored_params;

  // Returns the parameters wrapped at or below `module` (_recursive_wrap's second result).
  int64_t visit(const std::shared_ptr<torch::nn::Module>& module, bool only_wrap_children) {
    const int64_t nonwrapped = numel_of(*module, ignored_params);
    if (!policy(*module, /*recurse=*/true, nonwrapped)) return 0;
    int64_t wrapped = 0;
    for (const auto& child : module->children()) {
      if (ignored_modules.count(child.get())) continue;
      wrapped += visit(child, /*only_wrap_children=*/false);
    }
    if (!only_wrap_children && policy(*module, /*recurse=*/false, nonwrapped - wrapped)) {
      wrap(module);
      return nonwrapped;
    }
    return wrapped;
  }
};

}  // namespace

bool ModuleWrapPolicy::operator()(torch::nn::Module& module, bool recurse, int64_t) const {
  return recurse || is_any(classes_, module);
}

AutoWrapPolicy transformer_auto_wrap_policy(std::vector<ModuleType> transformer_layer_cls) {
  if (transformer_layer_cls.empty()) {
    throw std::invalid_argument(
        "fsdp::transformer_auto_wrap_policy: no layer types; pass e.g. {fsdp::module_type<BlockImpl>()}");
  }
  return ModuleWrapPolicy(std::move(transformer_layer_cls));
}

AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params, std::vector<ModuleType> force_leaf_modules,
                                           std::optional<std::vector<ModuleType>> exclude_wrap_modules) {
  if (min_num_params < 0) {
    throw std::invalid_argument("fsdp::size_based_auto_wrap_policy: min_num_params is " +
                                std::to_string(min_num_params) + "; pass a count >= 0");
  }
  // PyTorch's defaults: containers are never units (a bare ModuleList has no forward to hook).
  // (Its default leaf, nn.MultiheadAttention, has no counterpart among LibTorch's modules here.)
  std::vector<ModuleType> exclude = exclude_wrap_modules.value_or(
      std::vector<ModuleType>{module_type<torch::nn::ModuleListImpl>(), module_type<torch::nn::ModuleDictImpl>()});
  return [min_num_params, leaves = std::move(force_leaf_modules), exclude = std::move(exclude)](
             torch::nn::Module& module, bool recurse, int64_t nonwrapped_numel) {
    const bool is_large = nonwrapped_numel >= min_num_params;
    if (recurse) return is_large && !is_any(leaves, module);
    return is_large && !is_any(exclude, module);
  };
}

AutoWrapPolicy lambda_auto_wrap_policy(std::function<bool(torch::nn::Module&)> lambda_fn) {
  if (!lambda_fn) throw std::invalid_argument("fsdp::lambda_auto_wrap_policy: an empty function; pass a predicate");
  return
      [fn = std::move(lambda_fn)](torch::nn::Module& module, bool recurse, int64_t) { return recurse || fn(module); };
}

void apply_auto_wrap_policy(torch::nn::Module& root, const AutoWrapPolicy& policy,
                            const std::function<void(const std::shared_ptr<torch::nn::Module>&)>& wrap,
                            const std::vector<std::shared_ptr<torch::nn::Module>>& ignored) {
  if (!policy) return;
  Walk walk{policy, wrap, {}, {}};
  for (const auto& m : ignored) {
    walk.ignored_modules.insert(m.get());
    for (const auto& p : m->parameters()) walk.ignored_params.insert(p.unsafeGetTensorImpl());
  }
  // The root itself is never asked (FSDP wraps it anyway): only its children.
  const int64_t nonwrapped = numel_of(root, walk.ignored_params);
  if (!policy(root, /*recurse=*/true, nonwrapped)) return;
  for (const auto& child : root.children()) {
    if (!walk.ignored_modules.count(child.get())) walk.visit(child, /*only_wrap_children=*/false);
  }
}

}  // namespace fsdp
