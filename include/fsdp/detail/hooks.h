#pragma once
// Running a module's forward hooks (fsdp/hooks/forward_hooks.h) around a call: the plumbing of
// fsdp::call and fsdp::call_method (fsdp/detail/sharding_call.h). Not an API.
#include <ATen/ATen.h>

#include <vector>

#include "fsdp/hooks/forward_hooks.h"

namespace fsdp::hooks::detail {

// Runs the hooks' `pre` in order and returns the arguments to use; on a throw, aborts those that ran.
std::vector<at::Tensor> run_pre(const HookList& hooks, std::vector<at::Tensor> args);
// Runs the hooks' `post` in order (a throw propagates: the caller runs run_abort).
void run_post(const HookList& hooks, std::vector<at::Tensor>& outputs);
// Every hook's `abort`, in reverse order (forward threw after run_pre).
void run_abort(const HookList& hooks) noexcept;

}  // namespace fsdp::hooks::detail
