#pragma once
// fsdp::call(unit, args...): the C++ form of FSDP2's "call the module, not module.forward".
//
// LibTorch modules have no forward hooks, so what PyTorch runs in hooks around a module's forward
// runs here, from the module-hook registry (see [Note: one hook mechanism for fsdp::call] in
// fsdp/hooks/forward_hooks.h): tensor parallel's input/output collectives, FSDP's pre-forward
// (lazy root init, all-gather and wait, prefetch of the next unit, hooks that run the
// reduce-scatter after this unit's backward) and post-forward (reshard, hooks that re-gather
// before backward). For a module without hooks it is exactly module->forward(args...).
//
// A module may carry a call wrapper (activation checkpointing registers one, see
// fsdp/activation/activation_checkpointing.h): fsdp::call then hands the whole call (hooks and forward), as a
// function of its tensor arguments, to the wrapper, which may run it again later (the recompute
// during backward). Non-tensor arguments are copied for that.
//
// Example:
//   at::Tensor logits = fsdp::call(model, tokens);  // model->forward(tokens) between its hooks
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/detail/sharding_call.h"
#include "fsdp/hooks/forward_hooks.h"

namespace fsdp {

template <typename M, typename... Args>
auto call(M& module, Args&&... args) {
  if (auto wrapper = hooks::detail::find_call_wrapper(detail::module_pointer(module))) {
    std::decay_t<M> handle = module;  // a holder or pointer: the wrapper may call again in backward
    return detail::call_through(
        *wrapper,
        [handle](auto&&... a) mutable { return detail::call_unwrapped(handle, std::forward<decltype(a)>(a)...); },
        std::forward<Args>(args)...);
  }
  return detail::call_unwrapped(module, std::forward<Args>(args)...);
}

}  // namespace fsdp
