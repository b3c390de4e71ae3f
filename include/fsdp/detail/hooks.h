#pragma once
// Running a module's forward hooks (fsdp/hooks/forward_hooks.h) around a call: the plumbing of
// fsdp::call and fsdp::call_method (fsdp/detail/sharding_call.h). Not an API.
#include <ATen/ATen.h>

#include <vector>

#include "fsdp/hooks/forward_hooks.h"

namespace fsdp::hooks::detail {

// `module`'s hooks sorted by order, or null (cheap when no module has any).
std::shared_ptr<const HookList> find_forward_hooks(const torch::nn::Module* module);

// The call wrapper interface: `call` runs the module's hooks and forward on the given tensors.
using TensorFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
using CallWrapper = std::function<std::vector<at::Tensor>(const TensorFn& call, const std::vector<at::Tensor>& inputs)>;
// Registers (or, with an empty wrapper, removes) `module`'s wrapper; kept while the module lives.
void set_call_wrapper(const std::shared_ptr<torch::nn::Module>& module, CallWrapper wrapper);
// The wrapper of `module`, or null. The pointer stays valid until the entry is replaced.
std::shared_ptr<const CallWrapper> find_call_wrapper(const torch::nn::Module* module);

// Runs the hooks' `pre` in order and returns the arguments to use; on a throw, aborts those that ran.
std::vector<at::Tensor> run_pre(const HookList& hooks, std::vector<at::Tensor> args);
// Runs the hooks' `post` in order (a throw propagates: the caller runs run_abort).
void run_post(const HookList& hooks, std::vector<at::Tensor>& outputs);
// Every hook's `abort`, in reverse order (forward threw after run_pre).
void run_abort(const HookList& hooks) noexcept;

}  // namespace fsdp::hooks::detail
