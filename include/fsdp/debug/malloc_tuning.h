// layer: memory
#pragma once
// glibc's malloc, set for training: a fixed mmap threshold, so that every freed block of at least
// that size goes back to the kernel at once, and a fixed trim threshold, so that the heap of
// smaller blocks is not given back and faulted in again every step.
//
// glibc starts with a 128 KiB threshold and raises it (up to 32 MiB) to the size of each large block
// that is freed; after a few steps activations and autograd's gradients of up to 32 MiB come from
// the heap and stay resident when freed, so a rank's peak RSS measures the heap's high-water mark
// rather than what was alive at once (then, at 2 ranks, the sharding saving hardly reached the
// process). A fixed threshold of 1 MiB keeps the heap to small blocks; large tensors are mapped
// and unmapped (FSDP's own large buffers come from its pool, fsdp/debug/buffer_pool.h, and are
// not affected). Memory and time measured in docs/benchmarks.md ("Memory", "The malloc policy").
//
// Fixing the mmap threshold also stops glibc from moving its trim threshold, which then stays at
// 128 KiB: the heap's top is returned to the kernel whenever that much is free there, which on a
// model whose activations are below 1 MiB (bench's GPT: 512 KiB each) happens every step after
// backward, and the next forward faults the same pages in again, every step. `trim_threshold`
// (default 256 MiB) keeps that much free heap.
//
// Example:
//   fsdp::tune_malloc();  // first thing in main(), before tensors are allocated
#include <cstddef>

namespace fsdp {

// Sets glibc's mmap threshold to `mmap_threshold` bytes and its trim threshold to
// `trim_threshold` bytes (mallopt M_MMAP_THRESHOLD and M_TRIM_THRESHOLD). Returns true when both
// were set; false where the C library is not glibc, or when the environment variable
// FSDP_MALLOC_TUNING=0 says to leave malloc as it is (another value than 0 or 1 is reported in
// one line on stderr and tunes). Call it before threads start allocating.
bool tune_malloc(size_t mmap_threshold = size_t{1} << 20, size_t trim_threshold = size_t{256} << 20);

// The other trade, for step time: glibc keeps freed blocks below `mmap_threshold` in its heap and
// trims the heap only when `trim_threshold` bytes are free at its top (mallopt M_MMAP_THRESHOLD and
// M_TRIM_THRESHOLD, both fixed: no dynamic threshold). After the first step activations and
// gradients come from the heap again and no page is faulted in each step; the peak RSS becomes
// the heap's high-water mark. Under glibc's default (a threshold that moves with the sizes freed)
// FSDP's ranks fault pages in again every step, more than one process does (figures in
// docs/benchmarks.md, "The malloc policy"). Same environment switch and
// return value as tune_malloc.
//
// Example:
//   fsdp::tune_malloc_for_speed();  // first thing in main(), instead of tune_malloc()
bool tune_malloc_for_speed(size_t mmap_threshold = size_t{32} << 20, size_t trim_threshold = size_t{256} << 20);

// The state a long-running process's allocator is already in, from the first step: glibc raises its
// mmap threshold to the size of each mapped block that is freed, up to 32 MiB, and its trim
// threshold to twice that. A Python process that has imported torch has freed such a block, so its
// allocator starts at 32 MiB / 64 MiB; a C++ trainer starts at glibc's 128 KiB / 128 KiB and stays
// at the size of the largest tensor it has freed, so the heap's top is trimmed and faulted in again
// every step (bench's GPT: 1,200-1,800 faults per one-process step, 30-60 after this call). This
// maps and frees one block of just under 32 MiB, so that glibc moves both thresholds itself (to
// 32 MiB / 64 MiB, where the mmap threshold's rise ends), then fixes the trim threshold at 256 MiB:
// a step that frees more than 64 MiB at the heap's top (backward releasing the activations: ~130 MB
// on the 85.6M GPT's FSDP ranks) would otherwise give it back and fault it in again every step,
// ~30,000 faults, for no lower peak (the same pages are in use again at the peak). Thresholds
// the environment fixes (GLIBC_TUNABLES, MALLOC_TRIM_THRESHOLD_ and the like) stay as they are;
// a program's own mallopt calls belong after this one. The cost is memory between peaks: up to
// 256 MiB of free heap kept per process, blocks below 32 MiB reused from the heap instead of
// unmapped, and larger blocks too served from the heap's free top when it holds enough (glibc
// takes any size from the top before it maps; time and peak RSS side by side in
// docs/benchmarks.md, "The malloc policy"). Returns true when the block was freed with glibc
// (whether glibc accepted the trim threshold is not checked: mallopt's result is ignored); false
// where the C library is not glibc, or under FSDP_MALLOC_TUNING=0.
//
// Example:
//   fsdp::raise_malloc_thresholds();  // first thing in main(), before tensors are allocated
bool raise_malloc_thresholds();

}  // namespace fsdp
