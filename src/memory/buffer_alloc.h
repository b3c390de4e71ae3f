#pragma once
// Allocation from FSDP's buffer pool (see fsdp/debug/buffer_pool.h for the policy).
#include <ATen/ATen.h>

#include "fsdp/debug/buffer_pool.h"

namespace fsdp::detail {

// An uninitialised contiguous tensor for `owner`: from the pool when it is a CPU tensor (not
// pinned) of at least min_bytes and the pool is enabled, else from LibTorch's allocator. CPU
// buffers are counted either way.
at::Tensor empty_buffer(at::IntArrayRef sizes, const at::TensorOptions& options, BufferOwner owner);

// Memory for a storage of `nbytes` on `device` whose own allocator is `fallback` (pool rules as
// above; pool only when `fallback` is the CPU allocator).
at::DataPtr allocate_buffer(size_t nbytes, c10::Device device, c10::Allocator* fallback, BufferOwner owner);

// Releases `t`'s memory now and resets `t`, for a buffer of empty_buffer that nobody reads any
// more: a finished Gloo collective's work object keeps its tensors until Gloo's worker thread
// drops them, some time after wait() returned (under load, after the next buffer was allocated:
// two all-gather outputs were seen alive at once). Other tensors: only reset. Never on a buffer a
// collective that has not completed may still touch.
void release_buffer(at::Tensor& t);

// Counts memory FSDP holds but did not allocate (the unsharded gradients autograd made).
void count_buffer(BufferOwner owner, int64_t delta_bytes);

}  // namespace fsdp::detail
