#include "fsdp_param_group.h"

#include <c10/core/StreamGuard.h>
#include <torch/torch.h>

#include <optional>

#include "collectives.h"
#include "fsdp/debug/profiler.h"
#include "memory/buffer_alloc.h"
#include "phase_timers.h"

namespace fsdp::detail {

namespace {
// HSDP's mesh is (replicate, shard): the parameters are sharded over the last dimension.
DeviceMesh shard_dim(const DeviceMesh& mesh) { return mesh.ndim() == 1 ? mesh : mesh[mesh.dim_names().back()]; }
}  // namespace

FSDPParamGroup::FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, DeviceMesh mesh)
    : params_(std::move(params)),
      mesh_(std::move(mesh)),
      shard_mesh_(shard_dim(mesh_)),
      comm_(shard_mesh_.comm(0)),
      replicate_comm_(mesh_.ndim() == 2 ? mesh_.comm(0) : nullptr) {
  // fully_shard has checked that every parameter has one dtype and one device (before changing
  // anything), so the flat buffers below can hold them all.
  for (const auto& p : params_) {
    offsets_.push_back(total_shard_numel_);
    total_shard_numel_ += p->shard_numel();
  }
}

DeviceStreams* FSDPParamGroup::streams() const {
  return params_.empty() ? nullptr : DeviceStreams::get(params_.front()->device());
}

bool FSDPParamGroup::offloaded_grads() const {
  return !params_.empty() && params_.front()->shard_device().is_cpu() && !params_.front()->device().is_cpu();
}

void FSDPParamGroup::unshard(bool async_op, const c10::Event* after) {
  if (state_ != State::Sharded || params_.empty()) {
    if (params_.empty()) state_ = State::Unsharded;
    return;
  }
  const int n = comm_->size();
  const auto& first = params_.front()->padded_shard();
  // Copy-in: every padded shard side by side in one flat input, this rank's row of the output.
  // Copy-in casts to the compute dtype: with bf16 params the all-gather moves half the bytes.
  // On the compute device (a CPU-offloaded shard is copied there here).
  // On a GPU both buffers are allocated here, on the current stream, before the side streams wait
  // on it ([Note: FSDP streams]).
  const auto options = first.options().device(params_.front()->device()).dtype(params_.front()->compute_dtype());
  DeviceStreams* s = streams();
  if (direct_world_of_one()) {
    // Nothing to gather: the unsharded parameter is the shard's memory itself where dtype and
    // device agree (no copy, no allocation), else the shard is copied (cast) straight into its
    // unsharded storage, one pass, no all-gather buffers. Synchronous: a prefetch only moves it
    // earlier.
    torch::NoGradGuard no_grad;
    for (auto& p : params_) {
      if (p->alias_shard_as_unsharded()) continue;
      p->alloc_unsharded();
      p->copy_shard_to_unsharded();
    }
    // Counted as the all-gather it stands for (0 bytes), as a group of one's collective is.
    comm_->stats().record(comm::OpKind::AllGather, 0);
    comm::process_comm_stats().record(comm::OpKind::AllGather, 0);
    state_ = State::Unsharded;
    return;
  }
  if (!post_forward_shard_.defined() && gathers_pieces()) {
    // Per parameter: the rows go from the shards straight into the unsharded parameters
    // ([Note: FSDP's CPU collectives, per parameter]).
    GatherPieces pieces;
    {
      PhaseScope timed(Phase::CopyIn);  // allocating the unsharded parameters, packing the small shards
      const profiler::Range range("fsdp::copy_in", label);
      pieces = build_gather_pieces(params_, comm_->rank(), n);
    }
    {
      PhaseScope timed(Phase::AllGatherIssue);  // includes this rank's own rows, copied while the data moves
      const profiler::Range range("fsdp::all_gather", label);
      all_gather_work_ = comm_->all_gather_pieces(pieces.ins, pieces.outs, /*async_op=*/true);
    }
    gather_pieces_ = std::move(pieces);
    state_ = State::Unsharding;
    if (!async_op) wait_for_unshard();
    return;
  }
  all_gather_output_ = empty_buffer({n, total_shard_numel_}, options, BufferOwner::AllGatherOutput);
  if (post_forward_shard_.defined()) {
    // Backward after an integer reshard: the k ranks of the post-forward group hold, together,
    // every row of the [S, total] output (see the header).
    if (s) {
      DeviceStreams::wait_stream(s->all_gather, s->current());
      c10::StreamGuard on_all_gather(s->all_gather);
      all_gather_work_ =
          post_forward_comm->all_gather_into_tensor(all_gather_output_.view(-1), post_forward_shard_.view(-1), true);
    } else {
      all_gather_work_ =
          post_forward_comm->all_gather_into_tensor(all_gather_output_.view(-1), post_forward_shard_.view(-1), true);
    }
    state_ = State::Unsharding;
    if (!async_op) wait_for_unshard();
    return;
  }
  // In place: the input is this rank's row of the output (FSDP2's layout), no buffer of its own.
  at::Tensor input = all_gather_output_[comm_->rank()];
  auto copy_in = [&] {
    PhaseScope timed(Phase::CopyIn);
    const profiler::Range range("fsdp::copy_in", label);
    copy_in_all_gather_input(params_, offsets_, input);
  };
  if (s) {
    // The shards may have just been updated on the current stream (the optimizer): copy after it,
    // or after the post-optim event when the root was given one.
    if (after)
      DeviceStreams::wait_event(s->copy_in, *after);
    else
      DeviceStreams::wait_stream(s->copy_in, s->current());
    {
      c10::StreamGuard on_copy_in(s->copy_in);
      copy_in();
    }
    DeviceStreams::wait_stream(s->all_gather, s->copy_in);
    c10::StreamGuard on_all_gather(s->all_gather);
    PhaseScope timed(Phase::AllGatherIssue);
    const profiler::Range range("fsdp::all_gather", label);
    all_gather_work_ = comm_->all_gather_into_tensor(all_gather_output_.view(-1), input, /*async_op=*/true);
    all_gather_input_ = input;
  } else {
    copy_in();
    PhaseScope timed(Phase::AllGatherIssue);
    const profiler::Range range("fsdp::all_gather", label);
    all_gather_work_ = comm_->all_gather_into_tensor(all_gather_output_.view(-1), input, /*async_op=*/true);
  }
  state_ = State::Unsharding;
  if (!async_op) wait_for_unshard();
}

