// Comm's point-to-point fallbacks (GlooFallback::PointToPoint, see fsdp/comm/comm.h): the
// collectives Gloo lacks, built on the backend's send/recv so that they need no scratch as large
// as the data.
//
//   reduce-scatter  every chunk j != rank of the input goes to rank j (all sends posted at once);
//                   the chunks for this rank arrive one peer at a time into one chunk of scratch
//                   and are added into the output, which starts as this rank's own chunk (or is
//                   it: `out` may be `in`'s chunk [rank]). Scratch: 1/N of the input, against the
//                   input's whole size for all_to_all + sum. Bytes: a ring's, (N-1)/N of the input.
//                   The first peer's chunk is received while the caller computes; for N > 2 the
//                   others are received in wait() (each needs the scratch back).
//   all-gather      this rank's chunk goes to every peer and every peer's chunk is received
//                   straight into its place in the output, all posted at once: no scratch and no
//                   copy back (LibTorch 1.13's list all-gather goes through c10d's own flat
//                   buffer, as large as the output, and copies it back).
//
//   all-gather of pieces (all_gather_pieces)
//                   the all-gather above with one message per piece: each piece is sent from
//                   where it lies and received straight into its place (FSDP: a shard's rows go
//                   into the unsharded parameter itself); empty pieces are not sent.
//   reduce-scatter of pieces (reduce_scatter_pieces)
//                   the reduce-scatter above with one message per piece: each rank's pieces are
//                   sent from where they lie (FSDP: a gradient's rows of each rank); what arrives
//                   goes into one scratch as large as the outputs, added piece by piece.
//
// Each operation takes its own tag (p2p_ops_, counted alike on every rank as collectives are
// issued in the same order), so two of them in flight never take each other's messages; an
// operation of pieces takes one tag per piece.
// send/recv works are not queued on Gloo's worker threads: their tensors are released when the
// Work is, in the caller's thread.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>

#include "fsdp/comm/backend.h"
#include "fsdp/comm/comm.h"
#include "memory/buffer_alloc.h"

