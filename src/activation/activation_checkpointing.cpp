// Activation checkpointing, reentrant style (see fsdp/compat/rng.h for why): one custom autograd
// node per checkpointed call. Its forward runs the function without autograd; its backward runs
// the function again with autograd (RNG replayed), then a nested backward through that graph,
// which leaves the parameters' gradients where autograd always puts them and returns the inputs'.
#include "fsdp/activation/activation_checkpointing.h"

#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "fsdp/compat/rng.h"
#include "fsdp/debug/profiler.h"
#include "sharding/recompute.h"

namespace fsdp::activation {

bool is_recomputing() { return fsdp::detail::in_recompute(); }

namespace detail {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What backward needs besides the saved inputs (kept in the autograd context as a capsule).
struct Closure : torch::CustomClassHolder {
  fsdp::detail::TensorFn fn;
  CheckpointOptions options;
  std::vector<at::Device> rng_devices;  // besides the inputs' (a checkpointed module's parameters')
  compat::RngState rng;                 // the generators before the forward
  std::vector<bool> input_is_float;     // which inputs can take a gradient
};

bool differentiable(const at::Tensor& t) { return t.defined() && at::isFloatingType(t.scalar_type()); }

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // inputs: the function's tensor arguments, then one leaf that requires grad, so that this node
  // is part of the graph (and its backward runs) even when no input requires grad but the
  // function's parameters do.
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, c10::intrusive_ptr<Closure> closure) {
    std::vector<at::Tensor> args(inputs.begin(), inputs.end() - 1);
    if (closure->options.preserve_rng_state) closure->rng = compat::capture_rng_state(args, closure->rng_devices);
    for (const auto& a : args) closure->input_is_float.push_back(differentiable(a));
    ctx->save_for_backward(args);
    ctx->saved_data["closure"] = c10::IValue::make_capsule(closure);
    std::vector<at::Tensor> outputs;
    {
      torch::NoGradGuard no_grad;
      outputs = closure->fn(args);
    }
    std::vector<at::Tensor> non_diff;
    for (auto& o : outputs) {
      if (!o.defined()) continue;
      if (!differentiable(o)) non_diff.push_back(o);
    }
    if (!non_diff.empty()) ctx->mark_non_differentiable(non_diff);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!torch::autograd::Engine::get_default_engine().is_checkpoint_valid()) {
      throw std::runtime_error(
          "fsdp::activation::checkpoint: not supported with torch::autograd::grad or backward(inputs=...); call "
          "backward() without inputs");
    }
    if (torch::GradMode::is_enabled()) {
      throw std::runtime_error(
          "fsdp::activation::checkpoint: double backward (backward with create_graph=true) through a checkpointed "
          "function is not supported; run that part without checkpointing");
    }
    auto closure = ctx->saved_data["closure"].toCapsule();
    auto* c = static_cast<Closure*>(closure.get());
    const auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < saved.size(); ++i) {
      at::Tensor d = saved[i].defined() ? saved[i].detach() : saved[i];
      if (c->input_is_float[i] && saved[i].requires_grad()) d.requires_grad_(true);
      inputs.push_back(d);
    }
    std::vector<at::Tensor> outputs;
    {
      compat::RngState after;
      if (c->options.preserve_rng_state) {
        after = compat::current_rng_state(c->rng);
        compat::restore_rng_state(c->rng);
      }
      try {
        fsdp::detail::RecomputeScope recompute;
        const profiler::Range range("fsdp::activation_recompute");
        torch::AutoGradMode grad_on(true);
        outputs = c->fn(inputs);
      } catch (...) {
        if (c->options.preserve_rng_state) compat::restore_rng_state(after);
        throw;
      }
      if (c->options.preserve_rng_state) compat::restore_rng_state(after);
    }
    if (outputs.size() != grads.size()) {
      throw std::runtime_error("fsdp::activation::checkpoint: the recompute returned " +
                               std::to_string(outputs.size()) + " tensors, the forward " +
                               std::to_string(grads.size()) + "; the function must return the same outputs every time");
    }
    std::vector<at::Tensor> outs, out_grads;
    bool any_requires_grad = false;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!outputs[i].defined() || !outputs[i].requires_grad()) continue;
      any_requires_grad = true;
      if (!grads[i].defined()) continue;
      outs.push_back(outputs[i]);
      out_grads.push_back(grads[i]);
    }
    if (!any_requires_grad) {
      throw std::runtime_error(
          "fsdp::activation::checkpoint: none of the checkpointed function's outputs needs a gradient (it uses no "
          "input or parameter that requires grad); call it without checkpointing");
    }
    // The recompute's backward, nested in this one (sharded units inside run their pre- and
    // post-backward hooks here: gather wait, prefetch of the unit before, reduce-scatter, reshard).
    if (!outs.empty()) torch::autograd::backward(outs, out_grads);
    variable_list result;
    for (auto& in : inputs) result.push_back(in.defined() && in.requires_grad() ? in.grad() : at::Tensor());
    result.emplace_back();  // the anchor leaf
    result.emplace_back();  // the closure
    return result;
  }
};

}  // namespace

