#pragma once
// Reducer: fsdp::replicate's gradient all-reduce, in buckets that overlap backward (DDP's reducer).
//
// Buckets hold parameters in reverse registration order (about the order backward produces their
// gradients), one dtype per bucket, up to bucket_cap_bytes each (the first one smaller). A post-hook on each
// parameter's AccumulateGrad node marks the parameter ready once its .grad is final for this backward (so it includes
// what no-sync steps accumulated) and at once copies it into its slot of the bucket, divided by the group size (DDP's
// mark_variable_ready: the copy reads a gradient backward has just written, still in cache, and a fresh gradient is
// freed right away for backward's next allocation). When every parameter of the next bucket in order is ready, the
// bucket is all-reduced (a sum of the divided gradients: the average, with no divide left for after the wait)
// asynchronously. Buckets are launched strictly in index order, so every rank issues the same collectives in the same
// order. The final callback (queued on the autograd engine by the first hook, as FSDP's state does) launches what is
// left (parameters without a gradient this time contribute zeros) and waits. A backend that averages by itself
// (NCCL's AVG) gets the gradients undivided.
//
// Gradients as bucket views (DDP's gradient_as_bucket_view): each bucket's flat buffer lives as
// long as the reducer, and once a parameter's gradient has been copied into its slot, .grad *is*
// that slot (a tensor on the bucket's storage; not an autograd view, so LibTorch 1.13's
// zero_grad() may detach_() it). Later backwards accumulate straight into the bucket, which is
// divided in place and all-reduced in place, and nothing is copied back: one buffer per bucket for
// the whole run, no copy-in while zero_grad() zeroes in place (1.13), no copy-out, no allocation
// per step. A gradient that is not the slot (set_to_none, as 2.x's zero_grad() does, the first
// step, a user's assignment) is copied in (divided on the way) and replaced by the slot.
//
// The phase timers (fsdp/debug/phase_timers.h) time the reducer under the phases of the
// reduce-scatter it stands in for: filling a slot is ReduceScatterInput, issuing a bucket's
// all-reduce ReduceScatterIssue, waiting for it ReduceScatterWait, and the hooks and the final
// callback are Hooks, so bench's CPU split shows replicate's own time as it does FSDP's.
#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>

#include <memory>
#include <vector>

#include "fsdp/comm/comm.h"

namespace fsdp::detail {

class Reducer : public std::enable_shared_from_this<Reducer> {
 public:
  Reducer(std::vector<at::Tensor> params, std::shared_ptr<comm::Comm> comm, int64_t bucket_cap_bytes,
          int64_t first_bucket_cap_bytes);
  // Installs the hooks; separate from the constructor because they hold a weak reference to this.
  void install_hooks();

  bool requires_gradient_sync = true;
  size_t num_buckets() const { return buckets_.size(); }
  comm::Comm& comm() const { return *comm_; }

 private:
  struct Bucket {
    std::vector<size_t> params;    // indices into params_
    std::vector<int64_t> offsets;  // each parameter's start in the flat buffer
    int64_t numel = 0;
    size_t pending = 0;             // parameters not ready yet this backward
    at::Tensor flat;                // allocated on first use, kept: the gradients are slots of it
    at::Tensor divisor;             // world_ as a 0-dim tensor of flat's dtype and device
    std::vector<at::Tensor> slots;  // each parameter's gradient as a tensor on flat's storage
    comm::Work work;
    bool launched = false;
  };

  void on_grad_ready(size_t index);
  void allocate(Bucket& bucket);
  // The parameter's gradient into its slot (divided when divide_), and .grad made the slot.
  void fill_slot(size_t index);
  void launch(Bucket& bucket);
  void finalize();
  void reset();

  std::vector<at::Tensor> params_;
  std::shared_ptr<comm::Comm> comm_;
  std::vector<std::shared_ptr<void>> grad_accumulators_;  // kept alive: they hold the hooks
  std::vector<size_t> bucket_of_;
  std::vector<size_t> slot_of_;  // each parameter's position in its bucket
  int64_t world_ = 1;
  bool divide_ = false;  // divide each gradient by world_ before a sum (the backend has no AVG)
  std::vector<bool> ready_;
  std::vector<Bucket> buckets_;
  size_t next_bucket_ = 0;
  bool callback_queued_ = false;
};

}  // namespace fsdp::detail
