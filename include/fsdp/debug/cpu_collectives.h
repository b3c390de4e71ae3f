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
// all below min_piece_bytes always takes it: on a 2-core machine with both cores computing, a
// message costs more than the copy it saves for shards of up to a few hundred KiB
// (benchmarks/layout_bench.cpp; docs/benchmarks.md, "The per-parameter layout by default").
//
// Why per parameter is the default where shards are large: a large shard's rows then move in
// place, without the flat layout's copies into and out of one buffer, and the copy saved costs
// more than the extra messages; it was faster than flat on the 85.6M GPT at 2 ranks in every run
// (docs/benchmarks.md, "The per-parameter layout by default"). On bench's 3.3M GPT (shards of
// 512 KiB and less) every unit stays flat.
//
// In the flat layout on a Gloo group, each unit's shards (where they need no cast) live side by
// side in one buffer for good, which is the all-gather's input: no copy-in
// (CpuCollectiveOptions::shards_in_one_buffer; FSDP_CPU_SHARD_BUFFER=0 turns it off).
// Its reduce-scatter copies only the rows that leave the rank; this rank's own rows go straight
// into the gradients (CpuCollectiveOptions::reduce_into_grads; FSDP_CPU_REDUCE_INTO_GRADS=0 turns
// it off).
//
// The flat layout is always used on GPUs (NCCL), for HSDP's reduce, integer
// reshard_after_forward, mixed precision that casts, and 16-bit reductions.
//
// FSDP_CPU_COLLECTIVES=pieces|flat|gather-pieces|reduce-pieces in the environment sets the
// default (read once): both per parameter (the default, as above), flat for every unit, or per
// parameter only for the all-gather / only for the reduce-scatter. FSDP_CPU_PIECE_BYTES=N sets
// min_piece_bytes (0: every unit per parameter, however small its shards). FSDP_CPU_SHARD_BUFFER=0|1
// sets shards_in_one_buffer, FSDP_CPU_REDUCE_INTO_GRADS=0|1 reduce_into_grads,
// FSDP_CPU_UNSHARDED_ONE_ALLOCATION=0|1 unsharded_in_one_allocation.
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
  // Each unit's shards live in one buffer for good (the sharded parameters are views of it). Flat
  // all-gathers on Gloo send this rank's shards from it, so there is no copy-in; where they must be
  // copied in (a GPU, a cast under mixed precision) that copy is one op, on every device. false:
  // each shard on its own, copied in each time as FSDP2 does. [Note: the shards in one buffer] in
  // src/sharding/fsdp_param_group.cpp.
  bool shards_in_one_buffer = true;
  // The flat reduce-scatter packs only the rows that leave the rank (the divide applied as they are
  // copied) and adds this rank's own rows straight from the unsharded gradients into the sharded
  // ones; with no gradients yet they become rows of the reduced buffer. false: FSDP2's input of
  // every rank's rows, reduced, then added into the gradients. [Note: the reduce-scatter into the
  // sharded gradients] in src/sharding/collectives.h. FSDP_CPU_REDUCE_INTO_GRADS=0|1.
  bool reduce_into_grads = true;
  // A unit's unsharded parameters from one allocation (FSDPParam::alloc_unsharded_together), not
  // one each. Always so on a GPU (one caching-allocator call per unit and all-gather, not two per
  // parameter); off by default on the CPU, where each parameter comes from FSDP's buffer pool: with
  // glibc's defaults one allocation per unit raised a rank's peak RSS (docs/benchmarks.md, "What
  // each CPU setting buys"). FSDP_CPU_UNSHARDED_ONE_ALLOCATION=0|1.
  bool unsharded_in_one_allocation = false;
};
void set_cpu_collective_options(const CpuCollectiveOptions& options);
CpuCollectiveOptions cpu_collective_options();

}  // namespace fsdp
