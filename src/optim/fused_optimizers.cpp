// FusedAdamW, FusedAdam, FusedSGD (fsdp/optim/fused.h): each step sorts the parameters with a
// gradient into those the fused loop takes (fused_kernels.cpp, over element ranges in parallel)
// and the rest, which the base class's own step then updates (its param groups swapped for groups
// of just those parameters, with the same options, for the duration of that call).
#include <ATen/Parallel.h>

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "fsdp/compat/optim.h"
#include "fsdp/optim/fused.h"
#include "optim/fused_kernels.h"

namespace fsdp::optim {

namespace {

using torch::optim::OptimizerParamGroup;

// Elements per task of at::parallel_for: 128 KiB of each tensor, so a small parameter runs on the
// calling thread and a large one splits into pieces big enough to stream.
constexpr int64_t kGrain = 32768;

// What the fused loop can read and write through a float*: a dense, contiguous fp32 CPU tensor of
// the parameter's size.
bool fusable(const at::Tensor& t, int64_t numel) {
  return t.defined() && t.layout() == at::kStrided && t.device().is_cpu() && t.scalar_type() == at::kFloat &&
         t.is_contiguous() && t.numel() == numel;
}

// The loops write through raw pointers; ATen's in-place ops would have bumped these tensors'
// version counters (what autograd checks saved tensors against), so the step does too.
void bump_versions(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors)
    if (t->defined()) t->unsafeGetTensorImpl()->bump_version();
}

at::Tensor run_closure(const torch::optim::Optimizer::LossClosure& closure) {
  if (!closure) return {};
  at::AutoGradMode enable_grad(true);  // as the base classes: the closure runs with grad on
  return closure();
}

// Runs `fused(p, options)` on every parameter with a gradient that the fused loop can take (the
// dtype, device and layout dispatch of every fused optimizer: the parameter and its gradient
// fusable); those it does not take or `fused` returns false for (its state not fusable) are
// collected, per group, into groups with a copy of that group's options (for the base step).
template <typename Options, typename Fused>
std::vector<OptimizerParamGroup> step_fused(std::vector<OptimizerParamGroup>& groups, FusedStepCounts& counts,
                                            Fused fused) {
  counts = {};
  std::vector<OptimizerParamGroup> rest_groups;
  for (auto& group : groups) {
    std::vector<at::Tensor> rest;
    for (const auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      const bool takes = fusable(p, p.numel()) && fusable(p.grad(), p.numel());
      if (takes && fused(p, static_cast<const Options&>(group.options()))) {
        ++counts.fused;
      } else {
        rest.push_back(p);
        ++counts.fallback;
      }
    }
    if (!rest.empty()) rest_groups.emplace_back(std::move(rest), group.options().clone());
  }
  return rest_groups;
}

// The optimizer's param groups replaced by `groups` while it lives (the base step over them).
class SwappedGroups {
 public:
  SwappedGroups(std::vector<OptimizerParamGroup>& member, std::vector<OptimizerParamGroup> groups)
      : member_(member), saved_(std::move(groups)) {
    std::swap(member_, saved_);
  }
  ~SwappedGroups() { std::swap(member_, saved_); }
  SwappedGroups(const SwappedGroups&) = delete;
  SwappedGroups& operator=(const SwappedGroups&) = delete;

 private:
  std::vector<OptimizerParamGroup>& member_;
  std::vector<OptimizerParamGroup> saved_;
};

struct AdamHyper {
  double lr, beta1, beta2, eps, weight_decay;
  bool amsgrad;
  bool decoupled;  // AdamW: p *= 1 - lr * wd; Adam: g += wd * p
};

template <typename Options>
AdamHyper adam_hyper(const Options& o, bool decoupled) {
  return {o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(), o.weight_decay(), o.amsgrad(), decoupled};
}

// The kernel's float scalars for step `step` (1-based), computed in double as LibTorch does and
// converted to float as ATen converts an op's scalar for a float tensor.
detail::AdamArgs adam_args(const AdamHyper& h, int64_t step) {
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  detail::AdamArgs a;
  a.param_scale = h.decoupled && h.weight_decay != 0 ? static_cast<float>(1 - h.lr * h.weight_decay) : 1.0f;
  a.l2 = !h.decoupled && h.weight_decay != 0;
  a.grad_decay = static_cast<float>(h.weight_decay);
  a.beta1 = static_cast<float>(h.beta1);
  a.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  a.beta2 = static_cast<float>(h.beta2);
  a.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  a.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  a.eps = static_cast<float>(h.eps);
  a.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  return a;
}

// One Adam/AdamW parameter (and its gradient: fusable, step_fused) in one pass; false (nothing
// changed) when its state is not fusable.
template <typename State>
bool adam_param(compat::OptimizerStateMap& states, const at::Tensor& p, const AdamHyper& h) {
  const at::Tensor& grad = p.grad();
  const int64_t n = p.numel();
  const auto key = compat::optimizer_state_key(p);
  State* state = nullptr;
  if (auto found = states.find(key); found != states.end()) {
    state = static_cast<State*>(found->second.get());
    if (!fusable(state->exp_avg(), n) || !fusable(state->exp_avg_sq(), n) ||
        (h.amsgrad && !fusable(state->max_exp_avg_sq(), n)))
      return false;
  } else {
    auto fresh = std::make_unique<State>();
    fresh->step(0);
    fresh->exp_avg(at::zeros_like(p, at::MemoryFormat::Preserve));
    fresh->exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    if (h.amsgrad) fresh->max_exp_avg_sq(at::zeros_like(p, at::MemoryFormat::Preserve));
    state = fresh.get();
    states[key] = std::move(fresh);
  }
  state->step(state->step() + 1);
  detail::AdamArgs a = adam_args(h, state->step());
  a.param = p.data_ptr<float>();
  a.grad = grad.data_ptr<float>();
  a.exp_avg = state->exp_avg().template data_ptr<float>();
  a.exp_avg_sq = state->exp_avg_sq().template data_ptr<float>();
  if (h.amsgrad) a.max_exp_avg_sq = state->max_exp_avg_sq().template data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&a](int64_t begin, int64_t end) { detail::adam_update(a, begin, end); });
  bump_versions({&p, &state->exp_avg(), &state->exp_avg_sq()});
  if (h.amsgrad) bump_versions({&state->max_exp_avg_sq()});
  return true;
}

