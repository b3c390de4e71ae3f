#include "fsdp_param_group.h"

#include <algorithm>

#include <c10/core/StreamGuard.h>
#include <torch/torch.h>

#include <optional>
#include <sstream>

#include "collectives.h"
#include "fsdp/comm/backend.h"
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
  if (!streams_known_) {
    streams_ = params_.empty() ? nullptr : DeviceStreams::get(params_.front()->device());
    streams_known_ = true;
  }
  return streams_;
}

bool FSDPParamGroup::collectives_current() const {
  const Collectives& c = collectives_;
  return c.chosen && c.options_epoch == cpu_collective_options_epoch() &&
         c.custom_all_gather == custom_all_gather.get() && c.custom_reduce_scatter == custom_reduce_scatter.get() &&
         c.post_forward_comm == post_forward_comm.get() && c.hook == static_cast<bool>(all_reduce_hook) &&
         c.first_shard == (params_.empty() ? nullptr : params_.front()->padded_shard().unsafeGetTensorImpl());
}

const FSDPParamGroup::Collectives& FSDPParamGroup::collectives() {
  if (!collectives_current()) choose_collectives();
  return collectives_;
}

void FSDPParamGroup::choose_collectives() {
  // [Note: a unit's collectives, chosen once] (fsdp_param_group.h). The options' count is read
  // first: a change while choosing makes the next call choose again.
  Collectives c;
  c.options_epoch = cpu_collective_options_epoch();
  c.custom_all_gather = custom_all_gather.get();
  c.custom_reduce_scatter = custom_reduce_scatter.get();
  c.post_forward_comm = post_forward_comm.get();
  c.first_shard = params_.empty() ? nullptr : params_.front()->padded_shard().unsafeGetTensorImpl();
  c.hook = static_cast<bool>(all_reduce_hook);
  c.all_gather = custom_all_gather ? custom_all_gather.get() : static_cast<AllGather*>(&own_all_gather_);
  c.reduce_scatter =
      custom_reduce_scatter ? custom_reduce_scatter.get() : static_cast<ReduceScatter*>(&own_reduce_scatter_);
  c.gather = params_.empty() || gathers_directly() ? GatherPath::Direct
             : gathers_pieces()                    ? GatherPath::Pieces
                                                   : GatherPath::Flat;
  // Per parameter on a CPU shard group of more than one without replicas, hook or custom
  // reduce-scatter, where each backward's gradients qualify (reduces_pieces).
  const bool pieces = !streams() && !replicate_comm_ && !all_reduce_hook && !custom_reduce_scatter && comm_->size() > 1;
  c.reduce = reduces_directly() ? ReducePath::Direct : pieces ? ReducePath::Pieces : ReducePath::Flat;
  c.chosen = true;
  collectives_ = c;
}

bool FSDPParamGroup::offloaded_grads() const {
  return !params_.empty() && params_.front()->shard_device().is_cpu() && !params_.front()->device().is_cpu();
}

c10::OptionalDeviceGuard FSDPParamGroup::device_guard() const {
  if (params_.empty() || !params_.front()->device().is_cuda()) return c10::OptionalDeviceGuard();
  return c10::OptionalDeviceGuard(params_.front()->device());
}

void FSDPParamGroup::unshard(bool async_op, const c10::Event* after) {
  if (state_ != State::Sharded || params_.empty()) {
    if (params_.empty()) state_ = State::Unsharded;
    return;
  }
  const auto on_device = device_guard();
  switch (gather_path()) {
    case GatherPath::Direct: return unshard_directly();
    case GatherPath::Pieces: issue_gather_pieces(); break;
    case GatherPath::PostForward: issue_post_forward_gather(); break;
    case GatherPath::Flat: issue_flat_gather(after); break;
  }
  state_ = State::Unsharding;
  if (!async_op) wait_for_unshard();
}

FSDPParamGroup::GatherPath FSDPParamGroup::gather_path() {
  const GatherPath chosen = collectives().gather;
  // Backward after an integer reshard_after_forward gathers within the post-forward group.
  if (chosen != GatherPath::Direct && post_forward_shard_.defined()) return GatherPath::PostForward;
  return chosen;
}

void FSDPParamGroup::unshard_directly() {
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
}

