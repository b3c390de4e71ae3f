#pragma once
// LibTorch's optimizer state map changed its key type:
//  - 1.13: std::string, the TensorImpl pointer printed by c10::guts::to_string ("0x55d0...").
//  - 2.x : void*, the TensorImpl pointer itself.
// optimizer_state_key(p) gives the key under which the optimizer keeps p's state either way.
// The optimizer state and options classes (Adam, AdamW, SGD, Adagrad, RMSprop: fields and types)
// are the same in 1.13 and 2.x (checked against 2.14's headers), so the checkpoint codecs of
// fsdp/checkpoint/optimizer_state.h need nothing here; a future difference goes here.
#include <torch/optim/optimizer.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace fsdp::compat {

using OptimizerStateMap =
    std::remove_cv_t<std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>>;
using OptimizerStateKey = typename OptimizerStateMap::key_type;

namespace detail {
template <typename Key>
Key optimizer_state_key(c10::TensorImpl* impl) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;  // exactly what c10::guts::to_string does
    key << impl;
    return key.str();
  } else {
    return impl;
  }
}
}  // namespace detail

inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
  return detail::optimizer_state_key<OptimizerStateKey>(param.unsafeGetTensorImpl());
}

}  // namespace fsdp::compat