namespace {

std::vector<at::Tensor> checkpoint_tensors(const fsdp::detail::TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                           const CheckpointOptions& options, std::vector<at::Device> rng_devices) {
  if (!torch::GradMode::is_enabled()) return fn(inputs);  // nothing to save memory from
  auto closure = c10::make_intrusive<Closure>();
  closure->fn = fn;
  closure->options = options;
  closure->rng_devices = std::move(rng_devices);
  std::vector<at::Tensor> args = inputs;
  static const at::Tensor anchor = at::zeros({0}).requires_grad_(true);
  args.push_back(anchor);
  return CheckpointFunction::apply(at::TensorList(args), closure);
}

// The CUDA devices of `module`'s parameters and buffers (itself and below): its dropout may draw
// there even when no input lives there (PyTorch's checkpoint saves only the inputs' devices).
std::vector<at::Device> module_devices(const torch::nn::Module& module) {
  std::vector<at::Device> devices;
  if (!at::hasCUDA()) return devices;  // a CPU-only process: nothing beyond the CPU generator
  auto add = [&devices](const at::Tensor& t) {
    if (!t.defined() || !t.is_cuda()) return;
    if (std::find(devices.begin(), devices.end(), t.device()) == devices.end()) devices.push_back(t.device());
  };
  for (const auto& p : module.parameters(/*recurse=*/true)) add(p);
  for (const auto& b : module.buffers(/*recurse=*/true)) add(b);
  return devices;
}

}  // namespace

std::vector<at::Tensor> checkpoint_tensors(const fsdp::detail::TensorFn& fn, const std::vector<at::Tensor>& inputs,
                                           const CheckpointOptions& options) {
  return checkpoint_tensors(fn, inputs, options, {});
}

fsdp::detail::CallWrapper make_wrapper(const CheckpointOptions& options,
                                       const std::shared_ptr<torch::nn::Module>& module) {
  std::weak_ptr<torch::nn::Module> weak = module;  // the registry keeps the wrapper while the module lives
  return [options, weak](const fsdp::detail::TensorFn& fn, const std::vector<at::Tensor>& inputs) {
    std::vector<at::Device> devices;
    if (options.preserve_rng_state && torch::GradMode::is_enabled()) {
      if (auto m = weak.lock()) devices = module_devices(*m);
    }
    return checkpoint_tensors(fn, inputs, options, std::move(devices));
  };
}

}  // namespace detail

bool mark_checkpointed(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options) {
  if (!module) throw std::invalid_argument("fsdp::activation::checkpoint_wrapper: the module is null");
  const bool was = is_checkpointed(*module);
  fsdp::hooks::detail::set_call_wrapper(module, detail::make_wrapper(options, module));
  return !was;
}

bool is_checkpointed(const torch::nn::Module& module) {
  return fsdp::hooks::detail::find_call_wrapper(&module) != nullptr;
}

size_t apply_activation_checkpointing(torch::nn::Module& model, const CheckpointPredicate& predicate,
                                      const CheckpointOptions& options) {
  size_t n = 0;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (predicate(item.key(), *item.value())) {
      mark_checkpointed(item.value(), options);
      ++n;
    }
  }
  if (n == 0) {
    throw std::invalid_argument(
        "fsdp::activation::apply_activation_checkpointing: the predicate selected no submodule of " + model.name() +
        "; check the module type or the names it tests");
  }
  return n;
}

void remove_activation_checkpointing(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) fsdp::hooks::detail::set_call_wrapper(m, nullptr);
}

}  // namespace fsdp::activation