void FSDPParamGroup::issue_gather_pieces() {
  // Per parameter: the rows go from the shards straight into the unsharded parameters
  // ([Note: FSDP's CPU collectives, per parameter]).
  GatherPieces pieces;
  {
    PhaseScope timed(Phase::CopyIn);  // allocating the unsharded parameters, packing the small shards
    const profiler::Range range("fsdp::copy_in", label);
    pieces = build_gather_pieces(params_, comm_->rank(), comm_->size());
  }
  {
    PhaseScope timed(Phase::AllGatherIssue);  // includes this rank's own rows, copied while the data moves
    const profiler::Range range("fsdp::all_gather", label);
    all_gather_work_ = comm_->all_gather_pieces(pieces.ins, pieces.outs, /*async_op=*/true);
  }
  gather_pieces_ = std::move(pieces);
}

at::Tensor FSDPParamGroup::alloc_all_gather_output(const c10::Event* after) {
  // Copy-in casts to the compute dtype (with bf16 params the all-gather moves half the bytes), on
  // the compute device (a CPU-offloaded shard is copied there). On a GPU the output is allocated
  // here, on the current stream, before the side streams wait on it ([Note: FSDP streams]).
  // After the post-optim event, copy-in waits on that event only, not on the current stream: a
  // block of the current stream's pool may have been freed after the event while a kernel queued
  // after it still reads it, and copy-in would write under that reader. So the output (which
  // copy-in writes: the input is its row) comes from the all-gather stream's pool then, as
  // FSDP2's foreach_all_gather allocates it under the all-gather stream. It is released after the
  // current stream's copy-out; the next allocation from that pool is the next step's, after the
  // next event, which follows that copy-out.
  DeviceStreams* s = streams();
  std::optional<c10::StreamGuard> on_all_gather;
  if (s && after) on_all_gather.emplace(s->all_gather);
  const int64_t n = comm_->size();
  const auto& p0 = params_.front();
  const auto options = p0->padded_shard().options().device(p0->device()).dtype(p0->compute_dtype());
  if (custom_all_gather)
    return custom_buffer(/*all_gather=*/true, n * total_shard_numel_, options).view({n, total_shard_numel_});
  return empty_buffer({n, total_shard_numel_}, options, BufferOwner::AllGatherOutput);
}

void FSDPParamGroup::issue_post_forward_gather() {
  // Backward after an integer reshard: the k ranks of the post-forward group hold, together,
  // every row of the [S, total] output (see the header).
  all_gather_output_ = alloc_all_gather_output(/*after=*/nullptr);
  std::optional<c10::StreamGuard> on_all_gather;
  if (DeviceStreams* s = streams()) {
    DeviceStreams::wait_stream(s->all_gather, s->current());
    on_all_gather.emplace(s->all_gather);
  }
  all_gather_work_ =
      all_gather()(all_gather_output_.view(-1), post_forward_shard_.view(-1), *post_forward_comm, /*async_op=*/true);
}

bool FSDPParamGroup::place_shards_in_buffer() {
  if (shards_in_buffer() || !keeps_shards_in_buffer()) return false;
  // Once per unit (not a phase of its own: the phase timers count each copy-in once a gather).
  const profiler::Range range("fsdp::move_shards_to_buffer", label);
  move_shards_to_buffer();
  return true;
}

void FSDPParamGroup::issue_flat_gather(const c10::Event* after) {
  all_gather_output_ = alloc_all_gather_output(after);
  // In place: the input is this rank's row of the output (FSDP2's layout), no buffer of its own.
  const at::Tensor input = row_of(all_gather_output_, comm_->rank());
  // [Note: the shards in one buffer]: copy-in is one copy of the buffer (the cast inside). The
  // first all-gather moves the shards there, on the current stream.
  const bool moved = place_shards_in_buffer();
  const at::Tensor from_buffer = moved || shards_in_buffer() ? shard_buffer_ : at::Tensor();
  DeviceStreams* s = streams();
  std::optional<c10::StreamGuard> on_stream;
  if (s) {
    // The shards may have just been updated on the current stream (the optimizer): copy after it,
    // or after the post-optim event when the root was given one (not when they were just moved to
    // the buffer, on the current stream after that event).
    if (after && !moved)
      DeviceStreams::wait_event(s->copy_in, *after);
    else
      DeviceStreams::wait_stream(s->copy_in, s->current());
    on_stream.emplace(s->copy_in);
  }
  {
    PhaseScope timed(Phase::CopyIn);
    const profiler::Range range("fsdp::copy_in", label);
    copy_in_all_gather_input(params_, offsets_, input, from_buffer);
  }
  if (s) {
    on_stream.reset();
    DeviceStreams::wait_stream(s->all_gather, s->copy_in);
    on_stream.emplace(s->all_gather);
    all_gather_input_ = input;  // kept until the wait: the all-gather stream reads it
  }
  PhaseScope timed(Phase::AllGatherIssue);
  const profiler::Range range("fsdp::all_gather", label);
  all_gather_work_ = all_gather()(all_gather_output_.view(-1), input, *comm_, /*async_op=*/true);
}

