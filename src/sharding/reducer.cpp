#include "reducer.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdio>
#include <new>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "autograd_hooks.h"
#include "fsdp/comm/work.h"

namespace fsdp::detail {

// Every rank's shared segment, mapped into this process ([Note: Shared-memory all-reduce]). A
// segment starts with its rank's phase counter (a cache line of its own), then the buckets, each
// at a 64-byte boundary. The bucket tensors hold a reference, so the mappings outlive the reducer
// as long as a gradient does.
struct Reducer::SharedSegments {
  static constexpr int64_t kHeader = 64;
  std::vector<void*> maps;  // by group rank
  size_t bytes = 0;
  uint32_t phase = 0;  // phases this rank has passed
  ~SharedSegments() {
    for (void* m : maps) {
      if (m != nullptr) munmap(m, bytes);
    }
  }
  std::atomic<uint32_t>& counter(int rank) { return *static_cast<std::atomic<uint32_t>*>(maps[rank]); }
  char* data(int rank) { return static_cast<char*>(maps[rank]); }
};

namespace {

// Waits until a peer's phase counter reaches `target`: a short spin (the peers usually arrive
// together), then sleeps on the counter's futex (shared, not private: another process wakes it).
void wait_for_phase(std::atomic<uint32_t>& counter, uint32_t target, std::chrono::steady_clock::time_point deadline,
                    int peer, const char* phase) {
  auto reached = [target](uint32_t v) { return static_cast<int32_t>(v - target) >= 0; };
  for (int spin = 0; spin < 2048; ++spin) {
    if (reached(counter.load(std::memory_order_acquire))) return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  while (true) {
    const uint32_t v = counter.load(std::memory_order_acquire);
    if (reached(v)) return;
    if (std::chrono::steady_clock::now() > deadline) {
      throw comm::CommError(std::string("fsdp::replicate: the shared-memory all-reduce timed out waiting for rank ") +
                            std::to_string(peer) + " to finish " + phase +
                            " (a rank died or stopped before the end of its backward?)");
    }
    timespec nap{0, 2000000};  // 2 ms: the deadline is checked between sleeps
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&counter), FUTEX_WAIT, v, &nap, nullptr, 0);
  }
}

std::string hex(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// [lo, hi) of the chunk of `numel` elements that `rank` sums: equal chunks, multiples of 16
// elements (whole vectors) but the last.
std::pair<int64_t, int64_t> chunk_of(int64_t numel, int rank, int world) {
  const int64_t chunk = ((numel + world - 1) / world + 15) / 16 * 16;
  const int64_t lo = std::min(numel, chunk * rank);
  return {lo, std::min(numel, lo + chunk)};
}

}  // namespace

Reducer::Reducer(std::vector<at::Tensor> params, std::shared_ptr<comm::Comm> comm, int64_t bucket_cap_bytes,
                 int64_t first_bucket_cap_bytes)
    : params_(std::move(params)), comm_(std::move(comm)) {
  bucket_of_.resize(params_.size());
  slot_of_.resize(params_.size());
  ready_.assign(params_.size(), false);
  world_ = comm_->size();
  divide_ = world_ > 1 && !comm_->capabilities().avg;
  // Reverse order: the last layers' gradients are ready first, so their bucket goes out first.
  for (size_t k = params_.size(); k-- > 0;) {
    const at::Tensor& p = params_[k];
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    bool fresh = buckets_.empty();
    if (!fresh) {
      const Bucket& b = buckets_.back();
      const at::Tensor& first = params_[b.params.front()];
      const int64_t cap = buckets_.size() == 1 ? std::min(first_bucket_cap_bytes, bucket_cap_bytes) : bucket_cap_bytes;
      fresh = first.scalar_type() != p.scalar_type() || first.device() != p.device() ||
              (b.numel * static_cast<int64_t>(first.element_size()) + bytes > cap);
    }
    if (fresh) buckets_.emplace_back();
    Bucket& b = buckets_.back();
    bucket_of_[k] = buckets_.size() - 1;
    slot_of_[k] = b.params.size();
    b.params.push_back(k);
    b.offsets.push_back(b.numel);
    b.numel += p.numel();
  }
  reset();
}

void Reducer::install_hooks() {
  std::weak_ptr<Reducer> weak = weak_from_this();
  for (size_t i = 0; i < params_.size(); ++i) {
    grad_accumulators_.push_back(register_grad_accumulated_hook(params_[i], [weak, i] {
      if (auto self = weak.lock()) self->on_grad_ready(i);
    }));
  }
}

void Reducer::reset() {
  ready_.assign(params_.size(), false);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work = comm::Work();
    b.launched = false;
  }
  next_bucket_ = 0;
  callback_queued_ = false;
}

