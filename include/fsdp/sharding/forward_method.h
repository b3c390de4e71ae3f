#pragma once
// FSDP2's register_fsdp_forward_method in C++: entry points other than forward (sampling,
// generate, an encoder-only pass) run with the unit's parameters gathered, like fsdp::call.
//
// Python patches the method on the module object; C++ cannot, so the method is called through
// fsdp (a member function pointer of the module's Impl class):
//
// Example:
//   // GPTImpl (models/gpt.h) has forward and encode(tokens) -> hidden states
//   at::Tensor h = fsdp::call_method(model, &GPTImpl::encode, tokens);         // one call
//   auto encode = fsdp::register_fsdp_forward_method(model, &GPTImpl::encode); // or a callable,
//   at::Tensor h2 = encode(tokens);                                            // the same thing
//
// The method runs between the unit's pre-forward (all-gather, prefetch, backward hooks on its
// tensor arguments) and post-forward (reshard as after forward, hooks on its tensor outputs), so
// gradients through it are reduce-scattered as after forward. Sharded submodules the method
// enters through fsdp::call gather and reshard themselves as usual. Under no-grad (sampling,
// evaluation: no backward follows to reshard what forward kept) the unit and every sharded unit
// inside it are resharded when the method returns, so parameters are back to shards. Tensor
// parallel's input/output hooks run around the method too (the same body as fsdp::call, see
// fsdp/hooks/forward_hooks.h). For a module without hooks it is exactly
// (module.get()->*method)(args...). A call wrapper (activation checkpointing) applies to
// fsdp::call only, not to methods.
#include <ATen/core/grad_mode.h>

#include <utility>

#include "fsdp/sharding/call.h"

namespace fsdp {

template <typename M, typename Method, typename... Args>
auto call_method(M& module, Method method, Args&&... args) {
  torch::nn::Module* base = detail::module_pointer(module);
  auto* self = [&] {
    if constexpr (std::is_pointer_v<std::decay_t<M>>)
      return module;
    else
      return module.get();
  }();
  // The body of fsdp::call: every forward hook (FSDP's, tensor parallel's) runs around the method.
  auto output = detail::call_with_hooks(
      base, [self, method](auto&&... a) { return (self->*method)(std::forward<decltype(a)>(a)...); },
      std::forward<Args>(args)...);
  if (!at::GradMode::is_enabled()) detail::reshard_subtree(*base);
  return output;
}

// A callable that runs `method` of `module` through call_method (it holds the module handle).
template <typename M, typename Method>
auto register_fsdp_forward_method(M module, Method method) {
  return [module, method](auto&&... args) mutable {
    return call_method(module, method, std::forward<decltype(args)>(args)...);
  };
}

}  // namespace fsdp
