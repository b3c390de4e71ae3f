#include "reducer.h"

#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "autograd_hooks.h"
#include "phase_timers.h"

namespace fsdp::detail {

Reducer::Reducer(std::vector<at::Tensor> params, std::shared_ptr<comm::Comm> comm, int64_t bucket_cap_bytes,
                 int64_t first_bucket_cap_bytes)
    : params_(std::move(params)), comm_(std::move(comm)) {
  bucket_of_.resize(params_.size());
  slot_of_.resize(params_.size());
  ready_.assign(params_.size(), false);
  world_ = comm_->size();
  divide_ = world_ > 1 && !comm_->capabilities().avg;
  // Reverse order: the last layers' gradients are ready first, so their bucket goes out first.
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k];
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    bool fresh = buckets_.empty();
    if (!fresh) {
      const Bucket& b = buckets_.back();
      const at::Tensor& first = params_[b.params.front()];
      const int64_t cap = buckets_.size() == 1 ? std::min(first_bucket_cap_bytes, bucket_cap_bytes) : bucket_cap_bytes;
      fresh = first.scalar_type() != p.scalar_type() || first.device() != p.device() ||
              (b.numel * static_cast<int64_t>(first.element_size()) + bytes > cap);
    }
    if (fresh) buckets_.emplace_back();
    Bucket& b = buckets_.back();
    bucket_of_[k] = buckets_.size() - 1;
    slot_of_[k] = b.params.size();
    b.params.push_back(k);
    b.offsets.push_back(b.numel);
    b.numel += p.numel();
  }
  reset();
}

void Reducer::install_hooks() {
  std::weak_ptr<Reducer> weak = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    grad_accumulators_.push_back(register_grad_accumulated_hook(params_[i], [weak, i] {
      if (auto self = weak.lock()) self->on_grad_ready(i);
    }));
  }
}

void Reducer::reset() {
  ready_.assign(params_.size(), false);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work = comm::Work();
    b.launched = false;
  }
  next_bucket_ = 0;
  callback_queued_ = false;
}

void Reducer::on_grad_ready(size_t index) {
  if (!requires_gradient_sync) return;  // no-sync: .grad keeps accumulating locally
  PhaseScope timed(Phase::Hooks);
  if (!callback_queued_) {
    callback_queued_ = true;
    std::weak_ptr<Reducer> weak = weak_from_this();
    queue_final_callback([weak] {
      if (auto self = weak.lock()) self->finalize();
    });
  }
  if (ready_[index]) return;
  ready_[index] = true;
  fill_slot(index);
  --buckets_[bucket_of_[index]].pending;
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) launch(buckets_[next_bucket_++]);
}

void Reducer::allocate(Bucket& b) {
  if (b.flat.defined()) return;
  const at::Tensor& first = params_[b.params.front()];
  b.flat = at::empty({b.numel}, first.options().requires_grad(false));
  b.divisor = at::scalar_tensor(static_cast<double>(world_), b.flat.options());
  for (size_t j = 0; j < b.params.size(); ++j) {
    // set_ rather than narrow().view(): the same memory without an autograd view, which
    // LibTorch 1.13's Optimizer::zero_grad() could not detach_().
    const at::Tensor& p = params_[b.params[j]];
    at::Tensor slot = at::empty({0}, b.flat.options());
    std::vector<int64_t> strides(p.dim(), 1);  // contiguous
    for (int64_t d = p.dim() - 1; d > 0; --d) strides[d - 1] = strides[d] * p.size(d);
    slot.set_(b.flat.storage(), b.flat.storage_offset() + b.offsets[j], p.sizes(), strides);
    b.slots.push_back(slot);
  }
}

void Reducer::fill_slot(size_t index) {
  torch::NoGradGuard no_grad;
  Bucket& b = buckets_[bucket_of_[index]];
  PhaseScope timed(Phase::ReduceScatterInput);  // the reduce-scatter input's counterpart (reducer.h)
  allocate(b);
  at::Tensor& g = params_[index].mutable_grad();
  at::Tensor slot = b.slots[slot_of_[index]];  // a handle (div_out writes through it)
  if (!g.defined()) {
    slot.zero_();  // no gradient here this time; another rank may have one
    return;
  }
  if (g.data_ptr() == slot.data_ptr() && g.sizes() == slot.sizes() && g.strides() == slot.strides()) {
    if (divide_) slot.div_(b.divisor);  // backward accumulated into the bucket
    return;
  }
  if (divide_ && g.layout() == at::kStrided && g.scalar_type() == slot.scalar_type()) {
    at::div_out(slot, g, b.divisor);  // one pass: the copy divides
  } else {
    slot.copy_(g);
    if (divide_) slot.div_(b.divisor);
  }
  g = slot;
}

void Reducer::launch(Bucket& b) {
  // Parameters backward did not reach this time: what .grad holds (no-sync accumulation), or zeros.
  for (size_t index : b.params) {
    if (!ready_[index]) fill_slot(index);
  }
  allocate(b);
  PhaseScope timed(Phase::ReduceScatterIssue);
  b.work = comm_->all_reduce(b.flat, divide_ ? comm::ReduceOp::Sum : comm::ReduceOp::Avg, /*async_op=*/true);
  b.launched = true;
}

void Reducer::finalize() {
  PhaseScope timed(Phase::Hooks);
  while (next_bucket_ < buckets_.size()) launch(buckets_[next_bucket_++]);
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    {
      PhaseScope waiting(Phase::ReduceScatterWait);
      b.work.wait();  // the average, in place: the gradients that are slots hold it already
    }
    for (size_t j = 0; j < b.params.size(); ++j) {
      at::Tensor& g = params_[b.params[j]].mutable_grad();
      // No gradient here this time: take the average only if some rank had one (the same
      // decision on every rank).
      if (!g.defined() && b.slots[j].ne(0).any().item<bool>()) g = b.slots[j];
    }
  }
  reset();
}

}  // namespace fsdp::detail