at::Tensor FSDPParamGroup::custom_buffer(bool all_gather, int64_t numel, const at::TensorOptions& options) const {
  const at::ScalarType dtype = options.dtype().toScalarType();
  at::Tensor t = all_gather ? custom_all_gather->allocate({numel}, dtype, options.device())
                            : custom_reduce_scatter->allocate({numel}, dtype, options.device());
  if (!t.defined() || t.numel() != numel || t.scalar_type() != dtype || t.device() != options.device() ||
      !t.is_contiguous()) {
    std::ostringstream got;
    if (t.defined()) {
      got << t.numel() << " elements of " << t.scalar_type() << " on " << t.device()
          << (t.is_contiguous() ? "" : ", not contiguous");
    } else {
      got << "an undefined tensor";
    }
    throw std::runtime_error(std::string("fsdp: unit '") + label + "': the custom " +
                             (all_gather ? "all-gather" : "reduce-scatter") + "'s allocate returned " + got.str() +
                             "; FSDP asked for " + std::to_string(numel) + " elements of " + c10::toString(dtype) +
                             " on " + options.device().str() +
                             ": return a contiguous tensor of the sizes, dtype and device it is given");
  }
  return t;
}

void FSDPParamGroup::wait_for_unshard() {
  if (state_ == State::Sharded) unshard(/*async_op=*/false);
  if (state_ != State::Unsharding) return;
  const auto on_device = device_guard();
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

void FSDPParamGroup::reshard(bool keep_shapes) {
  if (state_ == State::Unsharding) wait_for_unshard();  // a gather in flight cannot be cancelled
  post_forward_shard_ = at::Tensor();
  if (state_ != State::Unsharded) {
    if (!keep_shapes) drop_kept_shapes();
    return;
  }
  const auto on_device = device_guard();
  PhaseScope timed(Phase::Reshard);
  const profiler::Range range("fsdp::reshard", label);
  for (auto& p : params_) p->free_unsharded(keep_shapes);
  state_ = State::Sharded;
}

void FSDPParamGroup::drop_kept_shapes() {
  for (auto& p : params_) p->drop_kept_shape();
}

void FSDPParamGroup::reshard_post_forward() {
  if (state_ == State::Unsharding) wait_for_unshard();
  // No backward all-gather: nothing kept for it, and the shapes stay for autograd's gradients.
  if (!unshard_in_backward) return reshard(/*keep_shapes=*/true);
  if (!post_forward_comm || state_ != State::Unsharded) return reshard();
  // This rank stands for shard ranks [g*m, (g+1)*m) within its k-group, m = S/k, g its rank there.
  const auto on_device = device_guard();
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

void FSDPParamGroup::share_sharded_grads() {
  // Autograd adds in place only with grad mode off (a backward without create_graph); with it on
  // it would replace the shared gradient by a new sum, which post_backward would add again.
  if (state_ != State::Unsharded || collectives().reduce != ReducePath::Direct || !requires_gradient_sync ||
      gradient_divide_factor || at::GradMode::is_enabled()) {
    return;
  }
  for (auto& p : params_) p->share_sharded_grad();
}

void FSDPParamGroup::post_backward() {
  const auto on_device = device_guard();
  if (!requires_gradient_sync) {
    // No sync: the unsharded gradients are kept (in reduce_dtype) and keep accumulating.
    for (auto& p : params_) p->accumulate_unsharded_grad();
    if (reshard_after_backward) reshard();
    return;
  }
  const profiler::Range range("fsdp::post_backward_reduce_scatter", label);
  if (has_pending_reduce()) finish_reduce();
  const bool shared = take_unsharded_grads();
  // The parameters are no longer needed once their gradients exist: freed before the
  // reduce-scatter input is allocated, so the two are never alive together.
  if (reshard_after_backward) reshard();
  if (taken_grads_.empty() && !shared) return;
  const ReducePath path = collectives().reduce;
  if (path == ReducePath::Direct) return hand_over_grads();
  if (taken_grads_.empty()) return;
  if (path == ReducePath::Pieces && reduces_pieces(taken_grads_)) return issue_reduce_pieces();
  issue_flat_reduce();
}

bool FSDPParamGroup::take_unsharded_grads() {
  // Only parameters that received a gradient take part (the same ones on every rank), listed in the
  // group's own vector, emptied after use: its capacity stays (no allocation per backward).
  taken_grads_.clear();
  bool shared = false;  // some gradient was accumulated by autograd into the sharded one
  for (auto& p : params_) {
    shared = shared || p->shares_sharded_grad();
    at::Tensor g = p->take_unsharded_grad();
    p->drop_kept_shape();  // [Note: unshard_in_backward]
    if (g.defined()) taken_grads_.emplace_back(p.get(), std::move(g));
  }
  return shared;
}

void FSDPParamGroup::hand_over_grads() {
  // Nothing to reduce: each gradient becomes (or is added to) the sharded gradient as it is.
  for (auto& [p, g] : taken_grads_) p->accumulate_full_grad(std::move(g), gradient_divide_factor);
  taken_grads_.clear();
  comm_->stats().record(comm::OpKind::ReduceScatter, 0);
  comm::process_comm_stats().record(comm::OpKind::ReduceScatter, 0);
}

comm::ReduceOp FSDPParamGroup::begin_reduce() {
  // Default: average over the data-parallel ranks. A custom factor, or sums forced: sum, then
  // divide (by the factor, or by the data-parallel size).
  pending_divide_ = post_divide();
  return pending_divide_ ? comm::ReduceOp::Sum : comm::ReduceOp::Avg;
}

void FSDPParamGroup::issue_reduce_pieces() {
  // Per parameter: each gradient's rows are sent from the gradient, this rank's rows of it
  // become the reduced shard ([Note: FSDP's CPU collectives, per parameter]).
  ReducePieces pieces;
  {
    PhaseScope timed(Phase::ReduceScatterInput);  // views, and packing the small gradients
    pieces = build_reduce_pieces(taken_grads_, comm_->rank(), comm_->size());
  }
  const comm::ReduceOp op = begin_reduce();
  {
    PhaseScope timed(Phase::ReduceScatterIssue);
    reduce_work_ = comm_->reduce_scatter_pieces(pieces.outs, pieces.ins, op, /*async_op=*/true);
  }
  reduce_pieces_ = std::move(pieces);
}

void FSDPParamGroup::issue_flat_reduce() {
  int64_t total = 0;
  for (const auto& [p, g] : taken_grads_) total += p->shard_numel();
  // The reduce-scatter runs in reduce_dtype (the input is cast to it); the unsharded gradients
  // are consumed: each is freed once it is in the input, as FSDP2 does.
  const auto reduce_dtype = taken_grads_.front().first->reduce_dtype();
  at::Tensor input;
  {
    PhaseScope timed(Phase::ReduceScatterInput);
    const profiler::Range range("fsdp::reduce_scatter_input", label);
    // A custom reduce-scatter's input comes from its allocate; otherwise (empty) from the pool.
    std::function<at::Tensor(int64_t, const at::TensorOptions&)> allocate;
    if (custom_reduce_scatter) {
      allocate = [this](int64_t numel, const at::TensorOptions& options) {
        return custom_buffer(/*all_gather=*/false, numel, options);
      };
    }
    input = build_reduce_scatter_input(taken_grads_, comm_->size(), reduce_dtype, reduced_params_, allocate);
  }
  // On the CPU the output is this rank's row of the input (in place, no buffer of its own: the
  // reduce-scatter in flight holds one unit of input + Gloo's scratch of 1/N); a GPU's gets its own.
  DeviceStreams* s = streams();
  reduce_output_ = custom_reduce_scatter ? custom_buffer(/*all_gather=*/false, total, input.options())
                   : s ? empty_buffer({total}, input.options(), BufferOwner::ReduceScatterOutput)
                                         : row_of(input, comm_->rank());
  reduce_input_ = input;
  const comm::ReduceOp op = begin_reduce();
  std::optional<c10::StreamGuard> on_reduce_scatter;
  if (s) {
    // The input was written on the current stream; the reduce-scatter stream waits for it, and the
    // collective then overlaps the backward of the units still to come.
    DeviceStreams::wait_stream(s->reduce_scatter, s->current());
    on_reduce_scatter.emplace(s->reduce_scatter);
  }
  {
    PhaseScope timed(Phase::ReduceScatterIssue);
    reduce_work_ = reduce_scatter()(reduce_output_, input.view(-1), *comm_, op, /*async_op=*/true);
  }
  on_reduce_scatter.reset();
  if (s) queue_post_reduce(*s);
}

void FSDPParamGroup::start_all_reduce() {
  // The CPU's HSDP (a GPU's is queued by queue_post_reduce): Gloo's collectives run on the host, so
  // the all-reduce can only start once the reduce-scatter has ended; started one unit later, it
  // overlaps that unit's backward.
  {
    PhaseScope timed(Phase::ReduceScatterWait);
    reduce_work_.wait();
  }
  reduce_work_ = comm::Work();
  if (!requires_all_reduce) {
    // Partial (shard group only) sums wait for the next all-reduce; nothing reaches .grad yet.
    for (auto& [p, offset] : reduced_params_) p->stash_partial_reduce(reduce_output_, offset);
    reduced_params_.clear();
    reduce_output_ = at::Tensor();
    release_buffer(reduce_input_);
    return;
  }
  for (auto& [p, offset] : reduced_params_) p->add_partial_reduce(reduce_output_, offset);
  // The reduce-scatter averaged over the S shard ranks; averaging over the R replicas makes the
  // division R * S in total, FSDP2's factor for HSDP. A custom factor divides the plain sum.
  const auto op = pending_divide_ ? comm::ReduceOp::Sum : comm::ReduceOp::Avg;
  reduce_work_ = replicate_comm_->all_reduce(reduce_output_, op, /*async_op=*/true);
  all_reduce_started_ = true;
}

// [Note: the all-reduce hook]
// FSDP2's set_all_reduce_hook: a user function called with a unit's reduce output once per synced
// backward, after the reduce-scatter (and, under HSDP, the all-reduce over the replicas) wrote it
// and the gradients were divided, before anything reaches .grad: the flat 1-D tensor of this
// rank's padded rows of every parameter that received a gradient (at their reduce-scatter
// offsets), in reduce_dtype. What the hook writes into it in place is what the sharded gradients
// become. Its uses: a replica dimension FSDP does not manage (1-D FSDP within a replica group, the
// hook averaging over the groups with a process group of its own, as torchft's fault-tolerant
// HSDP does), or reading the reduced gradients. It is not called where nothing is reduced:
// gradient sync off, or HSDP with requires_all_reduce off (those partial sums reach the hook with
// the all-reduce that includes them).
// Two paths change for it. The CPU's per-parameter reduce-scatter has no flat output, so a group
// with a hook reduces flat; a direct world of one hands its gradients over without reducing, so
// with a hook the group of one "reduces" (Comm's local copy) to give the hook its output. On the
// CPU the hook runs on the host where the reduction is waited for (the next unit's backward, or
// the end of backward). On a GPU it is called when post_backward queues the reduction, on
// all_reduce_hook_stream (default: the all-reduce stream), which first waits for the stream that
// wrote the output; the current stream waits for the hook's at the end of backward. A hook that
// issues collectives gets them in the same order on every rank, since every rank reduces its units
// in the same order. The hook always sees the divided gradients, also with sums forced
// (force_sum_reduction_for_comms), where FSDP2 calls it before its post-divide.
void FSDPParamGroup::queue_post_reduce(DeviceStreams& s) {
  // FSDP2's foreach_reduce after its reduce-scatter: every step below is queued on a side stream
  // in order (NCCL's Work::wait is a stream wait), the host waits for none of them, and the
  // current stream only at the end (finish_reduce).
  {
    c10::StreamGuard on_reduce_scatter(s.reduce_scatter);
    {
      PhaseScope timed(Phase::ReduceScatterWait);
      reduce_work_.wait();
    }
    reduce_work_ = comm::Work();
    if (!reduce_scatter_done_) reduce_scatter_done_.emplace(s.reduce_scatter.device_type());
    reduce_scatter_done_->record(s.reduce_scatter);
    if (replicate_comm_ && !requires_all_reduce) {
      // Partial (shard group only) sums wait for the next all-reduce; nothing reaches .grad yet.
      for (auto& [p, offset] : reduced_params_) p->stash_partial_reduce(reduce_output_, offset);
      reduced_params_.clear();
      post_reduce_stream_ = s.reduce_scatter;
      return;
    }
    if (replicate_comm_) {
      for (auto& [p, offset] : reduced_params_) p->add_partial_reduce(reduce_output_, offset);
    }
  }
  c10::Stream post = s.reduce_scatter;
  if (replicate_comm_) {
    // HSDP: the all-reduce over the replicas right after the reduce-scatter, on its own stream
    // (FSDP2's all_reduce_stream); the current stream waits for it at the end of backward. The
    // reduce-scatter averaged over the S shard ranks; averaging over the R replicas makes the
    // division R * S in total, FSDP2's factor for HSDP. A custom factor divides the plain sum.
    const auto op = pending_divide_ ? comm::ReduceOp::Sum : comm::ReduceOp::Avg;
    DeviceStreams::wait_stream(s.all_reduce, s.reduce_scatter);
    c10::StreamGuard on_all_reduce(s.all_reduce);
    reduce_work_ = replicate_comm_->all_reduce(reduce_output_, op, /*async_op=*/true);
    reduce_work_.wait();  // a stream wait: the all-reduce stream waits for NCCL's
    reduce_work_ = comm::Work();
    post = s.all_reduce;
  }
  post_reduce_stream_ = post;
  if (pending_divide_) {
    c10::StreamGuard on_post(post);
    reduce_output_.div_(*pending_divide_);
  }
  pending_divide_.reset();
  if (all_reduce_hook) {
    // [Note: the all-reduce hook]: on its stream, after everything above.
    const c10::Stream hook_stream = all_reduce_hook_stream.value_or(s.all_reduce);
    if (hook_stream != post) DeviceStreams::wait_stream(hook_stream, post);
    post = hook_stream;
    post_reduce_stream_ = post;
    c10::StreamGuard on_hook(hook_stream);
    all_reduce_hook(reduce_output_);
  }
  c10::StreamGuard on_post(post);
  if (offloaded_grads() && !reduced_params_.empty()) queue_offload_copy();
}

void FSDPParamGroup::queue_offload_copy() {
  // CPU offload: the reduced gradients go to pinned host memory with a non-blocking copy on this
  // stream (FSDP2's foreach_reduce with offload_to_cpu), cast to the shard dtype on the device
  // first; the host waits for it once, at the end of backward (finish_reduce). Where no gradient
  // exists yet the copy lands in a fresh pinned buffer (the host allocator's cache) that becomes
  // the gradients; else in the group's persistent pinned buffer, added to them then.
  const auto dtype = params_.front()->dtype();
  offload_source_ = reduce_output_.scalar_type() == dtype ? reduce_output_ : reduce_output_.to(dtype);
  bool none = true;
  for (auto& [p, offset] : reduced_params_) none = none && !p->sharded_param().grad().defined();
  const auto host_options = offload_source_.options().device(at::kCPU).pinned_memory(true);
  if (none) {
    offload_host_ = at::empty(offload_source_.sizes(), host_options);
  } else {
    if (!offload_staging_.defined() || offload_staging_.numel() < offload_source_.numel() ||
        offload_staging_.scalar_type() != dtype) {
      offload_staging_ = at::empty(offload_source_.sizes(), host_options);
    }
    offload_host_ = offload_staging_.narrow(0, 0, offload_source_.numel());
  }
  offload_adopt_ = none;
  offload_host_.copy_(offload_source_, /*non_blocking=*/true);
}

void FSDPParamGroup::release_reduce_input(DeviceStreams& s) {
  if (!reduce_input_.defined()) return;
  // FSDP2's reduce_scatter_state event: the input was allocated on the current stream, which waits
  // for the reduce-scatter (only: not for what follows it on the side streams) before the block
  // can be handed out again.
  if (reduce_scatter_done_)
    DeviceStreams::wait_event(s.current(), *reduce_scatter_done_);
  else
    DeviceStreams::wait_stream(s.current(), s.reduce_scatter);
  release_buffer(reduce_input_);
}

void FSDPParamGroup::advance_reduce() {
  if (DeviceStreams* s = streams(); s && !reduce_pieces_) {
    const auto on_device = device_guard();
    release_reduce_input(*s);
    if (reduce_waits_for_end_of_backward()) return;
    return finish_reduce();
  }
  if (needs_all_reduce_start())
    start_all_reduce();
  else
    finish_reduce();
}

std::optional<double> FSDPParamGroup::post_divide() const {
  if (gradient_divide_factor) return gradient_divide_factor;
  // FSDP2's force-sum: the data-parallel size (the replicas' too under HSDP); nothing to divide by 1.
  const int64_t ranks = mesh_.size();
  if (force_sum_reduction_for_comms && ranks > 1) return static_cast<double>(ranks);
  return std::nullopt;
}

bool FSDPParamGroup::gathers_pieces() const {
  return !streams() && !custom_all_gather && comm_->size() > 1 &&
         comm_->takes_pieces(params_.front()->padded_shard()) && gathers_per_parameter(params_);
}

// [Note: the shards in one buffer]
// FSDP2 copies a unit's shards into the all-gather input at every all-gather with a view per
// parameter and a multi-tensor copy (one per parameter where LibTorch has no _foreach_copy_, as
// 1.13). Here a flat unit's padded shards live side by side, at their offsets_, in one buffer
// that holds them for good, so copy-in is one copy_ of that buffer into the input (the cast to
// the compute dtype inside): one op and one kernel per unit on every LibTorch. The first
// all-gather moves them there once (FSDPParam::move_shard_to), on the current stream: each sharded
// parameter stays the same tensor object (registered in the module, held by the optimizer and
// keyed in its state) and becomes a view of the buffer, so the optimizer's in-place updates are
// what the next copy-in reads. A shard replaced later (materialize) sends the unit back to the
// move. On a GPU that first copy-in waits for the current stream, not only for the post-optim
// event. Not where the shards are offloaded to the host (a transfer each), of mixed dtypes or not
// contiguous; the CPU's per-parameter all-gather sends the shards as they lie and never moves them.
bool FSDPParamGroup::keeps_shards_in_buffer() const {
  if (params_.empty()) return false;
  const at::ScalarType dtype = params_.front()->padded_shard().scalar_type();
  return std::all_of(params_.begin(), params_.end(), [&](const auto& p) {
    const at::Tensor& shard = p->padded_shard();
    return !shard.is_meta() && shard.scalar_type() == dtype && p->shard_device() == p->device() &&
           shard.is_contiguous();
  });
}

bool FSDPParamGroup::shards_in_buffer() const {
  if (!shard_buffer_.defined()) return false;
  const c10::StorageImpl* storage = shard_buffer_.storage().unsafeGetStorageImpl();
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& s = params_[i]->padded_shard();
    if (s.storage().unsafeGetStorageImpl() != storage ||
        s.storage_offset() != shard_buffer_.storage_offset() + offsets_[i] ||
        s.scalar_type() != shard_buffer_.scalar_type()) {
      return false;
    }
  }
  return true;
}

void FSDPParamGroup::move_shards_to_buffer() {
  // Not from the buffer pool: it holds the shards for the run.
  at::Tensor buffer = at::empty({total_shard_numel_}, params_.front()->padded_shard().options().requires_grad(false));
  for (size_t i = 0; i < params_.size(); ++i) {
    params_[i]->move_shard_to(buffer.narrow(0, offsets_[i], params_[i]->shard_numel()));
  }
  shard_buffer_ = buffer;
}

bool FSDPParamGroup::reduces_pieces(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads) const {
  // The rest was checked once (ReducePath::Pieces): what depends on the gradients that arrived.
  return !grads.empty() && comm_->takes_pieces(grads.front().second) && reduces_per_parameter(grads);
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

void FSDPParamGroup::write_grads(const at::Tensor& reduced, bool owned) {
  PhaseScope timed(Phase::GradAccumulate);
  if (reduced_params_.empty()) return;
  bool none = true;
  for (auto& [p, offset] : reduced_params_) none = none && !p->sharded_param().grad().defined();
  if (none) {
    // No gradient yet (the first step; every step where zero_grad sets them to none, LibTorch
    // 2.x's default): they become this rank's rows of one buffer of the unit, as FSDP2's are views
    // of its reduce-scatter output, instead of one allocation and copy each. The buffer is the
    // result itself where it is the group's (a GPU's reduce output, a fresh offload buffer), else
    // (the CPU's result is a row of the pooled input, going back to the pool) one copy of it.
    const at::Tensor& shard = params_.front()->sharded_param();
    const bool as_is = reduced.scalar_type() == shard.scalar_type() && reduced.device() == shard.device();
    at::Tensor flat = as_is ? reduced : reduced.to(shard.device(), shard.scalar_type());
    if (flat.is_same(reduced) && !owned) flat = reduced.clone(at::MemoryFormat::Contiguous);
    for (auto& [p, offset] : reduced_params_) {
      if (!p->adopt_sharded_grad(flat, offset)) p->accumulate_sharded_grad(reduced, offset);
    }
    return;
  }
  if (add_to_adopted_grads(reduced)) return;
  for (auto& [p, offset] : reduced_params_) p->accumulate_sharded_grad(reduced, offset);
}

bool FSDPParamGroup::add_to_adopted_grads(const at::Tensor& reduced) const {
  // Checked without an operator: each gradient is a contiguous view of the first one's storage at
  // its reduce offset from one base, holds all of its shard's rows (no padding: the add touches only
  // gradients), in reduced's dtype and device and not on reduced's memory. Then the flat span from
  // the base is made as adopt_sharded_grad makes a view (no operator either) and added to once:
  // elementwise, the same sums as an add_ per parameter.
  const auto& [p0, offset0] = reduced_params_.front();
  const at::Tensor& g0 = p0->sharded_param().grad();
  if (!g0.defined() || reduced.dim() != 1 || !reduced.is_contiguous() || g0.is_alias_of(reduced)) return false;
  const int64_t base = g0.storage_offset() - offset0;
  const int64_t item = static_cast<int64_t>(reduced.element_size());
  if (base < 0 || static_cast<int64_t>(g0.storage().nbytes()) < (base + reduced.numel()) * item) return false;
  for (const auto& [p, offset] : reduced_params_) {
    const at::Tensor& g = p->sharded_param().grad();
    if (!g.defined() || !g.is_alias_of(g0) || !g.is_contiguous() || g.scalar_type() != reduced.scalar_type() ||
        g.device() != reduced.device() || g.storage_offset() != base + offset || g.numel() != p->shard_numel()) {
      return false;
    }
  }
  c10::intrusive_ptr<c10::TensorImpl> impl = g0.unsafeGetTensorImpl()->shallow_copy_and_detach(
      /*version_counter=*/c10::VariableVersion(0), /*allow_tensor_metadata_change=*/true);
  impl->set_storage_offset(base);
  impl->set_sizes_contiguous({reduced.numel()});
  at::Tensor flat(std::move(impl));
  torch::NoGradGuard no_grad;
  flat.add_(reduced);
  return true;
}

void FSDPParamGroup::finish_reduce() {
  const profiler::Range range("fsdp::reduce_scatter_wait", label);
  const auto on_device = device_guard();
  if (needs_all_reduce_start()) start_all_reduce();
  if (!has_pending_reduce()) return;
  if (reduce_pieces_) return finish_reduce_pieces();
  at::Tensor reduced = reduce_output_;
  bool owned = false;
  if (DeviceStreams* s = streams()) {
    // Everything was queued by queue_post_reduce; the end of the reduction (FSDP2's
    // finalize_backward) is one wait: the host's for an offload copy, else the current stream's.
    release_reduce_input(*s);
    if (offload_host_.defined()) {
      {
        // One host wait per backward: the first group to finish waits for everything queued on
        // the stream (every unit's copy so far); the others find it done.
        PhaseScope timed(Phase::ReduceScatterWait);
        if (!post_reduce_stream_->query()) DeviceStreams::synchronize(*post_reduce_stream_);
      }
      reduced = offload_host_;
      owned = offload_adopt_;
    } else {
      DeviceStreams::wait_stream(s->current(), *post_reduce_stream_);
      owned = true;  // a buffer of its own, allocated on the current stream, which has now waited
    }
  } else {
    {
      PhaseScope timed(Phase::ReduceScatterWait);
      reduce_work_.wait();
    }
    reduce_work_ = comm::Work();  // the backend's scratch is freed now
    if (pending_divide_) reduced.div_(*pending_divide_);
    if (all_reduce_hook) all_reduce_hook(reduced);  // [Note: the all-reduce hook]
  }
  reduce_work_ = comm::Work();
  all_reduce_started_ = false;
  pending_divide_.reset();
  write_grads(reduced, owned);
  reduced_params_.clear();
  reduced = at::Tensor();
  reduce_output_ = at::Tensor();  // on the CPU a view of the input: released with it
  offload_host_ = at::Tensor();
  offload_source_ = at::Tensor();
  offload_adopt_ = false;
  post_reduce_stream_.reset();
  release_buffer(reduce_input_);
}

}  // namespace fsdp::detail
