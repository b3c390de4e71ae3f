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

#include "fsdp/sharding/custom_collectives.h"
#include "fsdp_param.h"

namespace fsdp::detail {

// FSDP's own flat all-gather and reduce-scatter: the group's collectives, behind the interfaces a
// user's custom ones implement (fsdp/sharding/custom_collectives.h), so that a unit calls the one
// or the other the same way, through the object it chose once (FSDPParamGroup::Collectives). Their buffers come
// from FSDP's pool (the group allocates them; allocate() is a user's hook).
class GroupAllGather final : public AllGather {
 public:
  comm::Work operator()(const at::Tensor& output, const at::Tensor& input, comm::Comm& group, bool async_op) override {
    return group.all_gather_into_tensor(output, input, async_op);
  }
};
class GroupReduceScatter final : public ReduceScatter {
 public:
  comm::Work operator()(const at::Tensor& output, const at::Tensor& input, comm::Comm& group, comm::ReduceOp op,
                        bool async_op) override {
    return group.reduce_scatter_tensor(output, input, op, async_op);
  }
};

using FSDPParams = std::vector<std::unique_ptr<FSDPParam>>;

// Counts the calls of set_cpu_collective_options: a unit that chose its collectives under another
// count chooses them again ([Note: a unit's collectives, chosen once], fsdp_param_group.h).
uint64_t cpu_collective_options_epoch();

// input: [total] (flat), in the compute dtype, on the compute device. shard_buffer: where defined,
// every padded shard side by side at `offsets` in one tensor of `total` ([Note: the shards in one
// buffer], fsdp_param_group.cpp), copied (cast) into the input as one tensor.
void copy_in_all_gather_input(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& input,
                              const at::Tensor& shard_buffer = at::Tensor());

// Allocates every unsharded parameter and copies its rows out of `output` ([N * total], flat).
void copy_out_all_gather_output(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& output,
                                int64_t total);

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

// Whether this group's parameters can gather per parameter, given the options: every shard sent as
// it lies (no cast to the compute dtype, shard and compute on the CPU, memory allocated, not meta),
// at least one shard of min_piece_bytes or more.
bool gathers_per_parameter(const FSDPParams& params);
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

// Row `row` of the contiguous 2-D `t`, as t[row] but made without an ATen operator (a shallow copy
// of t's TensorImpl with the row's offset and shape: FSDP's own buffers, not autograd's; no view
// relation, no shared version counter); t[row] where t is not contiguous.
at::Tensor row_of(const at::Tensor& t, int64_t row);

// The reduce-scatter input of the gradients in `grads` (consumed: each unsharded gradient is freed
// once it is in the input, as FSDP2 does; `grads` is left empty), [n, total] in `dtype`, from the
// buffer pool (or from `allocate(numel, options)` where given: a custom reduce-scatter's); `placed`
// gets each parameter with its column.
at::Tensor build_reduce_scatter_input(
    std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int n, at::ScalarType dtype,
    std::vector<std::pair<FSDPParam*, int64_t>>& placed,
    const std::function<at::Tensor(int64_t, const at::TensorOptions&)>& allocate = {});

}  // namespace fsdp::detail