void FSDPParamGroup::wait_for_unshard() {
  if (state_ == State::Sharded) unshard(/*async_op=*/false);
  if (state_ != State::Unsharding) return;
  if (DeviceStreams* s = streams()) {
    // NCCL: the all-gather stream waits for the collective (no host wait); then the current
    // stream waits for the all-gather stream before it copies the rows out.
    {
      c10::StreamGuard on_all_gather(s->all_gather);
      PhaseScope timed(Phase::AllGatherWait);
      const profiler::Range range("fsdp::all_gather_wait", label);
      all_gather_work_.wait();
    }
    s->current_waits_for_all_gather();
  } else {
    PhaseScope timed(Phase::AllGatherWait);
    const profiler::Range range("fsdp::all_gather_wait", label);
    all_gather_work_.wait();
  }
  if (gather_pieces_) {
    {
      PhaseScope timed(Phase::CopyOut);  // the packed small shards only
      const profiler::Range range("fsdp::copy_out", label);
      copy_out_gather_pieces(*gather_pieces_);
    }
    all_gather_work_ = comm::Work();
    release_buffer(gather_pieces_->packed);
    gather_pieces_.reset();
    post_forward_shard_ = at::Tensor();
    state_ = State::Unsharded;
    return;
  }
  {
    PhaseScope timed(Phase::CopyOut);
    const profiler::Range range("fsdp::copy_out", label);
    copy_out_all_gather_output(params_, offsets_, all_gather_output_, total_shard_numel_);
  }
  // Freed: only the unsharded parameters hold the data now. On a GPU the current stream has waited
  // for every stream that used these buffers, and they were allocated on it. On the CPU the memory
  // goes back now, not when Gloo's worker thread drops the finished work (release_buffer).
  all_gather_work_ = comm::Work();
  release_buffer(all_gather_output_);
  all_gather_input_ = at::Tensor();
  post_forward_shard_ = at::Tensor();
  state_ = State::Unsharded;
}

void FSDPParamGroup::reshard() {
  if (state_ == State::Unsharding) wait_for_unshard();  // a gather in flight cannot be cancelled
  post_forward_shard_ = at::Tensor();
  if (state_ != State::Unsharded) return;
  PhaseScope timed(Phase::Reshard);
  const profiler::Range range("fsdp::reshard", label);
  for (auto& p : params_) p->free_unsharded();
  state_ = State::Sharded;
}

void FSDPParamGroup::reshard_post_forward() {
  if (state_ == State::Unsharding) wait_for_unshard();
  if (!post_forward_comm || state_ != State::Unsharded) return reshard();
  // This rank stands for shard ranks [g*m, (g+1)*m) within its k-group, m = S/k, g its rank there.
  const int64_t m = comm_->size() / post_forward_comm->size();
  const int first_rank = static_cast<int>(post_forward_comm->rank() * m);
  const auto& p0 = params_.front();
  at::Tensor kept = empty_buffer({m, total_shard_numel_},
                                 p0->padded_shard().options().device(p0->device()).dtype(p0->compute_dtype()),
                                 BufferOwner::PostForwardShards);
  copy_in_post_forward(params_, offsets_, kept, first_rank);
  reshard();
  post_forward_shard_ = std::move(kept);
}

