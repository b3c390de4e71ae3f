#pragma once
// Template plumbing of fsdp/tensor_parallel/parallelize.h (register_linear_type,
// register_embedding_type): the registry of module types parallelize_module knows. Not an API.
#include <torch/nn/module.h>

#include <functional>
#include <string>
#include <typeindex>

namespace fsdp::tp {

namespace detail {
enum class ModuleKind { Linear, Embedding };
struct KindInfo {
  ModuleKind kind;
  std::string type_name;
  // The module's current weight / bias fields (what forward computes with; under fully_shard the
  // unsharded parameters, unlike named_parameters()).
  std::function<at::Tensor(torch::nn::Module&)> weight;
  std::function<at::Tensor(torch::nn::Module&)> bias;
};
void register_module_kind(std::type_index type, KindInfo info);
}  // namespace detail

}  // namespace fsdp::tp