void Reducer::on_grad_ready(size_t index) {
  if (!requires_gradient_sync) return;  // no-sync: .grad keeps accumulating locally
  if (!callback_queued_) {
    callback_queued_ = true;
    std::weak_ptr<Reducer> weak = weak_from_this();
    queue_final_callback([weak] {
      if (auto self = weak.lock()) self->finalize();
    });
  }
  if (ready_[index]) return;
  ready_[index] = true;
  fill_slot(index);
  --buckets_[bucket_of_[index]].pending;
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) launch(buckets_[next_bucket_++]);
}

void Reducer::allocate(Bucket& b) {
  if (b.flat.defined()) return;
  const at::Tensor& first = params_[b.params.front()];
  if (shm_) {
    const size_t i = static_cast<size_t>(&b - buckets_.data());
    b.flat = at::from_blob(
        shm_->data(comm_->rank()) + shm_offset_[i], {b.numel}, [keep = shm_](void*) {},
        first.options().requires_grad(false));
  } else {
    b.flat = at::empty({b.numel}, first.options().requires_grad(false));
  }
  b.divisor = at::scalar_tensor(static_cast<double>(world_), b.flat.options());
  for (size_t j = 0; j < b.params.size(); ++j) {
    // set_ rather than narrow().view(): the same memory without an autograd view, which
    // LibTorch 1.13's Optimizer::zero_grad() could not detach_().
    const at::Tensor& p = params_[b.params[j]];
    at::Tensor slot = at::empty({0}, b.flat.options());
    std::vector<int64_t> strides(p.dim(), 1);  // contiguous
    for (int64_t d = p.dim() - 1; d > 0; --d) strides[d - 1] = strides[d] * p.size(d);
    slot.set_(b.flat.storage(), b.flat.storage_offset() + b.offsets[j], p.sizes(), strides);
    b.slots.push_back(slot);
  }
}

void Reducer::fill_slot(size_t index) {
  torch::NoGradGuard no_grad;
  Bucket& b = buckets_[bucket_of_[index]];
  allocate(b);
  at::Tensor& g = params_[index].mutable_grad();
  at::Tensor slot = b.slots[slot_of_[index]];  // a handle (div_out writes through it)
  if (!g.defined()) {
    slot.zero_();  // no gradient here this time; another rank may have one
    return;
  }
  if (g.data_ptr() == slot.data_ptr() && g.sizes() == slot.sizes() && g.strides() == slot.strides()) {
    if (divide_) slot.div_(b.divisor);  // backward accumulated into the bucket
    return;
  }
  if (divide_ && g.layout() == at::kStrided && g.scalar_type() == slot.scalar_type()) {
    at::div_out(slot, g, b.divisor);  // one pass: the copy divides
  } else {
    slot.copy_(g);
    if (divide_) slot.div_(b.divisor);
  }
  g = slot;
}

void Reducer::launch(Bucket& b) {
  // Parameters backward did not reach this time: what .grad holds (no-sync accumulation), or zeros.
  for (size_t index : b.params) {
    if (!ready_[index]) fill_slot(index);
  }
  allocate(b);
  // Shared memory: every bucket at the end of backward (finalize).
  if (!shm_) b.work = comm_->all_reduce(b.flat, divide_ ? comm::ReduceOp::Sum : comm::ReduceOp::Avg, /*async_op=*/true);
  b.launched = true;
}