// One SGD parameter (and its gradient: fusable, step_fused) in one pass; false (nothing changed)
// when its momentum buffer is not fusable.
bool sgd_param(compat::OptimizerStateMap& states, const at::Tensor& p, const torch::optim::SGDOptions& o) {
  const at::Tensor& grad = p.grad();
  const int64_t n = p.numel();
  detail::SgdArgs a;
  a.weight_decay_on = o.weight_decay() != 0;
  a.weight_decay = static_cast<float>(o.weight_decay());
  a.neg_lr = static_cast<float>(-1 * o.lr());
  at::Tensor buffer;
  if (o.momentum() != 0) {
    const auto key = compat::optimizer_state_key(p);
    if (auto found = states.find(key); found != states.end()) {
      buffer = static_cast<torch::optim::SGDParamState&>(*found->second).momentum_buffer();
      if (!fusable(buffer, n)) return false;
    } else {
      buffer = at::empty_like(p, at::MemoryFormat::Contiguous);  // written whole below: b = d
      auto fresh = std::make_unique<torch::optim::SGDParamState>();
      fresh->momentum_buffer(buffer);
      states[key] = std::move(fresh);
      a.first_step = true;
    }
    a.momentum_buffer = buffer.data_ptr<float>();
    a.momentum = static_cast<float>(o.momentum());
    a.one_minus_dampening = static_cast<float>(1 - o.dampening());
    a.nesterov = o.nesterov();
  }
  a.param = p.data_ptr<float>();
  a.grad = grad.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&a](int64_t begin, int64_t end) { detail::sgd_update(a, begin, end); });
  bump_versions({&p, &buffer});
  return true;
}

// The step of every fused optimizer: the closure, the fused loop over the parameters it takes,
// then Base's own step over the rest (its param groups swapped for theirs during the call).
template <typename Base, typename Options, typename Fused>
at::Tensor fused_step(Base& self, std::vector<OptimizerParamGroup>& groups, FusedStepCounts& counts,
                      const torch::optim::Optimizer::LossClosure& closure, Fused fused) {
  at::NoGradGuard no_grad;
  at::Tensor loss = run_closure(closure);
  auto rest = step_fused<Options>(groups, counts, fused);
  if (!rest.empty()) {
    SwappedGroups swapped(groups, std::move(rest));
    self.Base::step(nullptr);
  }
  return loss;
}

}  // namespace

at::Tensor FusedAdamW::step(LossClosure closure) {
  using torch::optim::AdamWOptions;
  return fused_step<torch::optim::AdamW, AdamWOptions>(
      *this, param_groups_, last_step_, closure, [this](const at::Tensor& p, const AdamWOptions& o) {
        return adam_param<torch::optim::AdamWParamState>(state_, p, adam_hyper(o, /*decoupled=*/true));
      });
}

at::Tensor FusedAdam::step(LossClosure closure) {
  using torch::optim::AdamOptions;
  return fused_step<torch::optim::Adam, AdamOptions>(
      *this, param_groups_, last_step_, closure, [this](const at::Tensor& p, const AdamOptions& o) {
        return adam_param<torch::optim::AdamParamState>(state_, p, adam_hyper(o, /*decoupled=*/false));
      });
}

at::Tensor FusedSGD::step(LossClosure closure) {
  using torch::optim::SGDOptions;
  return fused_step<torch::optim::SGD, SGDOptions>(
      *this, param_groups_, last_step_, closure,
      [this](const at::Tensor& p, const SGDOptions& o) { return sgd_param(state_, p, o); });
}

}  // namespace fsdp::optim
