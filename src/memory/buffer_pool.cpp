#include "memory/buffer_alloc.h"

#include <sys/mman.h>
#include <unistd.h>

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <new>
#include <vector>

namespace fsdp {

const char* buffer_owner_name(BufferOwner owner) {
  switch (owner) {
    case BufferOwner::UnshardedParams: return "unsharded params";
    case BufferOwner::AllGatherInput: return "all-gather input";
    case BufferOwner::AllGatherOutput: return "all-gather output";
    case BufferOwner::ReduceScatterInput: return "reduce-scatter input";
    case BufferOwner::ReduceScatterOutput: return "reduce-scatter output";
    case BufferOwner::UnshardedGrads: return "unsharded grads";
    case BufferOwner::PostForwardShards: return "post-forward shards";
    case BufferOwner::CommScratch: return "comm scratch";
  }
  return "?";
}

namespace {

// The ledger (by owner) and the pool share one lock: a few dozen calls per unit and step.
struct State {
  std::mutex mu;
  BufferMemoryStats stats;
  BufferPoolOptions options;
  // Free blocks by mapped size; `resident`: its pages are still in memory (false once trimmed).
  struct Cached {
    void* ptr;
    bool resident;
  };
  std::map<size_t, std::vector<Cached>> cached;
  uint64_t pool_peak_live = 0;  // the live set's high-water mark
};

// Never destroyed: tensors may outlive every static object.
State& state() {
  static State* s = new State();
  return *s;
}

size_t page_round(size_t bytes) {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

void count_locked(State& s, BufferOwner owner, int64_t delta) {
  auto& st = s.stats;
  st.current[static_cast<int>(owner)] += static_cast<uint64_t>(delta);
  st.total += static_cast<uint64_t>(delta);
  if (st.total > st.peak) {
    st.peak = st.total;
    st.at_peak = st.current;
  }
}

void unmap_cached_locked(State& s, uint64_t& cached_to_free) {
  // Gives back cached blocks until `cached_to_free` bytes are gone (or none are left).
  for (auto it = s.cached.begin(); it != s.cached.end() && cached_to_free > 0;) {
    auto& blocks = it->second;
    while (!blocks.empty() && cached_to_free > 0) {
      munmap(blocks.back().ptr, it->first);
      if (blocks.back().resident) s.stats.pool_cached_resident -= it->first;
      blocks.pop_back();
      s.stats.pool_cached -= it->first;
      s.stats.pool_unmapped += 1;
      cached_to_free = it->first >= cached_to_free ? 0 : cached_to_free - it->first;
    }
    it = blocks.empty() ? s.cached.erase(it) : std::next(it);
  }
}

// Returns a block of at least `mapped` bytes; `mapped` becomes the block's size. Best fit among
// the cached blocks up to twice the request (the units of a model ask for a handful of sizes: a
// smaller request may take a larger free block instead of mapping more).
void* pool_get(State& s, size_t& mapped) {
  auto& st = s.stats;
  auto it = s.cached.lower_bound(mapped);
  if (it != s.cached.end() && it->first <= 2 * mapped && !it->second.empty()) {
    // The most recently freed block of that size: the likeliest to be resident still.
    void* p = it->second.back().ptr;
    if (it->second.back().resident) st.pool_cached_resident -= it->first;
    it->second.pop_back();
    mapped = it->first;
    if (it->second.empty()) s.cached.erase(it);
    st.pool_cached -= mapped;
    st.pool_live += mapped;
    st.pool_hits += 1;
    s.pool_peak_live = std::max(s.pool_peak_live, st.pool_live);
    return p;
  }
  // A new mapping: first give back cached blocks so that live + cached stays within 1.25x the live
  // set's high-water mark (counting this block). At exactly 1x, a model whose units ask for many
  // sizes (every parameter its own block) would unmap, at each miss, the small blocks a later
  // request needs, and miss again every step. A quarter's headroom keeps those blocks without
  // raising the peak RSS, because the cache is trimmed while activations peak (docs/benchmarks.md,
  // "Memory").
  const uint64_t limit = std::max<uint64_t>(s.pool_peak_live + s.pool_peak_live / 4, st.pool_live + mapped);
  const uint64_t footprint = st.pool_live + st.pool_cached + mapped;
  if (footprint > limit) {
    uint64_t excess = footprint - limit;
    unmap_cached_locked(s, excess);
  }
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    // Out of address space or memory: drop the whole cache and try once more.
    uint64_t all = st.pool_cached;
    unmap_cached_locked(s, all);
    p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
  }
  st.pool_live += mapped;
  st.pool_misses += 1;
  s.pool_peak_live = std::max(s.pool_peak_live, st.pool_live);
  st.pool_peak_mapped = std::max(st.pool_peak_mapped, st.pool_live + st.pool_cached);
  return p;
}

struct BlockContext {
  void* ptr;
  size_t mapped;  // 0: not from the pool (`inner` owns the memory)
  size_t bytes;
  BufferOwner owner;
  at::DataPtr inner;
};

void release_block(void* ctx_ptr) {
  auto* ctx = static_cast<BlockContext*>(ctx_ptr);
  State& s = state();
  {
    std::lock_guard<std::mutex> lock(s.mu);
    count_locked(s, ctx->owner, -static_cast<int64_t>(ctx->bytes));
    if (ctx->mapped) {
      s.stats.pool_live -= ctx->mapped;
      s.stats.pool_cached += ctx->mapped;
      s.stats.pool_cached_resident += ctx->mapped;
      s.cached[ctx->mapped].push_back({ctx->ptr, true});
    }
  }
  delete ctx;  // frees `inner`, if any, outside the lock
}

}  // namespace

namespace {
// Runs `f(state)` under the lock: every public entry point below is one such call.
template <typename F>
auto locked(F&& f) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  return f(s);
}
}  // namespace

