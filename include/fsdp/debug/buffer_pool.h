// layer: memory
#pragma once
// FSDP's own memory: the bytes of the buffers fully_shard and its collectives allocate (our
// counting, by owner), and the caching pool they come from on the CPU. The lowest layer: comm and
// sharding both allocate from it.
//
// Owners: the unsharded parameters (re-allocated at each unshard), the all-gather input and
// output, the reduce-scatter input and output (on the CPU the output is this rank's row of the
// input: counted as input), the unsharded gradients from the moment
// post_backward takes them until they are in the reduce-scatter input, and the post-forward
// shards of an integer reshard_after_forward, and the scratch buffers of Comm's Gloo fallbacks
// (the reduce-scatter's all_to_all output). Sharded parameters, sharded gradients and the
// optimizer state are the training state, not FSDP's buffers (count them from the module and the
// optimizer).
//
// The pool: on the CPU every FSDP buffer of at least BufferPoolOptions::min_bytes comes from a
// cache of page-aligned blocks mapped with mmap, kept when freed and handed out again to a request
// of the same size: the transformer blocks of a model ask for the same sizes unit after unit and
// step after step, so after the first step nothing is mapped, faulted in or returned to the
// kernel. The cache holds at most a quarter more than the largest set of blocks that were alive
// at once (before it maps a new block it unmaps cached ones until live + cached + new <= 1.25x
// that high-water mark), so the pool's footprint is within 1.25x the live set's peak (the quarter
// keeps blocks of sizes a later request needs: src/memory/buffer_pool.cpp). fully_shard trims the cache's pages
// when forward ends (BufferPoolOptions::trim_after_forward): the blocks stay mapped, but while the
// activations are at their largest only the live blocks are resident (and, with
// BufferPoolOptions::trim_after_backward, when backward ends, before the optimizer step). Smaller buffers and other
// devices use LibTorch's allocator (a GPU's caching allocator already pools).
#include <array>
#include <cstddef>
#include <cstdint>

namespace fsdp {

enum class BufferOwner : int {
  UnshardedParams = 0,
  AllGatherInput,
  AllGatherOutput,
  ReduceScatterInput,
  ReduceScatterOutput,
  UnshardedGrads,
  PostForwardShards,
  CommScratch,
};
inline constexpr int kBufferOwners = 8;
const char* buffer_owner_name(BufferOwner owner);

struct BufferMemoryStats {
  std::array<uint64_t, kBufferOwners> current{};  // bytes alive now, by owner
  std::array<uint64_t, kBufferOwners> at_peak{};  // by owner, at the moment `peak` was reached
  uint64_t total = 0;                             // alive now, all owners
  uint64_t peak = 0;                              // the most alive at once since the last reset
  // The pool (CPU): blocks alive, blocks cached (freed, kept for reuse), the most mapped at once,
  // and how many requests a cached block served (hits) or needed a new mapping (misses).
  uint64_t pool_live = 0, pool_cached = 0, pool_peak_mapped = 0, pool_hits = 0, pool_misses = 0;
  uint64_t pool_unmapped = 0;  // blocks given back to the kernel to keep the footprint at the peak
  // Of pool_cached, the bytes whose pages are resident (not trimmed since they were freed), and the
  // bytes trim_cached_buffers() has given back so far (cumulative; not reset by reset_buffer_memory_peak).
  uint64_t pool_cached_resident = 0, pool_trimmed = 0;
};

// This process's figures (all fully_shard units together).
BufferMemoryStats buffer_memory_stats();
// Starts a new peak (and new pool hit/miss counts) from what is alive now.
void reset_buffer_memory_peak();

// Example:
//   fsdp::BufferPoolOptions pool;
//   pool.enabled = false;                  // every buffer from LibTorch's allocator (for comparison)
//   fsdp::set_buffer_pool_options(pool);   // before the first forward
struct BufferPoolOptions {
  bool enabled = true;
  size_t min_bytes = 64 * 1024;  // smaller buffers come from LibTorch's allocator
  // fully_shard trims the cache (trim_cached_buffers) when the root's forward ends: from there
  // until the first unit's backward is done the activations are at their largest, while the
  // cache holds blocks that backward needs only later (docs/benchmarks.md, "Memory": the pool's
  // cache was most of the difference between the trimmed and untrimmed peaks). The blocks stay mapped (no new mapping,
  // no miss): their pages are faulted in again when they are handed out. false: the cache stays resident
  // (docs/benchmarks.md, "Memory").
  bool trim_after_forward = true;
  // ... but only when at least this many cached bytes are resident: a trim costs faulting the same
  // pages in again during backward, every step: worth it where the cache is large against the
  // peak, not where it is a few MB (docs/benchmarks.md, "Memory"). 0: always trim.
  size_t trim_min_bytes = 32u << 20;
  // fully_shard also trims the cache when backward ends (the root's final callback, once the last
  // reduce-scatter has been waited for and the gradients are in place): the optimizer step that
  // usually follows allocates its state and temporaries while the cache (every unit's freed
  // buffers: the largest unit's parameters, gradients and reduce-scatter input, and more) would
  // otherwise stay resident through it. The trade is trim_after_forward's: the trimmed pages are
  // faulted in again (zero-filled) when the next step's forward hands the blocks out, every step.
  // Worth it where the optimizer step is the peak (a large model near the memory limit: a 1.1B
  // Llama at 2 ranks, docs/benchmarks.md); off by default. Honours trim_min_bytes.
  bool trim_after_backward = false;
};
void set_buffer_pool_options(const BufferPoolOptions& options);
BufferPoolOptions buffer_pool_options();
// Unmaps every cached block (the live ones stay); returns the bytes given back.
uint64_t release_cached_buffers();
// Gives back the pages of every cached block (madvise MADV_DONTNEED) but keeps the blocks mapped
// and cached: the resident set falls by the cache's size now, and a trimmed block handed out later
// is faulted in again (zero-filled pages) instead of being mapped anew. Returns the bytes trimmed:
// 0 (and nothing done) when fewer than `at_least` cached bytes are resident.
uint64_t trim_cached_buffers(size_t at_least = 0);

}  // namespace fsdp
