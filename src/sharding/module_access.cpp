#include "module_access.h"

namespace fsdp::detail {

namespace {
struct RegistryAccess : torch::nn::Module {
  static constexpr auto parameters_member() { return &RegistryAccess::parameters_; }
};
}  // namespace

torch::OrderedDict<std::string, at::Tensor>& parameter_registry(torch::nn::Module& module) {
  return module.*RegistryAccess::parameters_member();
}

}  // namespace fsdp::detail