namespace fsdp::comm {

namespace {

// -1: not set (read FSDP_GLOO_FALLBACK on first use).
std::atomic<int> g_fallback{-1};

GlooFallback fallback_from_env() {
  const char* v = std::getenv("FSDP_GLOO_FALLBACK");
  if (!v || !*v || std::string(v) == "p2p") return GlooFallback::PointToPoint;
  if (std::string(v) == "collective") return GlooFallback::Collective;
  throw std::invalid_argument(std::string("fsdp: FSDP_GLOO_FALLBACK='") + v +
                              "' is not a Gloo fallback; use p2p (send/recv, the default) or collective (all_to_all)");
}

// User send/recv tags sit below collectives' slots in Gloo (tags are non-negative ints); 16 bits
// of operation count keep two operations in flight apart.
constexpr int kTagBase = 0x46530000;

std::vector<at::Tensor> one(const at::Tensor& t) { return {t}; }

// Gloo's send/recv can throw when they are posted (a peer gone: "Connection closed by peer"), not
// only from wait(): such a failure becomes the Work's, so that it surfaces from wait() as a
// CommError naming the operation, like every other collective's (the flight recorder notes it).
std::function<void()> rethrow(std::exception_ptr error) {
  return [error]() { std::rethrow_exception(error); };
}

}  // namespace

void set_gloo_fallback(GlooFallback fallback) { g_fallback = static_cast<int>(fallback); }

GlooFallback gloo_fallback() {
  int v = g_fallback.load();
  if (v < 0) {
    v = static_cast<int>(fallback_from_env());
    g_fallback = v;
  }
  return static_cast<GlooFallback>(v);
}

int Comm::take_p2p_tags(size_t count) {
  const int first = kTagBase + static_cast<int>(p2p_ops_ & 0xffff);
  p2p_ops_ += static_cast<uint32_t>(count);
  return first;
}

Work Comm::reduce_scatter_p2p(const at::Tensor& out, const at::Tensor& in, ReduceOp rop, bool async_op,
                              uint64_t bytes) {
  const int n = size(), r = rank_;
  const int tag = take_p2p_tags(1);
  const int64_t chunk = out.numel();
  const at::Tensor flat_in = in.view(-1);
  at::Tensor flat_out = out.view(-1);
  const at::Tensor mine = flat_in.narrow(0, r * chunk, chunk);
  if (flat_out.data_ptr() != mine.data_ptr()) flat_out.copy_(mine);
  std::vector<compat::WorkPtr> sends;
  at::Tensor scratch;
  compat::WorkPtr first_recv;
  try {
    for (int d = 1; d < n; ++d) {
      const int peer = (r + d) % n;
      auto t = one(flat_in.narrow(0, peer * chunk, chunk));
      sends.push_back(backend_->send(t, peer, tag));
    }
    // One chunk of scratch, from the buffer pool (the same size call after call).
    scratch = fsdp::detail::empty_buffer({chunk}, in.options(), BufferOwner::CommScratch);
    auto first = one(scratch);
    first_recv = backend_->recv(first, (r + n - 1) % n, tag);
  } catch (const std::exception&) {
    return finish(OpKind::ReduceScatter, bytes, compat::WorkPtr(), rethrow(std::current_exception()), async_op,
                  "reduce_scatter_tensor");
  }
  const auto timeout = timeout_;
  auto after = [this, sends, scratch, flat_out, rop, n, r, tag, timeout]() mutable {
    for (int d = 1; d < n; ++d) {
      if (d > 1) {  // the previous chunk is summed: the scratch takes the next peer's
        auto t = one(scratch);
        backend_->recv(t, (r + n - d) % n, tag)->wait(timeout);
      }
      if (rop == ReduceOp::Max)
        at::maximum_out(flat_out, flat_out, scratch);
      else
        flat_out.add_(scratch);
    }
    if (rop == ReduceOp::Avg) flat_out.div_(n);
    for (const auto& s : sends) s->wait(timeout);
  };
  return finish(OpKind::ReduceScatter, bytes, std::move(first_recv), after, async_op, "reduce_scatter_tensor");
}

Work Comm::all_gather_p2p(const at::Tensor& out, const at::Tensor& in, bool async_op, uint64_t bytes) {
  const int n = size(), r = rank_;
  const int tag = take_p2p_tags(1);
  // Only bytes move: a 16-bit float the backend does not take travels as its bytes.
  at::Tensor flat_out = out.view(-1), flat_in = in.view(-1);
  if ((in.scalar_type() == at::kBFloat16 && !caps_.bfloat16) || (in.scalar_type() == at::kHalf && !caps_.float16)) {
    flat_out = flat_out.view(at::kByte);
    flat_in = flat_in.view(at::kByte);
  }
  const int64_t chunk = flat_in.numel();
  const at::Tensor mine = flat_out.narrow(0, r * chunk, chunk);
  if (mine.data_ptr() != flat_in.data_ptr()) mine.copy_(flat_in);
  std::vector<compat::WorkPtr> pending;
  compat::WorkPtr last_recv;
  try {
    for (int d = 1; d < n; ++d) {
      auto t = one(mine);
      pending.push_back(backend_->send(t, (r + d) % n, tag));
    }
    for (int d = 1; d < n - 1; ++d) {
      const int src = (r + n - d) % n;
      auto t = one(flat_out.narrow(0, src * chunk, chunk));
      pending.push_back(backend_->recv(t, src, tag));
    }
    const int last_src = (r + 1) % n;
    auto last = one(flat_out.narrow(0, last_src * chunk, chunk));
    last_recv = backend_->recv(last, last_src, tag);
  } catch (const std::exception&) {
    return finish(OpKind::AllGather, bytes, compat::WorkPtr(), rethrow(std::current_exception()), async_op,
                  "all_gather_into_tensor");
  }
  const auto timeout = timeout_;
  auto after = [pending, timeout]() {
    for (const auto& w : pending) w->wait(timeout);
  };
  return finish(OpKind::AllGather, bytes, std::move(last_recv), after, async_op, "all_gather_into_tensor");
}

}  // namespace fsdp::comm

