#include "fsdp_state.h"

#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "autograd_hooks.h"
#include "fsdp/debug/profiler.h"
#include "fsdp/sharding/call.h"
#include "memory/buffer_alloc.h"
#include "phase_timers.h"
#include "recompute.h"
#include "registry.h"

namespace fsdp::detail {

namespace {
// FSDP_REDUCE_SCATTER_OVERLAP (read once): 1 (default) lets a unit's reduce-scatter run during the
// next unit's backward; 0 finishes it before the next unit's parameters are gathered (one unit's
// reduce-scatter buffers fewer at FSDP's peak, the exchange no longer hidden behind compute; since
// the pool's cache is trimmed after forward the default reaches the same peak: docs/benchmarks.md,
// "Memory").
bool reduce_scatter_overlaps() {
  static const bool overlap = [] {
    const char* v = std::getenv("FSDP_REDUCE_SCATTER_OVERLAP");
    if (v == nullptr || std::string(v).empty() || std::string(v) == "1") return true;
    if (std::string(v) == "0") return false;
    throw std::invalid_argument(std::string("fsdp: FSDP_REDUCE_SCATTER_OVERLAP='") + v +
                                "' is not 0 or 1; use 1 (overlap the reduce-scatter with the next backward, the "
                                "default) or 0 (finish it first: less memory)");
  }();
  return overlap;
}
}  // namespace

FSDPState::FSDPState(std::vector<std::shared_ptr<torch::nn::Module>> modules, std::unique_ptr<FSDPParamGroup> group,
                     std::optional<bool> reshard_after_forward, MixedPrecisionPolicy mp_policy)
    : group_(std::move(group)), reshard_after_forward_option_(reshard_after_forward), mp_policy_(mp_policy) {
  for (auto& m : modules) {
    modules_.push_back(m.get());
    module_refs_.push_back(m);
  }
  if (group_) {
    for (auto& p : group_->params()) register_param(p.get(), this);
  }
}

FSDPState::~FSDPState() { unregister_params_of(this); }

std::vector<FSDPState*> FSDPState::subtree_states() const {
  std::vector<FSDPState*> out{const_cast<FSDPState*>(this)};
  for (auto* root : modules_) {
    for (const auto& m : root->modules(/*include_self=*/false)) {
      auto s = lookup_state(m.get());
      if (s && std::find(out.begin(), out.end(), s.get()) == out.end()) out.push_back(s.get());
    }
  }
  return out;
}

void FSDPState::set_reshard_after_forward(bool reshard) {
  reshard_after_forward_option_ = reshard;
  if (group_) {
    group_->reshard_after_forward = reshard;
    group_->post_forward_comm = nullptr;  // a bool replaces an integer setting: full reshard
    group_->discard_post_forward();
  }
}

void FSDPState::lazy_init_as_root() {
  ctx_ = std::make_shared<RootContext>();
  is_root_ = true;
  ctx_->states = subtree_states();
  for (FSDPState* s : ctx_->states) {
    if (s != this) {
      if (s->is_root_.value_or(false)) {
        throw std::logic_error(
            "fsdp: a sharded submodule ran forward on its own before its root; apply fully_shard bottom-up "
            "(children, then the root) and run the first forward through the root");
      }
      s->is_root_ = false;
      s->ctx_ = ctx_;
    }
    // Unset reshard_after_forward: the root keeps its parameters for backward (they would be
    // gathered again right away), every other unit frees them.
    if (s->group_) s->group_->reshard_after_forward = s->reshard_after_forward_option_.value_or(s != this);
  }
  // Names relative to the root, as FSDP2 sets them at lazy init.
  for (auto* m : modules_) {
    for (const auto& item : m->named_parameters(/*recurse=*/true)) {
      if (FSDPParam* p = param_of_shard(item.value())) p->set_fqn(item.key());
    }
  }
  // Each unit's name in profiler ranges: its modules' paths from the root ("root" for the root).
  std::unordered_map<const torch::nn::Module*, std::string> paths;
  for (auto* m : modules_) {
    for (const auto& item : m->named_modules()) paths.emplace(item.value().get(), item.key());
  }
  for (FSDPState* s : ctx_->states) {
    std::string label;
    for (const auto* m : s->modules_) {
      auto it = paths.find(m);
      const std::string name = it == paths.end() || it->second.empty() ? "root" : it->second;
      label += (label.empty() ? "" : ",") + name;
    }
    s->label_ = label;
    if (s->group_) s->group_->label = label;
  }
}

void FSDPState::root_pre_forward() {
  // Reductions left pending by a backward that was not the last one must land before parameters
  // are read again (an optimizer step may sit between).
  for (FSDPParamGroup* g : ctx_->pending_reduces) g->finish_reduce();
  ctx_->pending_reduces.clear();
  // Post-forward shards left by a forward without backward (eval) may predate an optimizer step.
  for (FSDPState* s : ctx_->states) {
    if (s->group_) s->group_->discard_post_forward();
  }
  // Swapped, not moved: both vectors keep their capacity, so recording the order allocates
  // nothing from the second step on.
  if (!ctx_->forward_order.empty()) std::swap(ctx_->previous_forward_order, ctx_->forward_order);
  ctx_->forward_order.clear();
  ctx_->post_forward_order.clear();
}

FSDPState* FSDPState::neighbour(const std::vector<FSDPState*>& order, int step) const {
  auto it = std::find(order.begin(), order.end(), this);
  if (it == order.end()) return nullptr;
  const auto idx = (it - order.begin()) + step;
  if (idx < 0 || idx >= static_cast<long>(order.size())) return nullptr;
  return order[static_cast<size_t>(idx)];
}

bool FSDPState::is_last_in(const std::vector<FSDPState*>& order) const {
  return !order.empty() && order.back() == this;
}

void FSDPState::trim_pool(bool BufferPoolOptions::*when) {
  const BufferPoolOptions options = buffer_pool_options();
  if (!(options.*when)) return;
  PhaseScope timed(Phase::PoolTrim);
  trim_cached_buffers(options.trim_min_bytes);
}

std::vector<at::Tensor> FSDPState::pre_recompute(std::vector<at::Tensor> args) {
  // Activation checkpointing runs this unit's forward again inside its backward: the parameters
  // are gathered as for backward (the unit after it prefetched them); no forward prefetch and no
  // change to the forward order; the post-backward hook is registered on the recompute's inputs.
  if (!ctx_) {
    throw std::logic_error(
        "fsdp: a sharded unit is recomputed (activation checkpointing) before it ever ran forward through "
        "fsdp::call; run the forward through the root first");
  }
  const bool first_call = forward_calls_ == 0;
  if (group_) group_->wait_for_unshard();
  cast_forward_inputs(args);
  if (!first_call) return args;
  return register_post_backward_hook(this, std::move(args));
}

void FSDPState::cast_forward_inputs(std::vector<at::Tensor>& args) const {
  if (mp_policy_.cast_forward_inputs && mp_policy_.param_dtype) {
    for (auto& a : args) {
      if (a.defined() && at::isFloatingType(a.scalar_type()) && a.scalar_type() != *mp_policy_.param_dtype) {
        a = a.to(*mp_policy_.param_dtype);
      }
    }
  }
}

std::vector<at::Tensor> FSDPState::pre_forward(std::vector<at::Tensor> args) {
  PhaseScope timed(Phase::Hooks);
  if (in_recompute()) return pre_recompute(std::move(args));
  if (!is_root_.has_value()) lazy_init_as_root();
  if (is_root() && training_ == Training::Idle && forward_calls_ == 0) root_pre_forward();
  const bool first_call = forward_calls_ == 0;
  training_ = Training::Forward;
  if (group_) {
    for (auto& p : group_->params()) p->check_unchanged();
    const profiler::Range range("fsdp::pre_forward_all_gather", label_);
    if (post_optim_event && first_call && group_->state() == FSDPParamGroup::State::Sharded) {
      group_->unshard(/*async_op=*/true, post_optim_event.get());  // ordered after the optimizer step
    }
    group_->wait_for_unshard();  // issues the all-gather first unless a prefetch did
  }
  if (first_call) {
    post_optim_event.reset();
    ctx_->forward_order.push_back(this);
    // Overlap: start the next unit's all-gather now, so it runs while this unit computes.
    auto prefetch = [](FSDPState* t) {
      if (t->group_) t->group_->unshard(/*async_op=*/true);
    };
    if (has_explicit_forward_prefetch) {
      for (FSDPState* t : explicit_forward_prefetch) prefetch(t);
    } else if (FSDPState* next = neighbour(ctx_->previous_forward_order, +1)) {
      prefetch(next);
    }
    // The last unit of forward (last in the previous step's order, so known from the second step
    // on; an explicit prefetch list does not change which unit that is): the activations are near
    // their largest from here until backward frees them, and every block in the pool's cache
    // waits for backward. Its pages go back now (BufferPoolOptions).
    if (!is_root() && is_last_in(ctx_->previous_forward_order)) trim_pool(&BufferPoolOptions::trim_after_forward);
  }
  cast_forward_inputs(args);
  // List form: one post-backward node, on the inputs of the group's first module, so it runs
  // after the whole group's backward (FSDP2 registers the group's hooks the same way).
  if (!first_call) return args;
  return register_post_backward_hook(this, std::move(args));
}

void FSDPState::post_forward(std::vector<at::Tensor>& outputs) {
  PhaseScope timed(Phase::Hooks);
  if (++forward_calls_ < modules_.size()) return;  // list form: after the last module of the group
  forward_calls_ = 0;
  // In a recompute the unit's backward follows at once: keep the parameters (post_backward reshards).
  if (group_ && group_->reshard_after_forward && !in_recompute()) group_->reshard_post_forward();
  auto& post_order = ctx_->post_forward_order;
  if (!in_recompute() && std::find(post_order.begin(), post_order.end(), this) == post_order.end()) {
    post_order.push_back(this);
  }
  if (mp_policy_.output_dtype) {
    for (auto& o : outputs) {
      if (o.defined() && at::isFloatingType(o.scalar_type())) o = o.to(*mp_policy_.output_dtype);
    }
  }
  register_pre_backward_hooks(this, outputs);
  training_ = Training::Idle;
  // The root's forward is done: the activations are at their largest until the first unit's
  // backward has run, and the pool's cache holds blocks backward needs only later (or not before
  // the next forward). Its pages go back now; the blocks stay mapped (BufferPoolOptions).
  if (is_root() && !in_recompute()) trim_pool(&BufferPoolOptions::trim_after_forward);
}

void FSDPState::abort_forward() noexcept {
  forward_calls_ = 0;
  training_ = Training::Idle;
}

void FSDPState::pre_backward() {
  PhaseScope timed(Phase::Hooks);
  if (training_ == Training::PreBackward || training_ == Training::PostBackward) return;
  if (!ctx_->final_callback_queued) {
    ctx_->final_callback_queued = true;
    FSDPState* root = ctx_->states.front();
    queue_final_callback([root] { root->final_callback(); });
  }
  training_ = Training::PreBackward;
  // Without overlap: the reductions in flight finish before this unit's parameters and the next
  // prefetch are allocated (the unit's own all-gather, prefetched earlier, is already in flight).
  if (!reduce_scatter_overlaps()) queue_reduce(nullptr);
  if (group_ && group_->unshard_in_backward) {
    const profiler::Range range("fsdp::pre_backward_all_gather", label_);
    group_->wait_for_unshard();
    group_->share_sharded_grads();
  }
  // Overlap: the unit whose forward ended just before this one's runs next in backward (for the
  // root, whose forward ends last: the last block). Not one that skips its backward all-gather.
  auto prefetch = [](FSDPState* t) {
    if (t->group_ && t->group_->unshard_in_backward && t->training_ != Training::PostBackward)
      t->group_->unshard(/*async_op=*/true);
  };
  if (has_explicit_backward_prefetch) {
    for (FSDPState* t : explicit_backward_prefetch) prefetch(t);
  } else if (FSDPState* prev = neighbour(ctx_->post_forward_order, -1)) {
    prefetch(prev);
  }
}

void FSDPState::queue_reduce(FSDPParamGroup* group) {
  // Keep at most one reduce-scatter in flight besides the new one: bounded memory, and the
  // older result is ready by the time the next unit's backward is done.
  // Under HSDP an older reduce-scatter moves on to its all-reduce here, which then stays in
  // flight during the next unit's backward (FSDP2's separate all-reduce stream).
  // group == nullptr: only the older ones move on (before a new reduce-scatter is issued).
  if (group) {
    auto& pending = ctx_->pending_reduces;
    if (group->has_pending_reduce() && std::find(pending.begin(), pending.end(), group) == pending.end()) {
      pending.push_back(group);
    }
    return;
  }
  // Compacted in place (no new vector per call).
  auto& pending = ctx_->pending_reduces;
  size_t kept = 0;
  for (FSDPParamGroup* g : pending) {
    g->advance_reduce();
    if (g->has_pending_reduce()) pending[kept++] = g;
  }
  pending.resize(kept);
}

void FSDPState::post_backward() {
  PhaseScope timed(Phase::Hooks);
  if (training_ == Training::PostBackward) return;
  training_ = Training::PostBackward;
  if (!group_) return;
  // The older reductions move on first, so their buffers are released before this unit's
  // reduce-scatter input is allocated (one unit's reduce-scatter buffers alive at a time).
  queue_reduce(nullptr);
  group_->post_backward();
  queue_reduce(group_.get());
}

void FSDPState::final_callback() {
  PhaseScope timed(Phase::Hooks);
  // Units whose post-backward hook never ran (inputs without grad, like the root's token ids):
  // same order on every rank, so their collectives match.
  for (FSDPState* s : ctx_->states) {
    if (s->training_ == Training::PreBackward) s->post_backward();
  }
  if (ctx_->is_last_backward) {
    for (FSDPParamGroup* g : ctx_->pending_reduces) g->finish_reduce();
    ctx_->pending_reduces.clear();
  }
  for (FSDPState* s : ctx_->states) {
    s->training_ = Training::Idle;
    s->forward_calls_ = 0;
    // Prefetched but unused, or kept for backward: free what reshard_after_backward asks to.
    if (s->group_ && s->group_->reshard_after_backward) s->group_->reshard();
    if (s->group_) s->group_->discard_post_forward();
  }
  ctx_->final_callback_queued = false;
  // Every reduction has been waited for and written into the gradients, and every unit resharded:
  // all of this backward's FSDP buffers are back in the pool, whose cache can go back to the kernel
  // before the optimizer step (BufferPoolOptions::trim_after_backward). Not while reductions stay
  // pending (a backward that is not the last one before the step): their buffers are still live.
  if (ctx_->pending_reduces.empty()) trim_pool(&BufferPoolOptions::trim_after_backward);
}

}  // namespace fsdp::detail
