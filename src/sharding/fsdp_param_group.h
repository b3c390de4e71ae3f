#pragma once
// FSDPParamGroup: the parameters of one fully_shard call, moved together (FSDP2's FSDPParamGroup).
// One flat all-gather before forward/backward, one flat reduce-scatter after backward.
//
// State machine of the parameters:
//
//   Sharded --unshard(async)--> Unsharding --wait_for_unshard()--> Unsharded --reshard()--> Sharded
//
// unshard() only issues the all-gather (copy-in of every padded shard into one flat buffer), so a
// prefetch can overlap it with compute; wait_for_unshard() waits, re-allocates the unsharded
// parameters and copies the rows out. reshard() frees them (waiting first if a gather is in flight).
// unshard() takes one of four paths (GatherPath): the flat layout above (FSDP2's, the only one on
// a GPU and the one a custom all-gather takes), the CPU's per-parameter rows, the post-forward
// group's gather, or a direct world of one; post_backward() likewise hands the gradients over
// (world of one), reduces them per parameter (CPU) or flat. Each is a named step below.
//
// Integer reshard_after_forward (k): reshard_post_forward() keeps, besides the shard, the padded
// shards of the S/k shard ranks this rank stands for within its group of k consecutive ranks
// (FSDP2's SHARDED_POST_FORWARD). Gathered over those k ranks they form exactly the [S, total]
// layout of a full all-gather, so the backward unshard is the same copy-out from a smaller group.
//
// [Note: unshard_in_backward]
// A unit whose parameters backward never reads (embeddings: their backward needs the indices, not
// the table) can skip its backward all-gather: FSDPModule::set_unshard_in_backward(false),
// FSDP2's. Its pre-backward then neither gathers nor is prefetched, and its gradients arrive on
// unsharded parameters whose memory reshard freed after forward. reshard_post_forward frees them
// with their full shapes kept (FSDPParam::free_unsharded(keep_shape)), over no memory at all (a
// null data pointer, 0 bytes), as FSDP2 resizes their storage to 0, for two reasons: autograd
// checks a new gradient's layout against its parameter's and would copy it into a zero-element
// one, and LibTorch 1.13's embedding backward keeps the table itself to read its row count
// (2.x keeps the count). A unit whose backward does read its parameters' values (a linear, a
// head tied to the embedding) fails there with LibTorch's error for memory that is not there,
// "... out of bounds for storage of size 0" or "... its data is not allocated yet", never reading
// freed memory. The shapes go back to zero elements once post_backward has taken the gradients.
//
// HSDP (2-D mesh, replicate x shard): all-gather and reduce-scatter run on the shard group; the
// reduce-scatter output is then all-reduced over the replicate group.
//
// On a CUDA device the collectives run on side streams ordered by events: see [Note: FSDP
// streams] in streams.h. On the CPU the same calls wait on the host, as they always did, and on a
// Gloo group they move each parameter's rows straight between shards, unsharded parameters and
// gradients: [Note: FSDP's CPU collectives, per parameter] in collectives.h.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "collectives.h"
#include "fsdp/comm/comm.h"
#include "fsdp/mesh/device_mesh.h"
#include "fsdp/sharding/custom_collectives.h"
#include "fsdp_param.h"
#include "streams.h"

namespace fsdp::detail {

class FSDPParamGroup {
 public:
  enum class State { Sharded, Unsharding, Unsharded };

  FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, DeviceMesh mesh);

  State state() const { return state_; }
  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  const DeviceMesh& mesh() const { return mesh_; }
  // The 1-D mesh the parameters are sharded over (the "shard" dimension under HSDP).
  const DeviceMesh& shard_mesh() const { return shard_mesh_; }
  bool is_hsdp() const { return replicate_comm_ != nullptr; }
  comm::Comm& comm() const { return *comm_; }

  // `after`: on a GPU, the copy-in waits on this event instead of the current stream (the root's
  // first all-gather of a step after set_post_optim_event).
  void unshard(bool async_op, const c10::Event* after = nullptr);
  void wait_for_unshard();
  // keep_shapes: the parameters keep their full shapes over freed memory ([Note:
  // unshard_in_backward]); without it, shapes kept earlier go back to zero elements too.
  void reshard(bool keep_shapes = false);
  // reshard_after_forward's reshard: to the post-forward shard when post_forward_comm is set.
  void reshard_post_forward();
  // Drops a post-forward shard (its rows are stale once an optimizer step may have run).
  void discard_post_forward() { post_forward_shard_ = at::Tensor(); }