BufferMemoryStats buffer_memory_stats() {
  return locked([](State& s) { return s.stats; });
}

void reset_buffer_memory_peak() {
  locked([](State& s) {
    s.stats.peak = s.stats.total;
    s.stats.at_peak = s.stats.current;
    s.stats.pool_hits = s.stats.pool_misses = s.stats.pool_unmapped = 0;
    s.stats.pool_peak_mapped = s.stats.pool_live + s.stats.pool_cached;
  });
}

void set_buffer_pool_options(const BufferPoolOptions& options) {
  locked([&](State& s) { s.options = options; });
}

BufferPoolOptions buffer_pool_options() {
  return locked([](State& s) { return s.options; });
}

uint64_t release_cached_buffers() {
  return locked([](State& s) {
    const uint64_t before = s.stats.pool_cached;
    uint64_t all = before;
    unmap_cached_locked(s, all);
    s.pool_peak_live = s.stats.pool_live;
    return before;
  });
}

uint64_t trim_cached_buffers(size_t at_least) {
  return locked([at_least](State& s) -> uint64_t {
    if (s.stats.pool_cached_resident < at_least) return 0;
    uint64_t trimmed = 0;
    for (auto& [bytes, blocks] : s.cached) {
      for (auto& b : blocks) {
        if (!b.resident) continue;
        // Private anonymous memory: the pages are dropped now and read back as zeros when touched
        // (a pool block's contents are undefined when handed out, like at::empty's).
        if (madvise(b.ptr, bytes, MADV_DONTNEED) != 0) continue;
        b.resident = false;
        trimmed += bytes;
      }
    }
    s.stats.pool_cached_resident -= trimmed;
    s.stats.pool_trimmed += trimmed;
    return trimmed;
  });
}

namespace detail {

at::DataPtr allocate_buffer(size_t nbytes, c10::Device device, c10::Allocator* fallback, BufferOwner owner) {
  if (!device.is_cpu()) return fallback->allocate(nbytes);  // not counted: the GPU allocator pools
  State& s = state();
  auto* ctx = new BlockContext{nullptr, 0, nbytes, owner, at::DataPtr()};
  {
    std::lock_guard<std::mutex> lock(s.mu);
    if (s.options.enabled && nbytes > 0 && nbytes >= s.options.min_bytes && fallback == c10::GetCPUAllocator()) {
      try {
        ctx->mapped = page_round(nbytes);
        ctx->ptr = pool_get(s, ctx->mapped);
      } catch (...) {
        delete ctx;
        throw;
      }
    }
    count_locked(s, owner, static_cast<int64_t>(nbytes));
  }
  if (!ctx->mapped) {
    try {
      ctx->inner = fallback->allocate(nbytes);
    } catch (...) {
      std::lock_guard<std::mutex> lock(s.mu);
      count_locked(s, owner, -static_cast<int64_t>(nbytes));
      delete ctx;
      throw;
    }
    ctx->ptr = ctx->inner.get();
  }
  return at::DataPtr(ctx->ptr, ctx, &release_block, device);
}

at::Tensor empty_buffer(at::IntArrayRef sizes, const at::TensorOptions& options, BufferOwner owner) {
  if (!options.device().is_cpu() || options.pinned_memory()) return at::empty(sizes, options);
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const size_t nbytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  c10::Allocator* cpu = c10::GetCPUAllocator();
  c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, allocate_buffer(nbytes, options.device(), cpu, owner),
                       /*allocator=*/cpu, /*resizable=*/false);
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                          c10::DispatchKeySet(c10::DispatchKey::CPU), options.dtype());
  t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  return t;
}

void count_buffer(BufferOwner owner, int64_t delta_bytes) {
  locked([&](State& s) { count_locked(s, owner, delta_bytes); });
}

void release_buffer(at::Tensor& t) {
  if (t.defined() && t.device().is_cpu() && t.has_storage()) {
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    if (storage->data_ptr().get_deleter() == &release_block) {
      // The storage object may outlive this call (held by a finished collective's work object);
      // its memory does not: swapped out and released here, in this thread, now.
      at::DataPtr memory = storage->set_data_ptr(at::DataPtr(nullptr, t.device()));
      storage->set_nbytes(0);
    }
  }
  t = at::Tensor();
}

}  // namespace detail
}  // namespace fsdp
