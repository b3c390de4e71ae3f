#pragma once
// Template plumbing of fsdp::call and fsdp::call_method (fsdp/sharding/call.h,
// fsdp/sharding/forward_method.h) and of activation checkpointing's checkpoint(): how a call's
// tensor arguments and outputs are found, substituted and handed to the module's forward hooks
// and call wrapper. Not an API: included by those headers only.
#include <c10/util/SmallVector.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/detail/hooks.h"
#include "fsdp/hooks/forward_hooks.h"

namespace fsdp {

namespace detail {

// Reshards the unit of `module` and every sharded unit below it (call_method's no-grad forward
// methods); nothing when `module` is not a unit. Defined in src/sharding/forward_method.cpp.
void reshard_subtree(torch::nn::Module& module);

using hooks::detail::CallWrapper;
using hooks::detail::TensorFn;

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

// Where a call's output tensors are: inline up to four (no allocation for a module's one output).
using OutputSlots = c10::SmallVector<at::Tensor*, 4>;
inline void collect_outputs(at::Tensor& t, OutputSlots& out) { out.push_back(&t); }
inline void collect_outputs(std::vector<at::Tensor>& ts, OutputSlots& out) {
  for (auto& t : ts) out.push_back(&t);
}
template <typename... Ts>
void collect_outputs(std::tuple<Ts...>& tuple, OutputSlots& out) {
  std::apply([&](auto&... elems) { (collect_outputs(elems, out), ...); }, tuple);
}
template <typename T>
void collect_outputs(T&, OutputSlots&) {}  // not a tensor: nothing to hook

// [Note: the argument vectors kept between calls]
// A call's tensor arguments travel through its hooks in one std::vector (each hook takes it and
// returns it by value, so passing it along moves the same buffer) and the vector then carries the
// outputs. A new vector per call would be one heap allocation per unit and step; instead each
// thread keeps the vectors of its finished calls, emptied (no tensor is held between calls), and a
// call takes one back with the capacity an earlier call gave it. A stack of them, since calls nest
// (a root's forward calls its blocks'); a few at most, of a few tensors each.
class ArgumentVector {
 public:
  ArgumentVector() {
    auto& spare = spares();
    if (!spare.empty()) {
      tensors = std::move(spare.back());
      spare.pop_back();
    }
  }
  ~ArgumentVector() {
    tensors.clear();
    auto& spare = spares();
    if (tensors.capacity() != 0 && tensors.capacity() <= kMaxKeptCapacity && spare.size() < kMaxKept) {
      spare.push_back(std::move(tensors));
    }
  }
  ArgumentVector(const ArgumentVector&) = delete;
  ArgumentVector& operator=(const ArgumentVector&) = delete;

  std::vector<at::Tensor> tensors;

 private:
  static constexpr size_t kMaxKept = 16, kMaxKeptCapacity = 64;
  static std::vector<std::vector<at::Tensor>>& spares() {
    thread_local std::vector<std::vector<at::Tensor>> spare = [] {
      std::vector<std::vector<at::Tensor>> kept;
      kept.reserve(kMaxKept);  // the destructor's push_back does not allocate
      return kept;
    }();
    return spare;
  }
};

// fn(args...) between `module`'s forward hooks: the pre hooks on the tensor arguments, fn with
// the tensors they returned, the post hooks on the output tensors (abort on a throw). The one body
// of fsdp::call (fn: forward) and fsdp::call_method (fn: another method).
template <typename Fn, typename... Args>
auto call_with_hooks(const torch::nn::Module* module, Fn&& fn, Args&&... args) {
  auto hooks = hooks::detail::find_forward_hooks(module);
  if (hooks == nullptr || hooks->empty()) return fn(std::forward<Args>(args)...);

  ArgumentVector kept;  // [Note: the argument vectors kept between calls]
  std::vector<at::Tensor>& tensors = kept.tensors;
  (detail::collect_tensor(args, tensors), ...);
  tensors = hooks::detail::run_pre(*hooks, std::move(tensors));
  auto next = tensors.begin();
  // Braced initialisation evaluates left to right, so tensors are substituted in order.
  std::tuple<decltype(detail::substitute(std::forward<Args>(args), next))...> forwarded{
      detail::substitute(std::forward<Args>(args), next)...};
  try {
    auto output = std::apply([&](auto&&... a) { return fn(std::forward<decltype(a)>(a)...); }, std::move(forwarded));
    OutputSlots outputs;
    detail::collect_outputs(output, outputs);
    // The arguments' vector (the call holds its own copies) carries the outputs: its capacity is
    // reused, so a call with no more outputs than tensor arguments allocates no vector of its own.
    std::vector<at::Tensor>& out_tensors = tensors;
    out_tensors.clear();
    for (auto* t : outputs) out_tensors.push_back(*t);
    hooks::detail::run_post(*hooks, out_tensors);
    for (size_t i = 0; i < outputs.size(); ++i) *outputs[i] = out_tensors[i];
    return output;
  } catch (...) {
    hooks::detail::run_abort(*hooks);
    throw;
  }
}

// fsdp::call without the module's call wrapper.
template <typename M, typename... Args>
auto call_unwrapped(M& module, Args&&... args) {
  return call_with_hooks(
      detail::module_pointer(module),
      [&module](auto&&... a) { return module->forward(std::forward<decltype(a)>(a)...); }, std::forward<Args>(args)...);
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
    OutputSlots ptrs;
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
  OutputSlots ptrs;
  collect_outputs(output, ptrs);
  if (results.size() != ptrs.size()) throw std::logic_error("fsdp::call: a call wrapper changed the number of outputs");
  for (size_t i = 0; i < ptrs.size(); ++i) *ptrs[i] = results[i];
  return output;
}

}  // namespace detail

}  // namespace fsdp
