#pragma once
// Making an autograd node of our own (a torch::autograd::Node subclass) that an Edge can point to.
//  - 1.13 and most of 2.x: nodes are owned by std::shared_ptr; an Edge is made from a
//    std::shared_ptr<Node>.
//  - Newer LibTorch (Debian sid's 2.14): nodes are owned by c10::intrusive_ptr (the count lives in
//    the node); an Edge is made from a c10::intrusive_ptr<Node>.
// Detected by feature, not version: whether an Edge can be made from a std::shared_ptr of the
// node. Either way the node and its count are one allocation.
//
// Example:
//   auto node = fsdp::compat::make_autograd_node<MyNode>(args...);
//   torch::autograd::impl::set_gradient_edge(out, {node, node->add_input_metadata(out)});
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

namespace fsdp::compat {

template <typename T, typename... Args>
auto make_autograd_node(Args&&... args) {
  if constexpr (std::is_constructible_v<torch::autograd::Edge, std::shared_ptr<T>, uint32_t>) {
    return std::make_shared<T>(std::forward<Args>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

}  // namespace fsdp::compat
