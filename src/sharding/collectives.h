#pragma once
// The data movement around FSDP's collectives (FSDP2's _fsdp_collectives.py), apart from the
// state machine that decides when they run (fsdp_param_group.cpp):
//
//   copy-in        every padded shard of a group side by side in one flat all-gather input
//                  [total], cast to the compute dtype;
//   copy-out       the all-gather output, viewed as [N, total], into each unsharded parameter
//                  (rank r's rows of parameter i sit at [r, offsets[i]]);
//   reduce-scatter input
//                  each unsharded gradient split by rank (padding rows zeroed) into [N, total]
//                  in the reduce dtype;
//   post-forward copy-in
//                  integer reshard_after_forward: the padded shards of the shard ranks this rank
//                  stands for, taken from the unsharded parameters, as [count, total].
//
// Each of the first three is one op per unit where LibTorch has it, a copy kernel on a GPU
// ([Note: one copy kernel per unit], collectives.cpp).
#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "fsdp_param.h"

namespace fsdp::detail {

using FSDPParams = std::vector<std::unique_ptr<FSDPParam>>;

// input: [total] (flat), in the compute dtype, on the compute device. shard_buffer: where defined,
// every padded shard side by side at `offsets` in one tensor of `total` ([Note: the shards in one
// buffer]), copied (cast) into the input as one tensor.
void copy_in_all_gather_input(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& input,
                              const at::Tensor& shard_buffer = at::Tensor());

// Allocates every unsharded parameter and copies its rows out of `output` ([N * total], flat).
void copy_out_all_gather_output(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& output,
                                int64_t total);
// The same where the output's row `rank` was not written: this rank's rows come from `own` ([total],
// the unit's shard buffer: [Note: the shards in one buffer], fsdp_param_group.cpp).
void copy_out_all_gather_output(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& output,
                                int64_t total, const at::Tensor& own, int rank);

// out: [count, total]; out[i] gets shard rank (first_rank + i)'s padded rows of every parameter.
void copy_in_post_forward(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& out,
                          int first_rank);

// [Note: FSDP's CPU collectives, per parameter]
// On a Gloo shard group of CPU tensors (fsdp/debug/cpu_collectives.h) a unit's all-gather and
// reduce-scatter need not go through the flat [N, total] layout above: Gloo's send/recv take any
// contiguous memory, and a parameter's dim-0 rows of rank r are contiguous both in r's shard and in
// the unsharded parameter. So
//   all-gather      the unsharded parameters are allocated when the gather is issued; each
//                   parameter's shard rows are sent from the shard itself, each peer's rows are
//                   received into the unsharded parameter at their offset, and this rank's own
//                   rows are copied from the shard (the one copy left: 1/N of the data, against
//                   copy-in 1/N + copy-out 1 in the flat layout);
//   reduce-scatter  each gradient's rows of rank r are sent from the gradient itself, the peers'
//                   rows for this rank arrive in one scratch and are added into this rank's own
//                   rows of the gradient, which then become the sharded gradient (no flat input:
//                   the gradients live until the sends are done, as the input did).
// Shards below CpuCollectiveOptions::min_piece_bytes (biases, norms) are not worth a message
// each: they travel packed in one small flat buffer per unit, copied in and out as before, and a
// unit whose shards are all that small keeps the flat layout (Gloo's own collectives). Rows
// past a parameter's end (padding) are not sent: a piece is only the rows that exist, so its size
// can differ between ranks, the same on every rank. Every rank builds the same pieces in the same
// order (the parameter order of the group), which is what matches the messages (one tag each).
// The flat layout stays for everything else (GPUs, HSDP's reduce, integer reshard_after_forward,
// casts to a compute or reduce dtype): cpu_collectives.h.
//
// One all-gather of pieces in flight: what the group keeps until the wait.
struct GatherPieces {
  std::vector<at::Tensor> ins;                // this rank's piece of each exchange
  std::vector<std::vector<at::Tensor>> outs;  // [exchange][rank]: where rank r's piece lands
  at::Tensor packed;                          // [N, packed total]: the small shards (or undefined)
  std::vector<FSDPParam*> packed_params;      // whose shards are in `packed`, in its order
};
// One reduce-scatter of pieces in flight.
struct ReducePieces {
  std::vector<at::Tensor> outs;              // this rank's reduced rows of each exchange
  std::vector<std::vector<at::Tensor>> ins;  // [exchange][rank]: the rows sent to rank r
  std::vector<std::pair<FSDPParam*, std::pair<at::Tensor, int64_t>>> results;  // param, (flat, offset)
  std::vector<at::Tensor> grads;  // the unsharded gradients, alive until the sends end
  int64_t grad_bytes = 0;         // counted as BufferOwner::UnshardedGrads meanwhile
  at::Tensor packed;              // [N, packed total]: the small gradients (or undefined)
};

// Whether this group's parameters can gather per parameter (same dtype for shard and compute,
// shard on the compute device, at least one shard of min_piece_bytes or more), given the options.
bool gathers_per_parameter(const FSDPParams& params);
// Whether every shard can be sent as it lies: no cast to the compute dtype, shard and compute on
// the CPU, memory allocated (not meta). The per-parameter gather and the flat gather from the shard
// buffer ([Note: the shards in one buffer], fsdp_param_group.cpp) both need it.
bool shards_sent_as_they_are(const FSDPParams& params);
// Allocates every unsharded parameter and lays out the pieces ([Note: FSDP's CPU collectives, per
// parameter]); this rank's packed shards are copied into the packed buffer's row.
GatherPieces build_gather_pieces(const FSDPParams& params, int rank, int n);
// After the wait: the packed shards into their unsharded parameters.
void copy_out_gather_pieces(const GatherPieces& pieces);
// Whether these gradients can be reduced per parameter (each already in its reduce dtype, which
// is a 32- or 64-bit float; at least one shard of min_piece_bytes or more).
bool reduces_per_parameter(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads);
// The pieces of `grads` (consumed: held by the result until the reduction ends).
ReducePieces build_reduce_pieces(std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int rank, int n);
// Frees what a finished reduction of pieces held.
void release_reduce_pieces(ReducePieces& pieces);

// [Note: the reduce-scatter into the sharded gradients]
// The flat layout's reduce-scatter on a Gloo group of CPU tensors (fsdp/debug/cpu_collectives.h,
// CpuCollectiveOptions::reduce_into_grads) packs only what leaves the rank: each unsharded
// gradient's rows of every other rank go into their rows of the [N, total] input, scaled by the
// group's divide (1/N to average) as they are copied. This rank's own rows never enter a buffer: once the
// sends are posted they are added (scaled) straight from the unsharded gradients into `dest`, and
// what the peers send is added into `dest` by the reduce-scatter itself (Comm::reduce_scatter_pieces
// with `dest` as this rank's own piece: in place). `dest` is, by case:
//   Fresh    no reduced parameter has a gradient (the first step; zero_grad setting them to
//            none): new memory of the unit's rows, written and reduced into, whose rows then
//            become the gradients (FSDP2's views of the reduce-scatter output) with no copy (the
//            flat path copies its reduced row there; the allocation is the same one);
//   Grads    every gradient is this parameter's rows of the buffer a previous reduction left
//            them in (FSDPParamGroup::write_grads remembers its storage, weakly): that buffer, added to in
//            place (no reduce output, no add of it);
//   Scratch  anything else (a gradient a user replaced, some with and some without): the input's
//            own row, written, then added into (or copied to) each gradient as the flat path does.
// Against the flat path (pack all N rows, reduce into the own row, then add that row into the
// gradients) this saves copying this rank's rows into the input and, for Fresh and Grads, the pass
// over the reduced rows. The result differs from the flat path's by rounding only (each
// contribution scaled before the sum, not the sum after; for N = 2 and Fresh, bit for bit the same).
// The case is local, the collective is not: every case makes the same exchange, so ranks may
// differ in it. tests/sharding/test_reduce_into_grads.cpp checks each case against the flat path.
struct ReduceIntoGrads {
  enum class Dest { Fresh, Grads, Scratch };
  Dest kind = Dest::Scratch;
  at::Tensor input;  // [N, total] (pool): row j the rows sent to rank j; this rank's row is dest or unused
  at::Tensor dest;   // [total]: this rank's reduced rows (Fresh: memory of its own, for the gradients)
  double scale = 1.0;
  at::Tensor factor;                                     // scale as a 0-dim tensor (undefined for 1: plain copies)
  std::vector<std::pair<FSDPParam*, at::Tensor>> grads;  // until add_own_rows
  std::vector<std::pair<FSDPParam*, int64_t>> placed;    // each parameter's offset in dest
  int64_t grad_bytes = 0;                                // counted as BufferOwner::UnshardedGrads meanwhile
};
// Whether `grads` can take it: every gradient already in its reduce dtype, a 32- or 64-bit float
// that is also the sharded parameter's, on the CPU (the caller checks the group: Gloo, no streams,
// hooks, custom collectives or replicas), and the option on.
bool reduces_into_grads(const std::vector<std::pair<FSDPParam*, at::Tensor>>& grads);
// Packs the peers' rows of `grads` (consumed, held until add_own_rows) and picks `dest`.
// `grads_storage`: the storage the previous reduction's Fresh buffer was (or null).
ReduceIntoGrads build_reduce_into_grads(std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int rank, int n,
                                        double scale, const c10::StorageImpl* grads_storage);
// The exchange's pieces for Comm::reduce_scatter_pieces: ({dest}, {{row of each rank, dest}}).
std::vector<std::vector<at::Tensor>> reduce_into_grads_ins(const ReduceIntoGrads& r, int rank);
// After the reduce-scatter is issued: this rank's rows into dest, scaled; frees the gradients.
void add_own_rows(ReduceIntoGrads& r, int rank);
// After its wait, once the gradients have what dest holds (FSDPParamGroup::write_grads for Fresh,
// adopting dest, and Scratch, as the flat path's result): releases the buffers.
void release_reduce_into_grads(ReduceIntoGrads& r);

// The reduce-scatter input of the gradients in `grads` (consumed: each unsharded gradient is freed
// once it is in the input, as FSDP2 does; `grads` is left empty), [n, total] in `dtype`, from the
// buffer pool (or from `allocate(numel, options)` where given: a custom reduce-scatter's); `placed`
// gets each parameter with its column.
at::Tensor build_reduce_scatter_input(
    std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int n, at::ScalarType dtype,
    std::vector<std::pair<FSDPParam*, int64_t>>& placed,
    const std::function<at::Tensor(int64_t, const at::TensorOptions&)>& allocate = {});

}  // namespace fsdp::detail