  // Before this group's backward (its pre-backward), in a world of one without replicas where
  // gradients are neither cast nor divided and gradient sync is on, outside create_graph: each
  // sharded gradient that exists becomes its unsharded parameter's too (FSDPParam::
  // share_sharded_grad), so autograd accumulates into it in place, as without FSDP.
  void share_sharded_grads();
  // After this group's backward: with gradient sync on, issues the reduce-scatter of the unsharded
  // gradients (asynchronously) and releases them; with it off, leaves them to accumulate.
  // Reshards afterwards when reshard_after_backward.
  void post_backward();
  bool has_pending_reduce() const { return reduce_output_.defined() || reduce_pieces_.has_value(); }
  // One step of a pending reduction, called from the next unit's backward. On the CPU: under
  // HSDP, a finished reduce-scatter starts its all-reduce over the replicas (asynchronously, so it
  // overlaps the next unit's backward); otherwise, or once that is in flight, finish_reduce(). On
  // a GPU everything after the reduce-scatter was queued on the side streams by post_backward:
  // the current stream waits for the reduce-scatter and its input is released; where an HSDP
  // all-reduce or a CPU offload copy follows, the rest waits for the end of backward (FSDP2's
  // finalize_backward), else finish_reduce().
  void advance_reduce();
  // Waits for the reduction (reduce-scatter, then HSDP's all-reduce, then on a GPU with CPU
  // offload the copy to the host) and writes (or adds to) the sharded gradients. Gradients that
  // do not exist yet become tensors on one buffer of the unit (the reduce output itself on a GPU,
  // where it has its own; one copy of this rank's row on the CPU) instead of a copy each.
  void finish_reduce();

  bool reshard_after_forward = true;
  bool reshard_after_backward = true;
  bool unshard_in_backward = true;  // [Note: unshard_in_backward]
  bool requires_gradient_sync = true;
  bool requires_all_reduce = true;  // HSDP only
  std::optional<double> gradient_divide_factor;
  // FSDPModule::set_force_sum_reduction_for_comms: Sum collectives, then a divide of their own.
  bool force_sum_reduction_for_comms = false;
  // FSDPModule::set_all_reduce_hook: runs on the unit's reduced gradients once they are complete
  // ([Note: the all-reduce hook], fsdp_param_group.cpp); on a GPU, queued on all_reduce_hook_stream
  // (unset: the all-reduce stream).
  std::function<void(const at::Tensor&)> all_reduce_hook;
  std::optional<c10::Stream> all_reduce_hook_stream;
  // FSDPModule::set_custom_all_gather / set_custom_reduce_scatter (null: the shard group's own).
  std::shared_ptr<AllGather> custom_all_gather;
  std::shared_ptr<ReduceScatter> custom_reduce_scatter;
  // Integer reshard_after_forward: this rank's group of k consecutive shard ranks (null otherwise).
  std::shared_ptr<comm::Comm> post_forward_comm;
  // The unit's name in profiler ranges (fsdp/debug/profiler.h): its module's path from the root,
  // set at the root's lazy init ("" before).
  std::string label;

 private:
  std::vector<std::unique_ptr<FSDPParam>> params_;
  DeviceMesh mesh_;
  DeviceMesh shard_mesh_;
  std::shared_ptr<comm::Comm> comm_;            // the shard group
  std::shared_ptr<comm::Comm> replicate_comm_;  // HSDP's replicate group, else null
  at::Tensor post_forward_shard_;               // [S/k, total] in the compute dtype, while post-forward
  std::vector<int64_t> offsets_;                // each parameter's column in the flat [N, total] layout
  int64_t total_shard_numel_ = 0;
  State state_ = State::Sharded;

  at::Tensor all_gather_input_;  // kept until the wait: a side stream may still read it
  // [Note: the shards in one buffer] (fsdp_param_group.cpp): every padded shard, side by side at
  // offsets_, from the first all-gather on where keeps_shards_in_buffer() holds; undefined before.
  at::Tensor shard_buffer_;
  at::Tensor all_gather_output_;
  comm::Work all_gather_work_;