namespace fsdp::comm {

Work Comm::all_gather_pieces_p2p(const std::vector<at::Tensor>& ins, const std::vector<std::vector<at::Tensor>>& outs,
                                 bool async_op, uint64_t bytes) {
  const int n = size(), r = rank_;
  const int first_tag = take_p2p_tags(ins.size());
  const bool as_bytes = moves_as_bits(ins.front());
  auto flat = [as_bytes](const at::Tensor& t) { return as_bytes ? t.view(-1).view(at::kByte) : t.view(-1); };
  std::vector<compat::WorkPtr> pending;
  try {
    // Sends first (the peers' receives are posted or soon will be), then the receives, then this
    // rank's own pieces are copied while the data moves.
    for (size_t i = 0; i < ins.size(); ++i) {
      if (ins[i].numel() == 0) continue;
      for (int d = 1; d < n; ++d) {
        auto t = one(flat(ins[i]));
        pending.push_back(backend_->send(t, (r + d) % n, first_tag + static_cast<int>(i)));
      }
    }
    for (size_t i = 0; i < ins.size(); ++i) {
      for (int d = 1; d < n; ++d) {
        const int src = (r + n - d) % n;
        const at::Tensor& dst = outs[i][static_cast<size_t>(src)];
        if (dst.numel() == 0) continue;
        auto t = one(flat(dst));
        pending.push_back(backend_->recv(t, src, first_tag + static_cast<int>(i)));
      }
    }
  } catch (const std::exception&) {
    return finish(OpKind::AllGather, bytes, compat::WorkPtr(), rethrow(std::current_exception()), async_op,
                  "all_gather_pieces");
  }
  for (size_t i = 0; i < ins.size(); ++i) {
    const at::Tensor& own = outs[i][static_cast<size_t>(r)];
    if (ins[i].numel() > 0 && own.data_ptr() != ins[i].data_ptr()) own.view(-1).copy_(ins[i].view(-1));
  }
  compat::WorkPtr last;
  if (!pending.empty()) {
    last = std::move(pending.back());
    pending.pop_back();
  }
  const auto timeout = timeout_;
  auto after = [pending, timeout]() {
    for (const auto& w : pending) w->wait(timeout);
  };
  return finish(OpKind::AllGather, bytes, std::move(last), after, async_op, "all_gather_pieces");
}

Work Comm::reduce_scatter_pieces_p2p(const std::vector<at::Tensor>& outs,
                                     const std::vector<std::vector<at::Tensor>>& ins, ReduceOp rop, bool async_op,
                                     uint64_t bytes) {
  const int n = size(), r = rank_;
  const int first_tag = take_p2p_tags(outs.size());
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto& o : outs) {
    offsets.push_back(total);
    total += o.numel();
  }
  std::vector<compat::WorkPtr> sends;
  std::vector<compat::WorkPtr> first_recvs;
  at::Tensor scratch;
  // Posts the receives of peer `src`'s pieces into the scratch.
  auto post_recvs = [this, outs, offsets, first_tag](const at::Tensor& into, int src) {
    std::vector<compat::WorkPtr> recvs;
    for (size_t i = 0; i < outs.size(); ++i) {
      if (outs[i].numel() == 0) continue;
      auto t = one(into.narrow(0, offsets[i], outs[i].numel()));
      recvs.push_back(backend_->recv(t, src, first_tag + static_cast<int>(i)));
    }
    return recvs;
  };
  try {
    for (int d = 1; d < n; ++d) {
      const int peer = (r + d) % n;
      for (size_t i = 0; i < ins.size(); ++i) {
        const at::Tensor& piece = ins[i][static_cast<size_t>(peer)];
        if (piece.numel() == 0) continue;
        auto t = one(piece.view(-1));
        sends.push_back(backend_->send(t, peer, first_tag + static_cast<int>(i)));
      }
    }
    // One scratch as large as the outputs, from the buffer pool (the same size call after call).
    scratch =
        fsdp::detail::empty_buffer({std::max<int64_t>(total, 1)}, outs.front().options(), BufferOwner::CommScratch);
    first_recvs = post_recvs(scratch, (r + n - 1) % n);
  } catch (const std::exception&) {
    return finish(OpKind::ReduceScatter, bytes, compat::WorkPtr(), rethrow(std::current_exception()), async_op,
                  "reduce_scatter_pieces");
  }
  // This rank's own contribution starts each output, while the data moves.
  for (size_t i = 0; i < outs.size(); ++i) {
    const at::Tensor& own = ins[i][static_cast<size_t>(r)];
    if (outs[i].numel() > 0 && own.data_ptr() != outs[i].data_ptr()) outs[i].view(-1).copy_(own.view(-1));
  }
  compat::WorkPtr last;
  if (!first_recvs.empty()) {
    last = std::move(first_recvs.back());
    first_recvs.pop_back();
  }
  const auto timeout = timeout_;
  auto after = [outs, offsets, sends, first_recvs, scratch, post_recvs, rop, n, r, timeout]() mutable {
    for (int d = 1; d < n; ++d) {
      if (d > 1) {  // the previous peer's pieces are added: the scratch takes the next peer's
        for (const auto& w : post_recvs(scratch, (r + n - d) % n)) w->wait(timeout);
      } else {
        for (const auto& w : first_recvs) w->wait(timeout);
      }
      for (size_t i = 0; i < outs.size(); ++i) {
        if (outs[i].numel() == 0) continue;
        at::Tensor out = outs[i].view(-1);
        const at::Tensor got = scratch.narrow(0, offsets[i], outs[i].numel());
        if (rop == ReduceOp::Max)
          at::maximum_out(out, out, got);
        else
          out.add_(got);
      }
    }
    if (rop == ReduceOp::Avg) {
      for (const auto& o : outs) o.div_(n);
    }
    for (const auto& s : sends) s->wait(timeout);
    fsdp::detail::release_buffer(scratch);
  };
  return finish(OpKind::ReduceScatter, bytes, std::move(last), after, async_op, "reduce_scatter_pieces");
}

}  // namespace fsdp::comm