void FSDPParamGroup::post_backward() {
  if (!requires_gradient_sync) {
    // No sync: the unsharded gradients are kept (in reduce_dtype) and keep accumulating.
    for (auto& p : params_) p->accumulate_unsharded_grad();
    if (reshard_after_backward) reshard();
    return;
  }
  const profiler::Range range("fsdp::post_backward_reduce_scatter", label);
  if (has_pending_reduce()) finish_reduce();
  // Only parameters that received a gradient take part (the same ones on every rank).
  std::vector<std::pair<FSDPParam*, at::Tensor>> with_grad;
  int64_t total = 0;
  for (auto& p : params_) {
    at::Tensor g = p->take_unsharded_grad();
    if (!g.defined()) continue;
    with_grad.emplace_back(p.get(), g);
    total += p->shard_numel();
  }
  // The parameters are no longer needed once their gradients exist: freed before the
  // reduce-scatter input is allocated, so the two are never alive together.
  if (reshard_after_backward) reshard();
  if (with_grad.empty()) return;
  if (direct_world_of_one()) {
    // Nothing to reduce: each gradient becomes (or is added to) the sharded gradient as it is.
    for (auto& [p, g] : with_grad) p->accumulate_full_grad(std::move(g), gradient_divide_factor);
    comm_->stats().record(comm::OpKind::ReduceScatter, 0);
    comm::process_comm_stats().record(comm::OpKind::ReduceScatter, 0);
    return;
  }
  // Default: average over the data-parallel ranks. A custom factor: sum, then divide by it.
  const auto op = gradient_divide_factor ? comm::ReduceOp::Sum : comm::ReduceOp::Avg;
  if (reduces_pieces(with_grad)) {
    // Per parameter: each gradient's rows are sent from the gradient, this rank's rows of it
    // become the reduced shard ([Note: FSDP's CPU collectives, per parameter]).
    ReducePieces pieces;
    {
      PhaseScope timed(Phase::ReduceScatterInput);  // views, and packing the small gradients
      pieces = build_reduce_pieces(with_grad, comm_->rank(), comm_->size());
    }
    pending_divide_ = gradient_divide_factor;
    {
      PhaseScope timed(Phase::ReduceScatterIssue);
      reduce_work_ = comm_->reduce_scatter_pieces(pieces.outs, pieces.ins, op, /*async_op=*/true);
    }
    reduce_pieces_ = std::move(pieces);
    return;
  }
  // The reduce-scatter runs in reduce_dtype (the input is cast to it); the unsharded gradients
  // are consumed: each is freed once it is in the input, as FSDP2 does.
  const auto reduce_dtype = with_grad.front().first->reduce_dtype();
  at::Tensor input;
  {
    PhaseScope timed(Phase::ReduceScatterInput);
    input = build_reduce_scatter_input(with_grad, comm_->size(), reduce_dtype, reduced_params_);
  }
  // On the CPU the output is this rank's row of the input (in place, no buffer of its own: the
  // reduce-scatter in flight holds one unit of input + Gloo's scratch of 1/N); a GPU's gets its own.
  DeviceStreams* s = streams();
  reduce_output_ = s ? empty_buffer({total}, input.options(), BufferOwner::ReduceScatterOutput) : input[comm_->rank()];
  reduce_input_ = input;
  pending_divide_ = gradient_divide_factor;
  if (s) {
    // The input was written on the current stream; the reduce-scatter stream waits for it, and the
    // collective then overlaps the backward of the units still to come.
    DeviceStreams::wait_stream(s->reduce_scatter, s->current());
    c10::StreamGuard on_reduce_scatter(s->reduce_scatter);
    PhaseScope timed(Phase::ReduceScatterIssue);
    reduce_work_ = comm_->reduce_scatter_tensor(reduce_output_, input.view(-1), op, /*async_op=*/true);
  } else {
    PhaseScope timed(Phase::ReduceScatterIssue);
    reduce_work_ = comm_->reduce_scatter_tensor(reduce_output_, input.view(-1), op, /*async_op=*/true);
  }
}

