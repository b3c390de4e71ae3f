#pragma once
// fsdp::call(unit, args...): the C++ form of FSDP2's "call the module, not module.forward".
//
// LibTorch modules have no forward hooks, so the FSDP logic around a sharded unit's forward runs
// here: pre-forward (lazy root init, all-gather and wait, prefetch of the next unit, hooks that
// run the reduce-scatter after this unit's backward) and post-forward (reshard, hooks that re-
// gather before backward). For a module that is not sharded it is exactly module->forward(args...).
#include <torch/nn/module.h>

#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fsdp {

namespace detail {
class FSDPState;
FSDPState* find_state(const torch::nn::Module* module);
// Runs pre-forward; returns the tensor arguments to use instead (same order).
std::vector<at::Tensor> pre_forward(FSDPState* state, std::vector<at::Tensor> tensor_args);
// Runs post-forward on the output tensors (in place: hooks are registered on them).
void post_forward(FSDPState* state, std::vector<at::Tensor>& outputs);
// post_forward's counterpart when forward threw: leaves the unit in a state a retry can use.
void abort_forward(FSDPState* state) noexcept;

template <typename M>
torch::nn::Module* module_pointer(M& module) {
  if constexpr (std::is_pointer_v<std::decay_t<M>>) {
    return module;
  } else {
    return module.get();  // ModuleHolder and std::shared_ptr both have get()
  }
}

template <typename T>
constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

template <typename T>
void collect_tensor(T&& arg, std::vector<at::Tensor>& out) {
  if constexpr (is_tensor_v<T>) out.push_back(arg);
}

// Replaces tensor arguments, in order (the caller evaluates these left to right).
template <typename T>
decltype(auto) substitute(T&& arg, std::vector<at::Tensor>::iterator& next) {
  if constexpr (is_tensor_v<T>) {
    return at::Tensor(*next++);
  } else {
    return std::forward<T>(arg);
  }
}

inline void collect_outputs(at::Tensor& t, std::vector<at::Tensor*>& out) { out.push_back(&t); }
inline void collect_outputs(std::vector<at::Tensor>& ts, std::vector<at::Tensor*>& out) {
  for (auto& t : ts) out.push_back(&t);
}
template <typename... Ts>
void collect_outputs(std::tuple<Ts...>& tuple, std::vector<at::Tensor*>& out) {
  std::apply([&](auto&... elems) { (collect_outputs(elems, out), ...); }, tuple);
}
template <typename T>
void collect_outputs(T&, std::vector<at::Tensor*>&) {}  // not a tensor: nothing to hook

}  // namespace detail

template <typename M, typename... Args>
auto call(M& module, Args&&... args) {
  detail::FSDPState* state = detail::find_state(detail::module_pointer(module));
  if (state == nullptr) return module->forward(std::forward<Args>(args)...);

  std::vector<at::Tensor> tensors;
  (detail::collect_tensor(args, tensors), ...);
  tensors = detail::pre_forward(state, std::move(tensors));
  auto next = tensors.begin();
  // Braced initialisation evaluates left to right, so tensors are substituted in order.
  std::tuple<decltype(detail::substitute(std::forward<Args>(args), next))...> forwarded{
      detail::substitute(std::forward<Args>(args), next)...};
  try {
    auto output = std::apply([&](auto&&... a) { return module->forward(std::forward<decltype(a)>(a)...); },
                             std::move(forwarded));
    std::vector<at::Tensor*> outputs;
    detail::collect_outputs(output, outputs);
    std::vector<at::Tensor> out_tensors;
    for (auto* t : outputs) out_tensors.push_back(*t);
    detail::post_forward(state, out_tensors);
    for (size_t i = 0; i < outputs.size(); ++i) *outputs[i] = out_tensors[i];
    return output;
  } catch (...) {
    detail::abort_forward(state);
    throw;
  }
}

}  // namespace fsdp
