#pragma once
// Making an autograd node of our own (a torch::autograd::Node subclass) that an Edge can point to.
//  - 1.13 and most of 2.x: nodes are owned by std::shared_ptr; an Edge is made from a
//    std::shared_ptr<Node>.
//  - Newer LibTorch (Debian sid's 2.14): nodes are owned by c10::intrusive_ptr (the count lives in
//    the node); an Edge is made from a c10::intrusive_ptr<Node>.
// Detected by feature, not version: whether an Edge can be made from a std::shared_ptr of the
// node. Either way the node and its count are one allocation. A node class that recycles its
// memory gets it used in both forms: its allocator_type (std::allocate_shared's, for the one block
// of node and count) and its class operator new/delete (c10::make_intrusive's `new T` and the
// count's `delete`).
//
// add_output_pre_hook: a hook run before a node's backward, in registration order with the hooks
// users put on the node's output tensors (Tensor::register_hook), as FSDP2's tensor hooks on a
// module's outputs run.
//  - 1.13: a tensor's hooks are the node's pre-hooks (add_pre_hook): one list.
//  - 2.x: a tensor's hooks are the node's tensor pre-hooks (add_tensor_pre_hook), all run before
//    its add_pre_hook ones; a hook added with add_pre_hook would run after every user tensor hook.
//
// Example:
//   auto node = fsdp::compat::make_autograd_node<MyNode>(args...);
//   torch::autograd::impl::set_gradient_edge(out, {node, node->add_input_metadata(out)});
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>

#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

namespace fsdp::compat {

template <typename T, typename... Args>
auto make_autograd_node(Args&&... args) {
  if constexpr (std::is_constructible_v<torch::autograd::Edge, std::shared_ptr<T>, uint32_t>) {
    if constexpr (requires { typename T::allocator_type; }) {
      return std::allocate_shared<T>(typename T::allocator_type{}, std::forward<Args>(args)...);
    } else {
      return std::make_shared<T>(std::forward<Args>(args)...);
    }
  } else {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  }
}

template <typename N>
void add_output_pre_hook(N& node, std::unique_ptr<torch::autograd::FunctionPreHook> hook) {
  if constexpr (requires { node.add_tensor_pre_hook(std::move(hook)); }) {
    node.add_tensor_pre_hook(std::move(hook));
  } else {
    node.add_pre_hook(std::move(hook));
  }
}

}  // namespace fsdp::compat
