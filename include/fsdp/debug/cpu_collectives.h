#pragma once
// How fully_shard moves a unit's data on the CPU (a Gloo shard group of CPU tensors).
//
// Flat (the default): FSDP2's layout, one message per peer and unit: the shards copied into one
// flat all-gather input, the output copied out into the parameters, the gradients copied into one
// flat reduce-scatter input.
//
// Per parameter (opt-in): each parameter's shard is sent from where it lies and each peer's rows
// are received straight into the unsharded parameter (Comm::all_gather_pieces), and each
// gradient's rows are sent from the gradient itself (Comm::reduce_scatter_pieces): no flat
// all-gather buffer, no copy-in, no copy-out, no reduce-scatter input; only this rank's own rows
// are copied (shard -> unsharded parameter). Shards smaller than min_piece_bytes travel packed in
// one flat message per peer (copied in and out as in the flat layout), so a unit of many small
// parameters does not pay a message each. See [Note: FSDP's CPU collectives, per parameter] in
// src/sharding/collectives.h.
//
// Why flat is the default: on a 2-core machine with both cores computing, a message costs more
// than the copy it saves for shards of up to a few hundred KiB, and larger shards gain nothing
// measurable (benchmarks/layout_bench.cpp; docs/benchmarks-history.md, "Where FSDP's time goes"). Try it
// where shards are large and cores spare.
//
// The flat layout is always used on GPUs (NCCL), for HSDP's reduce, integer
// reshard_after_forward, mixed precision that casts, and 16-bit reductions.
//
// FSDP_CPU_COLLECTIVES=flat|pieces|gather-pieces|reduce-pieces in the environment sets the
// default (read once): flat, both per parameter, or only the all-gather / only the reduce-scatter.
#include <cstddef>

namespace fsdp {

// Example:
//   fsdp::CpuCollectiveOptions o;
//   o.gather_per_parameter = o.reduce_per_parameter = true;   // both per parameter
//   o.min_piece_bytes = 1 << 20;                              // shards of 1 MiB or more
//   fsdp::set_cpu_collective_options(o);     // between steps, the same on every rank
struct CpuCollectiveOptions {
  bool gather_per_parameter = false;  // the all-gather (forward and backward unshard)
  bool reduce_per_parameter = false;  // the reduce-scatter of the gradients
  size_t min_piece_bytes = 1u << 20;  // shards below this travel packed in one flat message
};
void set_cpu_collective_options(const CpuCollectiveOptions& options);
CpuCollectiveOptions cpu_collective_options();

}  // namespace fsdp