  at::Tensor reduce_input_;  // kept until the reduction is finished (same reason)
  at::Tensor reduce_output_;
  comm::Work reduce_work_;
  std::vector<std::pair<FSDPParam*, int64_t>> reduced_params_;  // (param, offset in reduce_output_)
  // post_backward's gradients taken from the unsharded parameters (empty between calls).
  std::vector<std::pair<FSDPParam*, at::Tensor>> taken_grads_;
  std::optional<double> pending_divide_;
  // The CPU's per-parameter collectives in flight ([Note: FSDP's CPU collectives, per parameter]
  // in collectives.h): the pieces are kept until the wait (the sends read them, the receives
  // write them).
  std::optional<GatherPieces> gather_pieces_;
  std::optional<ReducePieces> reduce_pieces_;
  bool all_reduce_started_ = false;  // HSDP: reduce_work_ is the all-reduce, not the reduce-scatter
  // GPU: what post_backward queued after the reduce-scatter (queue_post_reduce). The stream that
  // writes reduce_output_ last (reduce_scatter, or all_reduce under HSDP), which the current
  // stream waits for before it reads the result; an event recorded right after the
  // reduce-scatter, which the current stream waits for before reduce_input_ is released.
  std::optional<c10::Stream> post_reduce_stream_;
  std::optional<c10::Event> reduce_scatter_done_;
  // GPU with CPU offload: the reduced gradients' copy to pinned host memory, queued non-blocking on
  // the post-reduce stream; the host waits for it once, at the end of backward.
  at::Tensor offload_host_;     // where the copy lands
  at::Tensor offload_source_;   // the device tensor it reads (reduce_output_ or its cast), kept until then
  bool offload_adopt_ = false;  // offload_host_ is a fresh buffer that becomes the gradients (there were none)
  at::Tensor offload_staging_;  // persistent pinned buffer, the copy's target when gradients exist (added to)

  // [Note: a unit's collectives, chosen once]
  // How the unit gathers and reduces is chosen at its first unshard (when the shards are in place:
  // after materialize) and kept: a direct world of one (no collective), the CPU's per-parameter
  // rows, or the flat layout (FSDP2's, on every GPU), and for the flat layout the collective object
  // it calls: the user's custom one where set, else the group's own (GroupAllGather,
  // GroupReduceScatter), both behind custom_collectives.h's interfaces. A unit then pays for none
  // of those checks per call. What the choice read is kept beside it, so that a unit chooses again
  // only when that changed (a custom collective, hook or integer reshard set later, the CPU
  // options, shards replaced): a few comparisons per call. Per call there remain the post-forward
  // group's gather (while a post-forward shard is held) and, for the per-parameter reduce-scatter,
  // whether the gradients that arrived all qualify (else flat).
  enum class GatherPath { Direct, PostForward, Pieces, Flat };
  enum class ReducePath { Direct, Pieces, Flat };
  struct Collectives {
    GatherPath gather = GatherPath::Flat;  // never PostForward: that one is per call
    ReducePath reduce = ReducePath::Flat;  // Pieces: where the gradients qualify (reduces_pieces)
    AllGather* all_gather = nullptr;
    ReduceScatter* reduce_scatter = nullptr;
    // What the choice was made from.
    uint64_t options_epoch = 0;
    const void* custom_all_gather = nullptr;
    const void* custom_reduce_scatter = nullptr;
    const void* post_forward_comm = nullptr;
    const void* first_shard = nullptr;
    bool hook = false;
    bool chosen = false;
  };
  Collectives collectives_;
  GroupAllGather own_all_gather_;
  GroupReduceScatter own_reduce_scatter_;
  // The choice, made again where what it read has changed.
  const Collectives& collectives();
  bool collectives_current() const;
  void choose_collectives();
  GatherPath gather_path();
  // unshard()'s steps, one per path; each leaves the gather in flight (Direct: done).
  void unshard_directly();
  void issue_gather_pieces();
  void issue_post_forward_gather();
  void issue_flat_gather(const c10::Event* after);
  // The flat all-gather's output [N, total] in the compute dtype (a custom all-gather's allocate).
  at::Tensor alloc_all_gather_output(const c10::Event* after);
  // Moves the shards into shard_buffer_ where they can live there and are not yet; true if moved.
  bool place_shards_in_buffer();
  // post_backward()'s steps: the unsharded gradients into taken_grads_ (true where some gradient
  // was shared with the sharded one), then one of: handed over as they are (a direct world of
  // one), reduced per parameter (the CPU) or flat.
  bool take_unsharded_grads();
  void hand_over_grads();
  void issue_reduce_pieces();
  void issue_flat_reduce();
  // Sets pending_divide_ and returns the collective's op (Avg, or Sum where a divide follows).
  comm::ReduceOp begin_reduce();

