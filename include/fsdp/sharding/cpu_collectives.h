#pragma once
// How fully_shard moves a unit's data on the CPU (a Gloo shard group of CPU tensors).
//
// Per parameter (the default): each parameter's shard is sent from where it lies and each peer's
// rows are received straight into the unsharded parameter (Comm::all_gather_pieces), and each
// gradient's rows are sent from the gradient itself (Comm::reduce_scatter_pieces): no flat
// all-gather buffer, no copy-in, no copy-out, no reduce-scatter input. Only this rank's own rows
// are copied (shard -> unsharded parameter). Shards smaller than min_piece_bytes travel packed in
// one flat message per peer (copied in and out, as before), so a unit of many small parameters
// does not pay a message each. See [Note: FSDP's CPU collectives, per parameter] in
// src/sharding/collectives.h.
//
// Flat: FSDP2's layout, one message per peer and unit: the shards copied into one flat
// all-gather input, the output copied out into the parameters, the gradients copied into one flat
// reduce-scatter input. Always used on GPUs (NCCL), under HSDP's reduce, integer
// reshard_after_forward, mixed precision that casts, and 16-bit reductions.
//
// FSDP_CPU_COLLECTIVES=pieces|flat in the environment sets the default (read once).
#include <cstddef>

namespace fsdp {

// Example:
//   fsdp::CpuCollectiveOptions o;
//   o.per_parameter = false;                 // the flat layout (for comparison)
//   fsdp::set_cpu_collective_options(o);     // between steps, the same on every rank
struct CpuCollectiveOptions {
  bool per_parameter = true;
  size_t min_piece_bytes = 64 * 1024;  // shards below this travel packed in one flat message
};
void set_cpu_collective_options(const CpuCollectiveOptions& options);
CpuCollectiveOptions cpu_collective_options();

}  // namespace fsdp