void FSDPParamGroup::start_all_reduce() {
  DeviceStreams* s = streams();
  // On a GPU the partial sums are kept and added on the reduce-scatter stream, after the
  // collective (a stream wait, no host wait on NCCL).
  std::optional<c10::StreamGuard> on_reduce_scatter;
  if (s) on_reduce_scatter.emplace(s->reduce_scatter);
  {
    PhaseScope timed(Phase::ReduceScatterWait);
    reduce_work_.wait();
  }
  reduce_work_ = comm::Work();
  if (!requires_all_reduce) {
    // Partial (shard group only) sums wait for the next all-reduce; nothing reaches .grad yet.
    for (auto& [p, offset] : reduced_params_) p->stash_partial_reduce(reduce_output_, offset);
    reduced_params_.clear();
    if (s) {
      on_reduce_scatter.reset();
      // The buffers were allocated on the current stream: it waits before they are released.
      DeviceStreams::wait_stream(s->current(), s->reduce_scatter);
    }
    reduce_output_ = at::Tensor();
    release_buffer(reduce_input_);
    return;
  }
  for (auto& [p, offset] : reduced_params_) p->add_partial_reduce(reduce_output_, offset);
  // The reduce-scatter averaged over the S shard ranks; averaging over the R replicas makes the
  // division R * S in total, FSDP2's factor for HSDP. A custom factor divides the plain sum.
  const auto op = pending_divide_ ? comm::ReduceOp::Sum : comm::ReduceOp::Avg;
  if (s) {
    on_reduce_scatter.reset();
    DeviceStreams::wait_stream(s->all_reduce, s->reduce_scatter);
    c10::StreamGuard on_all_reduce(s->all_reduce);
    reduce_work_ = replicate_comm_->all_reduce(reduce_output_, op, /*async_op=*/true);
  } else {
    reduce_work_ = replicate_comm_->all_reduce(reduce_output_, op, /*async_op=*/true);
  }
  all_reduce_started_ = true;
}

void FSDPParamGroup::advance_reduce() {
  if (needs_all_reduce_start())
    start_all_reduce();
  else
    finish_reduce();
}

bool FSDPParamGroup::gathers_pieces() const {
  return !streams() && comm_->size() > 1 && comm_->takes_pieces(params_.front()->padded_shard()) &&
         gathers_per_parameter(params_);
}

bool FSDPParamGroup::reduces_pieces(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads) const {
  return !streams() && !replicate_comm_ && comm_->size() > 1 && !grads.empty() &&
         comm_->takes_pieces(grads.front().second) && reduces_per_parameter(grads);
}

void FSDPParamGroup::finish_reduce_pieces() {
  {
    PhaseScope timed(Phase::ReduceScatterWait);
    reduce_work_.wait();
  }
  reduce_work_ = comm::Work();
  if (pending_divide_) {
    for (auto& out : reduce_pieces_->outs) out.div_(*pending_divide_);
  }
  {
    PhaseScope timed(Phase::GradAccumulate);
    for (auto& [p, where] : reduce_pieces_->results) p->accumulate_sharded_grad(where.first, where.second);
  }
  release_reduce_pieces(*reduce_pieces_);
  reduce_pieces_.reset();
}

void FSDPParamGroup::finish_reduce() {
  const profiler::Range range("fsdp::reduce_scatter_wait", label);
  if (needs_all_reduce_start()) start_all_reduce();
  if (!has_pending_reduce()) return;
  if (reduce_pieces_) return finish_reduce_pieces();
  at::Tensor reduced = reduce_output_;
  if (DeviceStreams* s = streams()) {
    const c10::Stream& side = all_reduce_started_ ? s->all_reduce : s->reduce_scatter;
    {
      c10::StreamGuard on_side(side);
      PhaseScope timed(Phase::ReduceScatterWait);
      reduce_work_.wait();
    }
    DeviceStreams::wait_stream(s->current(), side);
    if (pending_divide_) reduced.div_(*pending_divide_);
    if (offloaded_grads()) {
      // CPU offload: the gradients go back to pinned host memory, where the optimizer reads them
      // right after backward, so the host waits for this copy.
      at::Tensor host = at::empty(reduced.sizes(), reduced.options().device(at::kCPU).pinned_memory(true));
      host.copy_(reduced, /*non_blocking=*/true);
      DeviceStreams::synchronize(s->current());
      reduced = host;
    }
  } else {
    {
      PhaseScope timed(Phase::ReduceScatterWait);
      reduce_work_.wait();
    }
    reduce_work_ = comm::Work();  // the backend's scratch is freed now
    if (pending_divide_) reduced.div_(*pending_divide_);
  }
  reduce_work_ = comm::Work();
  all_reduce_started_ = false;
  PhaseScope timed(Phase::GradAccumulate);
  for (auto& [p, offset] : reduced_params_) p->accumulate_sharded_grad(reduced, offset);
  reduced_params_.clear();
  reduced = at::Tensor();
  reduce_output_ = at::Tensor();  // on the CPU a view of the input: released with it
  release_buffer(reduce_input_);
}

}  // namespace fsdp::detail