void Reducer::try_shared_memory() {
  if (world_ < 2 || comm_->backend_kind() == comm::BackendKind::Local) return;
  // Deterministic on every rank (the same parameters): CPU buckets of float32 or float64.
  std::vector<int64_t> offsets;
  int64_t total = SharedSegments::kHeader;
  for (const auto& b : buckets_) {
    const at::Tensor& first = params_[b.params.front()];
    if (!first.device().is_cpu() || (first.scalar_type() != at::kFloat && first.scalar_type() != at::kDouble)) return;
    offsets.push_back(total);
    total += (b.numel * static_cast<int64_t>(first.element_size()) + 63) / 64 * 64;
  }
  const int rank = comm_->rank();
  at::Tensor token = at::zeros({2}, at::kLong);
  if (rank == 0) {
    std::random_device rd;
    token.data_ptr<int64_t>()[0] = static_cast<int64_t>((static_cast<uint64_t>(rd()) << 32) ^ rd());
    token.data_ptr<int64_t>()[1] = static_cast<int64_t>(getpid());
  }
  comm_->broadcast(token, 0);
  const std::string prefix = "/fsdp-replicate-" + hex(static_cast<uint64_t>(token.data_ptr<int64_t>()[0])) + "-" +
                             std::to_string(token.data_ptr<int64_t>()[1]) + "-";
  // Every rank's verdict on a step: all ranks go on only if none failed.
  auto all_ok = [this](bool ok) {
    at::Tensor failed = at::full({1}, ok ? 0 : 1, at::kInt);
    comm_->all_reduce(failed, comm::ReduceOp::Sum);
    return failed.item<int>() == 0;
  };
  auto seg = std::make_shared<SharedSegments>();
  seg->bytes = static_cast<size_t>(total);
  seg->maps.assign(static_cast<size_t>(world_), nullptr);
  const std::string mine = prefix + std::to_string(rank);
  bool ok = false;
  const int fd = shm_open(mine.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd >= 0) {
    // posix_fallocate: a /dev/shm too small fails here rather than as SIGBUS in backward.
    if (ftruncate(fd, total) == 0 && posix_fallocate(fd, 0, total) == 0) {
      void* m = mmap(nullptr, seg->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (m != MAP_FAILED) {
        seg->maps[rank] = m;
        new (m) std::atomic<uint32_t>(0);
        ok = true;
      }
    }
    close(fd);
  }
  ok = all_ok(ok);
  if (ok) {
    // Another host's rank has no segment of that name here.
    for (int r = 0; r < world_ && ok; ++r) {
      if (r == rank) continue;
      const int pfd = shm_open((prefix + std::to_string(r)).c_str(), O_RDWR, 0);
      struct stat st {};
      ok = pfd >= 0 && fstat(pfd, &st) == 0 && st.st_size == total;
      if (ok) {
        void* m = mmap(nullptr, seg->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, pfd, 0);
        ok = m != MAP_FAILED;
        if (ok) seg->maps[r] = m;
      }
      if (pfd >= 0) close(pfd);
    }
    ok = all_ok(ok);  // after this, every rank has mapped every segment (or none goes on)
  }
  if (fd >= 0) shm_unlink(mine.c_str());
  if (!ok) return;  // seg unmaps what it mapped
  shm_ = std::move(seg);
  shm_offset_ = std::move(offsets);
  divide_ = true;  // a sum of divided gradients, whatever the backend's AVG
}

void Reducer::shared_all_reduce() {
  torch::NoGradGuard no_grad;
  SharedSegments& s = *shm_;
  const int rank = comm_->rank();
  const auto deadline = std::chrono::steady_clock::now() + comm_->timeout();
  auto phase = [&](const char* what) {
    const uint32_t target = ++s.phase;
    s.counter(rank).store(target, std::memory_order_release);
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&s.counter(rank)), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
    for (int r = 0; r < world_; ++r) {
      if (r != rank) wait_for_phase(s.counter(r), target, deadline, r, what);
    }
  };
  auto peer = [&](int r, size_t i) {
    const Bucket& b = buckets_[i];
    return at::from_blob(s.data(r) + shm_offset_[i], {b.numel}, b.flat.options());
  };
  phase("its backward");
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const auto [lo, hi] = chunk_of(buckets_[i].numel, rank, world_);
    if (hi == lo) continue;
    at::Tensor own = buckets_[i].flat.narrow(0, lo, hi - lo);
    for (int r = 0; r < world_; ++r) {
      if (r != rank) own.add_(peer(r, i).narrow(0, lo, hi - lo));
    }
  }
  phase("summing its chunk");
  for (size_t i = 0; i < buckets_.size(); ++i) {
    for (int r = 0; r < world_; ++r) {
      const auto [lo, hi] = chunk_of(buckets_[i].numel, r, world_);
      if (r == rank || hi == lo) continue;
      buckets_[i].flat.narrow(0, lo, hi - lo).copy_(peer(r, i).narrow(0, lo, hi - lo));
    }
  }
  phase("copying the others' chunks");  // no rank writes its buckets again while a peer reads them
}

void Reducer::finalize() {
  while (next_bucket_ < buckets_.size()) launch(buckets_[next_bucket_++]);
  if (shm_) shared_all_reduce();
  torch::NoGradGuard no_grad;
  for (auto& b : buckets_) {
    b.work.wait();  // the average, in place: the gradients that are slots hold it already
    for (size_t j = 0; j < b.params.size(); ++j) {
      at::Tensor& g = params_[b.params[j]].mutable_grad();
      // No gradient here this time: take the average only if some rank had one (the same
      // decision on every rank).
      if (!g.defined() && b.slots[j].ne(0).any().item<bool>()) g = b.slots[j];
    }
  }
  reset();
}

}  // namespace fsdp::detail
