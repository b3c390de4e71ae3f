#pragma once
// glibc's malloc, set for training: a fixed mmap threshold, so that every freed block of at least
// that size goes back to the kernel at once.
//
// glibc starts with a 128 KiB threshold and raises it (up to 32 MiB) to the size of each large block
// that is freed; after a few steps activations and autograd's gradients of up to 32 MiB come from
// the heap and stay resident when freed, so a rank's peak RSS measures the heap's high-water mark
// rather than what was alive at once (issue 16: at 2 ranks the sharding saving hardly reached the
// process). A fixed threshold of 1 MiB keeps the heap to small blocks; large tensors are mapped
// and unmapped (FSDP's own large buffers come from its pool, fsdp/memory/buffer_pool.h, and are
// not affected). Measured in docs/benchmarks.md ("Memory and copies").
//
// Example:
//   fsdp::tune_malloc();  // first thing in main(), before tensors are allocated
#include <cstddef>

namespace fsdp {

// Sets glibc's mmap threshold to `mmap_threshold` bytes (mallopt M_MMAP_THRESHOLD). Returns true
// when it was set; false where the C library is not glibc, or when the environment variable
// FSDP_MALLOC_TUNING=0 says to leave malloc as it is (another value than 0 or 1 is reported in
// one line on stderr and tunes). Call it before threads start allocating.
bool tune_malloc(size_t mmap_threshold = size_t{1} << 20);

}  // namespace fsdp
