#pragma once
// Access to torch::nn::Module's parameter registry, which LibTorch keeps protected.
//
// FSDP2 re-registers each parameter as its sharded form (module._parameters[name] = ...), so that
// module.parameters() feeds the optimizer the shards. The C++ equivalent edits `parameters_`
// through a pointer-to-member formed in a derived class: legal C++, no layout assumptions.
#include <torch/nn/module.h>

#include <string>

namespace fsdp::detail {

torch::OrderedDict<std::string, at::Tensor>& parameter_registry(torch::nn::Module& module);

}  // namespace fsdp::detail
