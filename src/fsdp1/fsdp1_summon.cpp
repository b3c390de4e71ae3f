// summon_full_params: every unit's full parameters gathered for the guard's lifetime (the units'
// own unshard / reshard), edits copied back into this rank's rows of each shard on exit; and the
// unit listings FSDP1's API offers (fsdp_modules).
#include <torch/torch.h>

#include <set>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/dist/runtime.h"
#include "fsdp1_state.h"
#include "sharding/fsdp_param.h"
#include "sharding/fsdp_state.h"
#include "sharding/recompute.h"
#include "sharding/registry.h"

namespace fsdp {

namespace detail {

namespace {
// Units and replicated parameters some guard holds now (one thread drives training).
std::set<const FSDPState*>& summoned_states() {
  static std::set<const FSDPState*> s;
  return s;
}
std::set<const c10::TensorImpl*>& summoned_params() {
  static std::set<const c10::TensorImpl*> s;
  return s;
}
}  // namespace

int& fsdp1_forward_depth() {
  thread_local int depth = 0;
  return depth;
}

void check_not_summoned(torch::nn::Module& root) {
  if (summoned_states().empty() && summoned_params().empty()) return;
  for (const auto& m : root.modules(/*include_self=*/true)) {
    auto s = lookup_state(m.get());
    if (s && summoned_states().count(s.get())) {
      throw std::logic_error(
          "fsdp: forward inside summon_full_params (its guard holds the gathered parameters); end the guard's "
          "scope before running forward");
    }
  }
  for (const auto& p : root.parameters()) {
    if (detail::summoned_params().count(p.unsafeGetTensorImpl())) {
      throw std::logic_error(
          "fsdp: forward inside summon_full_params (its guard holds the parameters); end the guard's scope before "
          "running forward");
    }
  }
}

namespace {
std::vector<std::shared_ptr<FSDPState>> states_under(torch::nn::Module& module) {
  std::vector<std::shared_ptr<FSDPState>> out;
  std::unordered_set<const FSDPState*> seen;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    auto s = lookup_state(m.get());
    if (s && seen.insert(s.get()).second) out.push_back(s);
  }
  return out;
}

std::string unit_name(const FSDPState& s) {
  if (s.group() && !s.group()->params().empty()) return "the unit of '" + s.group()->params().front()->fqn() + "'";
  return "a unit";
}
}  // namespace

}  // namespace detail

struct SummonFullParams::Impl {
  bool writeback = true;
  bool holds_full = true;  // false on ranks other than 0 under rank0_only
  std::vector<std::shared_ptr<detail::FSDPState>> states;
  std::vector<bool> gathered_here;  // unsharded by this guard (resharded at exit)
  // offload_to_cpu: (CPU copy handed out, the full parameter it came from)
  std::vector<std::pair<at::Tensor, at::Tensor>> cpu_copies;
  // Parameters that are not shards (replicate, ignored): their values to restore without writeback.
  std::vector<std::pair<at::Tensor, at::Tensor>> saved;
  std::vector<const c10::TensorImpl*> held_params;
};

