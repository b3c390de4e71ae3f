#include "autograd_hooks.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include "fsdp_state.h"

namespace fsdp::detail {

namespace {

struct PostBackwardHook : torch::autograd::Function<PostBackwardHook> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                int64_t state) {
    ctx->saved_data["state"] = state;
    return inputs.vec();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    reinterpret_cast<FSDPState*>(ctx->saved_data["state"].toInt())->post_backward();
    grads.emplace_back();  // no gradient for the state argument
    return grads;
  }
};

bool takes_grad(const at::Tensor& t) { return t.defined() && t.requires_grad() && at::isFloatingType(t.scalar_type()); }

}  // namespace

std::vector<at::Tensor> register_post_backward_hook(FSDPState* state, std::vector<at::Tensor> args) {
  if (!torch::GradMode::is_enabled()) return args;
  std::vector<at::Tensor> hooked;
  std::vector<size_t> where;
  for (size_t i = 0; i < args.size(); ++i) {
    if (takes_grad(args[i])) {
      hooked.push_back(args[i]);
      where.push_back(i);
    }
  }
  if (hooked.empty()) return args;  // the final callback covers this unit
  auto outs = PostBackwardHook::apply(at::TensorList(hooked), reinterpret_cast<int64_t>(state));
  for (size_t k = 0; k < where.size(); ++k) args[where[k]] = outs[k];
  return args;
}

void register_pre_backward_hooks(FSDPState* state, const std::vector<at::Tensor>& outputs) {
  if (!torch::GradMode::is_enabled()) return;
  for (const auto& t : outputs) {
    if (t.defined() && t.requires_grad()) {
      at::Tensor(t).register_hook([state](const at::Tensor&) { state->pre_backward(); });
    }
  }
}

void queue_final_callback(std::function<void()> callback) {
  torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
}

std::shared_ptr<void> register_grad_accumulated_hook(const at::Tensor& leaf, std::function<void()> hook) {
  auto node = torch::autograd::impl::grad_accumulator(leaf);
  node->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [hook = std::move(hook)](const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) {
        hook();
        return outputs;
      }));
  return std::make_shared<decltype(node)>(std::move(node));
}

}  // namespace fsdp::detail
