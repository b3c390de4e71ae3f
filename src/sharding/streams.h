#pragma once
// The side streams of the sharding runtime on a GPU (FSDP2's FSDPCommContext).
//
// [Note: FSDP streams]
// On a CUDA device every kernel runs on a stream; the current stream (the "compute" stream) runs
// forward, backward and the optimizer. FSDP moves its collectives to side streams from LibTorch's
// stream pool of the mesh's device, shared by every unit on that device:
//   copy_in        (high priority)  copies the shards into the flat all-gather input
//   all_gather     (high priority)  issues the all-gather (NCCL's own stream waits on this one)
//   reduce_scatter (high priority)  issues the reduce-scatter of a unit's gradients
//   all_reduce                      HSDP: the all-reduce over the replicas
// and orders them with events only (the host never blocks on the GPU in the steady state):
//   1. unshard: copy_in waits on the current stream (the shards may have just been written by the
//      optimizer; for the root's first all-gather of a step, on the post-optim event instead when
//      set_post_optim_event gave one), copies; all_gather waits on copy_in and issues the
//      collective. Prefetching issues the next unit's unshard before this unit's forward (or
//      backward) kernels are queued, so its all-gather overlaps them.
//   2. wait_for_unshard: the all-gather's Work is waited with all_gather current (a stream wait,
//      not a host wait, on NCCL), then the current stream waits on an event recorded on
//      all_gather; only then does it copy the rows out and compute with them.
//   3. post_backward: the reduce-scatter input is built on the current stream; reduce_scatter
//      waits on it and issues the collective, which then overlaps the next (earlier) unit's
//      backward. Right behind it, on side streams and without a host wait (FSDP2's foreach_reduce):
//      an event records the reduce-scatter's end; under HSDP all_reduce waits on reduce_scatter and
//      issues the all-reduce over the replicas; the divide by a custom factor and the CPU-offload
//      copy follow on the last of those streams (the "post-reduce" stream). The next unit's
//      post_backward makes the current stream wait only on the reduce-scatter's event before it
//      releases this unit's input. The current stream waits on the post-reduce stream before it
//      reads the reduced gradients: one unit later for plain FSDP, at the end of backward under
//      HSDP and with offload.
//   4. CPU offload: the shards live in pinned host memory, copied in with non_blocking copies on
//      copy_in; the reduced gradients go to pinned host memory with a non_blocking copy on the
//      post-reduce stream, and the host waits once, at the end of backward (FSDP2's
//      finalize_backward), before the optimizer runs on the CPU.
// Memory that crosses streams: every buffer a side stream reads or writes (all-gather input and
// output, reduce-scatter input and output, the post-forward shard) is allocated on the current
// stream *before* the side stream waits on it, and is released only after the current stream has
// waited on the side stream's event. The caching allocator hands a freed block out again only to
// allocations on the stream it was allocated on, in that stream's order, so no kernel of another
// stream can still read it then: no record_stream is needed, and a block never moves between
// streams' pools (FSDP2 keeps its buffers until the consuming event for the same reason). Two
// exceptions, each freed only after the matching wait: with a post-optim event the all-gather
// output is allocated on all_gather (FSDP2 does so: the compute stream's blocks freed after the
// event may still be read by kernels queued after it), and the offload cast on the post-reduce
// stream.
// Stream-race mode (a test mode: FSDP_STREAM_RACE_US=N): every side stream spins for about N
// microseconds (at::cuda::sleep) right after each wait it is given, i.e. before each copy or
// collective it runs, so a consumer that forgot to wait reads a buffer not yet written (a wrong
// number, not a lucky one). Off when unset or 0.
// On CPU devices none of this exists: DeviceStreams::get returns null and the runtime takes the
// plain path (collectives wait on the host, as before).
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace fsdp::detail {

// FSDP_STREAM_RACE_US, read once (0: off); throws std::invalid_argument naming the variable when
// it is not a count.
int64_t stream_race_microseconds();

class DeviceStreams {
 public:
  // The streams of `device`, made once per device and process; null for non-CUDA devices and in
  // builds without CUDA (no stream code runs there).
  static DeviceStreams* get(c10::Device device);

  c10::Device device() const { return copy_in.device(); }
  c10::Stream current() const;
  // `waiter` waits (on the GPU) for everything queued on `producer` so far.
  static void wait_stream(const c10::Stream& waiter, const c10::Stream& producer);
  // `waiter` waits for `event` (recorded elsewhere, e.g. the post-optim event).
  static void wait_event(const c10::Stream& waiter, const c10::Event& event);
  // Blocks the host until everything queued on `stream` so far is done.
  static void synchronize(const c10::Stream& stream);

  // The current stream waits for the all-gather stream; with fsdp::set_all_gather_wait_timing
  // on, also times how long it stood still doing so (gpu_stats.h).
  void current_waits_for_all_gather() const;

  c10::Stream copy_in, all_gather, reduce_scatter, all_reduce;

 private:
  DeviceStreams(c10::Stream copy_in, c10::Stream all_gather, c10::Stream reduce_scatter, c10::Stream all_reduce)
      : copy_in(copy_in), all_gather(all_gather), reduce_scatter(reduce_scatter), all_reduce(all_reduce) {}
};

}  // namespace fsdp::detail
