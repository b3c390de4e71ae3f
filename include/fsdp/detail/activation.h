#pragma once
// Template plumbing of fsdp/activation/activation_checkpointing.h. Not an API.
#include <torch/nn/module.h>

#include <memory>
#include <type_traits>
#include <vector>

#include "fsdp/detail/sharding_call.h"

namespace fsdp::activation {

struct CheckpointOptions;

namespace detail {
// The core, on tensors: returns fn(inputs) as autograd outputs of one recompute node.
std::vector<at::Tensor> checkpoint_tensors(const fsdp::detail::TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                           const CheckpointOptions& options);
// The call wrapper of a checkpointed module: also saves and restores the generators of the
// module's parameters' devices.
fsdp::detail::CallWrapper make_wrapper(const CheckpointOptions& options,
                                       const std::shared_ptr<torch::nn::Module>& module);

template <typename M>
std::shared_ptr<torch::nn::Module> shared_module(M& module) {
  if constexpr (std::is_base_of_v<torch::nn::Module, std::decay_t<M>>) {
    return module.shared_from_this();
  } else {
    return module.ptr();  // ModuleHolder
  }
}
}  // namespace detail

}  // namespace fsdp::activation