  // The side streams of the parameters' device; null on the CPU (see streams.h). Looked up once
  // (DeviceStreams::get takes a lock).
  DeviceStreams* streams() const;
  mutable DeviceStreams* streams_ = nullptr;
  mutable bool streams_known_ = false;
  bool offloaded_grads() const;  // gradients go back to (pinned) host memory

  // A shard group of one on the CPU, no replicas: unshard copies each shard straight into its
  // unsharded storage and post_backward hands the gradients over without a reduce-scatter.
  bool direct_world_of_one() const {
    return comm_->size() == 1 && !replicate_comm_ && !post_forward_comm && !streams();
  }
  // What the reduced gradients are divided by after Sum collectives; none: the collectives average.
  std::optional<double> post_divide() const;
  // Gradients go to .grad without a reduction: a direct world of one, unless a hook or a custom
  // reduce-scatter wants the reduce output (the group of one then "reduces", Comm's local copy).
  bool reduces_directly() const { return direct_world_of_one() && !all_reduce_hook && !custom_reduce_scatter; }
  // The same for unshard: a custom all-gather is called in a world of one too.
  bool gathers_directly() const { return direct_world_of_one() && !custom_all_gather; }
  // The flat collectives chosen (collectives()): the custom ones where set, else the group's own.
  AllGather& all_gather() { return *collectives().all_gather; }
  ReduceScatter& reduce_scatter() { return *collectives().reduce_scatter; }
  // A buffer from the custom collective's allocate, checked (sizes, dtype, device, contiguous).
  at::Tensor custom_buffer(bool all_gather, int64_t numel, const at::TensorOptions& options) const;
  // The CPU's per-parameter collectives apply (Gloo shard group of CPU tensors, no side streams).
  bool gathers_pieces() const;
  // Every padded shard is where shard_buffer_ has it (false after materialize replaced one).
  bool shards_in_buffer() const;
  // The shards can live in shard_buffer_: one dtype, on the compute device (not offloaded), not
  // meta, contiguous.
  bool keeps_shards_in_buffer() const;
  void move_shards_to_buffer();
  void drop_kept_shapes();
  bool reduces_pieces(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads) const;
  void finish_reduce_pieces();
  // CPU only: a GPU's all-reduce is queued by post_backward (queue_post_reduce).
  bool needs_all_reduce_start() const {
    return replicate_comm_ && has_pending_reduce() && !all_reduce_started_ && !streams();
  }
  void start_all_reduce();
  // The parameters' device made current for the scope (CUDA only): the caching allocator and
  // kernels without tensor arguments use the current device.
  c10::OptionalDeviceGuard device_guard() const;
  // GPU: after the reduce-scatter is issued, HSDP's all-reduce, the divide and CPU offload's copy to
  // the host, all queued on side streams (FSDP2's foreach_reduce), no host wait.
  void queue_post_reduce(DeviceStreams& s);
  // GPU with CPU offload: the reduced gradients' copy to pinned host memory, queued on the current
  // (post-reduce) stream.
  void queue_offload_copy();
  // GPU: the current stream waits for the reduce-scatter, then its input goes back.
  void release_reduce_input(DeviceStreams& s);
  // The end of a reduction where the result has to wait on the side streams: HSDP's all-reduce or
  // the offload copy.
  bool reduce_waits_for_end_of_backward() const {
    return offload_host_.defined() || ((replicate_comm_ || all_reduce_hook) && !reduced_params_.empty());
  }
  // Writes (or adds) `reduced` into the sharded gradients of reduced_params_; `owned`: reduced is
  // the group's to hand over (nothing else writes it afterwards).
  void write_grads(const at::Tensor& reduced, bool owned);
  // Adds `reduced` to the sharded gradients of reduced_params_ as one add_ where they still are the
  // views of one buffer that write_grads made them (at their offsets, unpadded); false otherwise.
  bool add_to_adopted_grads(const at::Tensor& reduced) const;
};

}  // namespace fsdp::detail
