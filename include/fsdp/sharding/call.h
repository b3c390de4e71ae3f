#pragma once
// fsdp::call(unit, args...): the C++ form of FSDP2's "call the module, not module.forward".
//
// LibTorch modules have no forward hooks, so the FSDP logic around a sharded unit's forward runs
// here: pre-forward (lazy root init, all-gather and wait, prefetch of the next unit, hooks that
// run the reduce-scatter after this unit's backward) and post-forward (reshard, hooks that re-
// gather before backward). For a module that is not sharded it is exactly module->forward(args...).
// Tensor-parallel styles (fsdp/tensor_parallel) run their input/output communication here too.
//
// A module may carry a call wrapper (activation checkpointing registers one, see
// fsdp/activation/checkpoint.h): fsdp::call then hands the whole call (FSDP hooks and forward),
// as a function of its tensor arguments, to the wrapper, which may run it again later (the
// recompute during backward). Non-tensor arguments are copied for that.
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/tensor_parallel/hooks.h"

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

// The call wrapper interface (sharding knows nothing of what a wrapper does).
using TensorFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
using CallWrapper = std::function<std::vector<at::Tensor>(const TensorFn& call, const std::vector<at::Tensor>& inputs)>;
// Registers (or, with an empty wrapper, removes) `module`'s wrapper; kept while the module lives.
void set_call_wrapper(const std::shared_ptr<torch::nn::Module>& module, CallWrapper wrapper);
// The wrapper of `module`, or null. The pointer stays valid until the entry is replaced.
std::shared_ptr<const CallWrapper> find_call_wrapper(const torch::nn::Module* module);

// Activation checkpointing's recompute (set by the activation layer while a checkpointed function
// runs again during backward): sharded units entered meanwhile behave as in backward (no forward
// prefetch, no reshard before their backward), see FSDPState::pre_forward.
bool in_recompute();
struct RecomputeScope {
  RecomputeScope();
  ~RecomputeScope();
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

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

// fsdp::call without the module's call wrapper: tensor-parallel input transforms, FSDP's
// pre-forward, forward, tensor-parallel output transforms, FSDP's post-forward (see [Note: TP
// communication through fsdp::call] in fsdp/tensor_parallel/hooks.h).
template <typename M, typename... Args>
auto call_unwrapped(M& module, Args&&... args) {
  torch::nn::Module* ptr = detail::module_pointer(module);
  detail::FSDPState* state = detail::find_state(ptr);
  auto tp_hooks = tp::detail::find_module_hooks(ptr);
  if (state == nullptr && tp_hooks == nullptr) return module->forward(std::forward<Args>(args)...);

  std::vector<at::Tensor> tensors;
  (detail::collect_tensor(args, tensors), ...);
  if (tp_hooks) tensors = tp::detail::run_input_hooks(*tp_hooks, std::move(tensors));
  if (state) tensors = detail::pre_forward(state, std::move(tensors));
  auto next = tensors.begin();
  // Braced initialisation evaluates left to right, so tensors are substituted in order.
  std::tuple<decltype(detail::substitute(std::forward<Args>(args), next))...> forwarded{
      detail::substitute(std::forward<Args>(args), next)...};
  try {
    auto output =
        std::apply([&](auto&&... a) { return module->forward(std::forward<decltype(a)>(a)...); }, std::move(forwarded));
    std::vector<at::Tensor*> outputs;
    detail::collect_outputs(output, outputs);
    std::vector<at::Tensor> out_tensors;
    for (auto* t : outputs) out_tensors.push_back(*t);
    if (tp_hooks) tp::detail::run_output_hooks(*tp_hooks, out_tensors);
    if (state) detail::post_forward(state, out_tensors);
    for (size_t i = 0; i < outputs.size(); ++i) *outputs[i] = out_tensors[i];
    return output;
  } catch (...) {
    if (state) detail::abort_forward(state);
    throw;
  }
}

// Copies of `args` (tensors among them replaced by `tensors`, in order) applied to `fn`.
template <typename Fn, typename Tuple>
auto apply_with_tensors(Fn& fn, Tuple& held, const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> copy = tensors;
  auto next = copy.begin();
  return std::apply(
      [&](auto&... a) {
        // Braced initialisation evaluates left to right, so tensors are substituted in order.
        std::tuple<decltype(substitute(a, next))...> forwarded{substitute(a, next)...};
        return std::apply([&](auto&&... f) { return fn(std::forward<decltype(f)>(f)...); }, std::move(forwarded));
      },
      held);
}

// Runs fn(args...) through `wrapper`, as a function of the tensor arguments that the wrapper may
// call again (so non-tensor arguments and `fn` are copied); returns fn's result with its tensors
// replaced by those the wrapper returned.
template <typename Fn, typename... Args>
auto call_through(const CallWrapper& wrapper, Fn fn, Args&&... args) {
  using Output = decltype(fn(std::forward<Args>(args)...));
  std::vector<at::Tensor> inputs;
  (collect_tensor(args, inputs), ...);
  auto held = std::make_shared<std::tuple<std::decay_t<Args>...>>(args...);
  auto first = std::make_shared<std::optional<Output>>();
  TensorFn tensor_fn = [fn, held, first](const std::vector<at::Tensor>& tensors) mutable {
    Output output = apply_with_tensors(fn, *held, tensors);
    std::vector<at::Tensor*> ptrs;
    collect_outputs(output, ptrs);
    std::vector<at::Tensor> out;
    for (auto* t : ptrs) out.push_back(*t);
    if (first && !first->has_value()) {
      first->emplace(std::move(output));
      first.reset();  // the recompute's output is not needed
    }
    return out;
  };
  std::vector<at::Tensor> results = wrapper(tensor_fn, inputs);
  Output output = std::move(first->value());
  std::vector<at::Tensor*> ptrs;
  collect_outputs(output, ptrs);
  if (results.size() != ptrs.size()) throw std::logic_error("fsdp::call: a call wrapper changed the number of outputs");
  for (size_t i = 0; i < ptrs.size(); ++i) *ptrs[i] = results[i];
  return output;
}

}  // namespace detail

template <typename M, typename... Args>
auto call(M& module, Args&&... args) {
  if (auto wrapper = detail::find_call_wrapper(detail::module_pointer(module))) {
    std::decay_t<M> handle = module;  // a holder or pointer: the wrapper may call again in backward
    return detail::call_through(
        *wrapper,
        [handle](auto&&... a) mutable { return detail::call_unwrapped(handle, std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }
  return detail::call_unwrapped(module, std::forward<Args>(args)...);
}

}  // namespace fsdp