SummonFullParams::SummonFullParams(torch::nn::Module& module, bool writeback, bool rank0_only, bool offload_to_cpu)
    : impl_(std::make_unique<Impl>()) {
  if (rank0_only && writeback) {
    throw std::invalid_argument(
        "fsdp::summon_full_params: rank0_only with writeback (other ranks would have nothing to write back); pass "
        "writeback=false");
  }
  if (detail::fsdp1_forward_depth() > 0 || detail::in_recompute()) {
    throw std::logic_error(
        "fsdp::summon_full_params: called during forward; call it between training steps, outside forward");
  }
  auto states = detail::states_under(module);
  for (const auto& s : states) {
    if (detail::summoned_states().count(s.get())) {
      throw std::logic_error("fsdp::summon_full_params: nested over " + detail::unit_name(*s) +
                             ", which an enclosing summon_full_params already holds; use the outer guard");
    }
    if (s->group() && s->group()->state() == detail::FSDPParamGroup::State::Unsharding) {
      throw std::logic_error("fsdp::summon_full_params: an all-gather of " + detail::unit_name(*s) +
                             " is in flight (forward or backward in progress); call it between training steps");
    }
    if (writeback && s->group()) {
      for (const auto& p : s->group()->params()) {
        if (p->compute_dtype() != p->dtype()) {
          throw std::invalid_argument(
              "fsdp::summon_full_params: writeback under mixed precision would round the "
              "shard of '" +
              p->fqn() + "' to its param_dtype; pass writeback=false");
        }
      }
    }
  }
  for (const auto& p : module.parameters()) {
    if (detail::summoned_params().count(p.unsafeGetTensorImpl()) && !detail::param_of_shard(p)) {
      throw std::logic_error(
          "fsdp::summon_full_params: nested over parameters an enclosing summon_full_params already holds; use the "
          "outer guard");
    }
  }
  impl_->writeback = writeback;
  impl_->holds_full = !rank0_only || dist::rank() == 0;
  // Gather (collective: every rank, module order), then, under rank0_only, free again off rank 0.
  for (const auto& s : states) {
    const bool sharded = s->group() && s->group()->state() == detail::FSDPParamGroup::State::Sharded;
    if (sharded) detail::make_fsdp_module(s).unshard();
    impl_->gathered_here.push_back(sharded);
    if (sharded && !impl_->holds_full) s->group()->reshard();
    detail::summoned_states().insert(s.get());
  }
  impl_->states = std::move(states);

  torch::NoGradGuard no_grad;
  for (const auto& item : module.named_parameters()) {
    at::Tensor t = item.value();
    if (detail::FSDPParam* fp = detail::param_of_shard(t)) {
      if (impl_->holds_full && fp->is_unsharded()) t = fp->unsharded_param();
    } else {
      if (!writeback) impl_->saved.emplace_back(t, t.detach().clone());
      detail::summoned_params().insert(t.unsafeGetTensorImpl());
      impl_->held_params.push_back(t.unsafeGetTensorImpl());
    }
    if (offload_to_cpu && !t.is_cpu()) {
      at::Tensor copy = t.detach().to(c10::kCPU);
      impl_->cpu_copies.emplace_back(copy, t);
      t = copy;
    }
    params_.emplace_back(item.key(), t);
  }
}

SummonFullParams::SummonFullParams(SummonFullParams&& other) noexcept
    : impl_(std::move(other.impl_)), params_(std::move(other.params_)) {}

at::Tensor SummonFullParams::parameter(const std::string& name) const {
  for (const auto& [key, t] : params_) {
    if (key == name) return t;
  }
  throw std::out_of_range("fsdp::SummonFullParams: no parameter named '" + name + "'");
}

SummonFullParams::~SummonFullParams() {
  if (!impl_) return;  // moved from
  torch::NoGradGuard no_grad;
  if (impl_->writeback) {
    for (auto& [copy, target] : impl_->cpu_copies) target.detach().copy_(copy);
    // Each rank copies its rows of every full parameter into its shard.
    for (const auto& s : impl_->states) {
      if (!s->group()) continue;
      for (const auto& p : s->group()->params()) {
        if (!p->is_unsharded() || p->local_rows() == 0) continue;
        at::Tensor full = p->unsharded_param().detach();
        at::Tensor rows = full.dim() == 0 ? full.reshape({1}) : full;
        at::Tensor shard = p->sharded_param().detach();
        shard.copy_(rows.narrow(0, p->dim0_offset(), p->local_rows()).reshape(shard.sizes()));
      }
    }
  } else {
    for (auto& [param, value] : impl_->saved) param.detach().copy_(value);
  }
  for (size_t i = 0; i < impl_->states.size(); ++i) {
    auto& s = impl_->states[i];
    if (impl_->gathered_here[i] && impl_->holds_full && s->group()) s->group()->reshard();
    detail::summoned_states().erase(s.get());
  }
  for (const auto* p : impl_->held_params) detail::summoned_params().erase(p);
}

SummonFullParams summon_full_params(torch::nn::Module& module, bool writeback, bool rank0_only, bool offload_to_cpu) {
  return SummonFullParams(module, writeback, rank0_only, offload_to_cpu);
}

std::vector<std::pair<std::string, FSDPModule>> named_fsdp_modules(torch::nn::Module& module) {
  std::vector<std::pair<std::string, FSDPModule>> out;
  for (const auto& item : module.named_modules(/*name_prefix=*/"", /*include_self=*/true)) {
    if (auto unit = fsdp_module(*item.value())) out.emplace_back(item.key(), *unit);
  }
  return out;
}

std::vector<std::string> unit_parameter_names(const FSDPModule& unit) {
  std::vector<std::string> names;
  if (detail::state_of(unit)->group()) {
    for (const auto& p : detail::state_of(unit)->group()->params()) names.push_back(p->fqn());
  }
  return names;
}

int64_t full_parameter_bytes(torch::nn::Module& module) {
  int64_t bytes = 0;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters()) {
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (detail::FSDPParam* fp = detail::param_of_shard(p)) {
      if (fp->is_unsharded()) bytes += static_cast<int64_t>(fp->unsharded_param().nbytes());
    } else {
      bytes += static_cast<int64_t>(p.nbytes());
    }
  }
  return bytes;
}

}  // namespace fsdp
