// layer: sharding
#pragma once
// How fully_shard moves a unit's data on the CPU (a Gloo shard group of CPU tensors).
//
// Per parameter (the default, for units that hold a shard of min_piece_bytes or more): each
// parameter's shard is sent from where it lies and each peer's rows are received straight into the
// unsharded parameter (Comm::all_gather_pieces), and each gradient's rows are sent from the
// gradient itself (Comm::reduce_scatter_pieces): no flat all-gather buffer, no copy-in, no
// copy-out, no reduce-scatter input; only this rank's own rows are copied (shard -> unsharded
// parameter). Shards smaller than min_piece_bytes travel packed in one flat message per peer
// (copied in and out as in the flat layout), so a unit of many small parameters does not pay a
// message each. See [Note: FSDP's CPU collectives, per parameter] in src/sharding/collectives.h.
//
// Flat: FSDP2's layout, one message per peer and unit: the shards copied into one flat all-gather
// input, the output copied out into the parameters, the gradients copied into one flat
// reduce-scatter input, moved by Gloo's own all-gather and reduce-scatter. A unit whose shards are
// all below min_piece_bytes always takes it: with every core computing, a message costs more than
// the copy it saves for small shards (bench --mode layout, benchmarks/bench.cpp).
//
// Why per parameter is the default where shards are large: a large shard's rows then move in
// place, without the flat layout's copies into and out of one buffer, and the copy saved costs
// more than the extra messages (docs/benchmarks.md, "The per-parameter layout by default").
//
// The flat layout is always used on GPUs (NCCL), for HSDP's reduce, integer
// reshard_after_forward, mixed precision that casts, and 16-bit reductions. On every device a flat
// unit's shards live side by side in one buffer from its first all-gather on, so copy-in is one
// copy of it ([Note: the shards in one buffer] in src/sharding/fsdp_param_group.cpp).
//
// FSDP_CPU_COLLECTIVES=pieces|flat|gather-pieces|reduce-pieces in the environment sets the
// default (read once): both per parameter (the default, as above), flat for every unit, or per
// parameter only for the all-gather / only for the reduce-scatter. FSDP_CPU_PIECE_BYTES=N sets
// min_piece_bytes (0: every unit per parameter, however small its shards).
#include <cstddef>

namespace fsdp {

// Example:
//   fsdp::CpuCollectiveOptions o;
//   o.gather_per_parameter = o.reduce_per_parameter = false;  // flat for every unit
//   fsdp::set_cpu_collective_options(o);     // between steps, the same on every rank
//   o.gather_per_parameter = o.reduce_per_parameter = true;   // back to per parameter
//   o.min_piece_bytes = 256 << 10;           // for units with a shard of 256 KiB or more
//   fsdp::set_cpu_collective_options(o);
struct CpuCollectiveOptions {
  bool gather_per_parameter = true;  // the all-gather (forward and backward unshard)
  bool reduce_per_parameter = true;  // the reduce-scatter of the gradients
  // Shards below this travel packed in one flat message; a unit with no shard this large is flat.
  size_t min_piece_bytes = 1u << 20;
};
void set_cpu_collective_options(const CpuCollectiveOptions& options);
CpuCollectiveOptions cpu_collective_options();

}  // namespace fsdp
