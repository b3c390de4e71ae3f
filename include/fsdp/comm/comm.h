#pragma once
// Comm: the collectives FSDP needs, over one c10d process group, with fallbacks where the backend
// lacks an operation or a dtype (the README's `Comm` table lists what Gloo in LibTorch 1.13 lacks):
//   - all_gather_into_tensor without _allgather_base: list all_gather into views of the output;
//   - reduce_scatter_tensor: all_to_all + local sum, the bytes of a ring reduce-scatter (never
//     allreduce + slice, which moves twice as much);
//   - bfloat16 or float16 on a backend without it: moved as its bytes where only data moves,
//     reduced locally in float32 otherwise (an all_reduce becomes reduce-scatter + all-gather);
//   - AVG: sum, then divide.
// Every operation has a timeout (InitOptions::timeout, or FSDP_COLLECTIVE_TIMEOUT_S): a rank that never joins makes the
// others fail with an error instead of hanging.
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/comm/work.h"
#include "fsdp/compat/c10d.h"
#include "fsdp/debug/comm_stats.h"

namespace fsdp::comm {

enum class ReduceOp { Sum, Avg, Max };
enum class BackendKind { Local, Gloo, Nccl };
const char* backend_name(BackendKind kind);

// What the backend does natively; everything else goes through a fallback.
struct Capabilities {
  bool all_gather_base = false;
  bool reduce_scatter_base = false;
  bool bfloat16 = false;
  bool float16 = false;
  bool avg = false;
  static Capabilities for_backend(BackendKind kind);
};

// Default timeout of every collective: FSDP_COLLECTIVE_TIMEOUT_S when set, else 5 minutes.
std::chrono::milliseconds default_collective_timeout();

// Example:
//   auto world = fsdp::dist::world_comm();
//   at::Tensor full = at::empty({world->size() * x.numel()});
//   auto work = world->all_gather_into_tensor(full, x, /*async_op=*/true);
//   work.wait();                                    // errors and timeouts surface here
//   world->all_reduce(x, fsdp::comm::ReduceOp::Avg);
class Comm {
 public:
  // A group of one process: every collective is a local copy (no backend, no network).
  static std::shared_ptr<Comm> single_process(std::string name = "world");

  // `global_ranks[i]` is the global rank of group rank i; `rank` is this process's group rank.
  Comm(compat::BackendPtr backend, BackendKind kind, std::vector<int> global_ranks, int rank,
       std::chrono::milliseconds timeout, std::string name);

  int rank() const { return rank_; }
  int size() const { return static_cast<int>(global_ranks_.size()); }
  const std::vector<int>& global_ranks() const { return global_ranks_; }
  const std::string& name() const { return name_; }
  BackendKind backend_kind() const { return kind_; }
  const Capabilities& capabilities() const { return caps_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  const compat::BackendPtr& backend() const { return backend_; }
  CommStats& stats() { return stats_; }
  // Collectives this Comm has started (each operation below counts one, a group of one too): the
  // sequence number of the latest, 1 for the first. Every rank of the group counts alike.
  uint64_t seq() const { return seq_; }

  // out: size() * in.numel() elements, rank r's input at [r*in.numel(), (r+1)*in.numel()).
  Work all_gather_into_tensor(const at::Tensor& out, const at::Tensor& in, bool async_op = false);
  // in: size() * out.numel() elements; out gets the reduction of every rank's chunk [rank()].
  Work reduce_scatter_tensor(const at::Tensor& out, const at::Tensor& in, ReduceOp op = ReduceOp::Sum,
                             bool async_op = false);
  // Several all-gathers in one operation, each rank's piece received straight where the caller
  // wants it (FSDP's per-parameter gather on the CPU: the pieces land in the unsharded parameters,
  // no flat output and no copy-out; comm/p2p_collectives.cpp). ins[i] is this rank's piece i;
  // outs[i][r] receives rank r's piece i (outs[i][rank()] gets ins[i], copied unless it is that
  // memory). A piece may differ in size from rank to rank (FSDP's last shard), but outs[i][r] must
  // have rank r's ins[i].numel() elements, the same on every rank; empty pieces move nothing. One
  // dtype, contiguous tensors. Gloo groups on CPU tensors (send/recv) and groups of one only:
  // takes_pieces() says whether this group does.
  //
  // Example:
  //   auto world = fsdp::dist::world_comm();      // 2 ranks
  //   at::Tensor w = at::empty({4, 3}), b = at::empty({3});
  //   at::Tensor w_rows = at::randn({2, 3});      // rank r's rows [2r, 2r + 2) of w
  //   at::Tensor b_part = at::randn({world->rank() == 0 ? 2 : 1});   // b's [0, 2) or [2, 3)
  //   world->all_gather_pieces({w_rows, b_part}, {{w.narrow(0, 0, 2), w.narrow(0, 2, 2)},
  //                                               {b.narrow(0, 0, 2), b.narrow(0, 2, 1)}});
  Work all_gather_pieces(const std::vector<at::Tensor>& ins, const std::vector<std::vector<at::Tensor>>& outs,
                         bool async_op = false);
  // Several reduce-scatters in one operation: ins[i][r] goes to rank r, and outs[i] gets the
  // reduction over the ranks of their ins[i][rank()] (outs[i] may be ins[i][rank()] itself: in
  // place). Sizes as all_gather_pieces: outs[i] and every rank's ins[i][rank()] have one numel.
  // Scratch: the size of the outputs, from the buffer pool. Same groups as all_gather_pieces.
  Work reduce_scatter_pieces(const std::vector<at::Tensor>& outs, const std::vector<std::vector<at::Tensor>>& ins,
                             ReduceOp op = ReduceOp::Sum, bool async_op = false);
  // Whether all_gather_pieces / reduce_scatter_pieces take tensors like `t` on this group.
  bool takes_pieces(const at::Tensor& t) const;
  // all_reduce, broadcast and all_gather_into_tensor take host tensors on an NCCL group too:
  // staged through the current CUDA device, and finished before the call returns (async_op or
  // not). For control messages (ids, flags, texts), not for training data.
  // In place.
  Work all_reduce(const at::Tensor& tensor, ReduceOp op = ReduceOp::Sum, bool async_op = false);
  // In place, from group rank `root`.
  Work broadcast(const at::Tensor& tensor, int root, bool async_op = false);
  // Equal splits along the flattened tensors: chunk j of `in` goes to rank j, chunk j of `out`
  // comes from rank j. numel must be divisible by size().
  Work all_to_all(const at::Tensor& out, const at::Tensor& in, bool async_op = false);
  // Uneven splits along dim 0 (c10d's all_to_all_single with split sizes, MPI's alltoallv): rows
  // [sum(in_splits[0..j)), + in_splits[j]) of `in` go to rank j, and rows
  // [sum(out_splits[0..j)), + out_splits[j]) of `out` come from rank j, so out_splits[j] here must
  // be rank j's in_splits[rank()]. Each vector has size() entries (0 allowed), summing to the
  // tensor's size(0); every rank's tensors have one dtype and one row shape (the dims after 0).
  // The byte counters count the rows this rank sends to the other ranks. The desync check
  // (TORCH_DISTRIBUTED_DEBUG=DETAIL) compares the kind, dtype and row shape: splits may differ.
  // The flight record holds this rank's element counts in and out ("all_to_all_uneven").
  //
  // At 2 ranks, rank 0 sends 1 row to itself and 2 to rank 1, rank 1 sends 3 to rank 0:
  // Example:
  //   auto world = fsdp::dist::world_comm();
  //   const bool first = world->rank() == 0;
  //   at::Tensor in = at::randn({3, 4});                  // 3 rows of 4 on either rank
  //   std::vector<int64_t> in_splits = first ? std::vector<int64_t>{1, 2} : std::vector<int64_t>{3, 0};
  //   std::vector<int64_t> out_splits = first ? std::vector<int64_t>{1, 3} : std::vector<int64_t>{2, 0};
  //   at::Tensor out = at::empty({first ? 4 : 2, 4});
  //   world->all_to_all(out, in, out_splits, in_splits);
  Work all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                  const std::vector<int64_t>& in_splits, bool async_op = false);
  Work barrier(bool async_op = false);

 private:
  Work finish(OpKind kind, uint64_t bytes, compat::WorkPtr work, std::function<void()> after, bool async_op,
              const char* op_name);
  compat::WorkPtr backend_all_gather(const at::Tensor& out, const at::Tensor& in);
  compat::WorkPtr backend_all_to_all(const at::Tensor& out, const at::Tensor& in);
  // GlooFallback::PointToPoint (comm/p2p_collectives.cpp); `out` may be `in`'s chunk [rank()].
  Work reduce_scatter_p2p(const at::Tensor& out, const at::Tensor& in, ReduceOp op, bool async_op, uint64_t bytes);
  Work all_gather_p2p(const at::Tensor& out, const at::Tensor& in, bool async_op, uint64_t bytes);
  Work all_gather_pieces_p2p(const std::vector<at::Tensor>& ins, const std::vector<std::vector<at::Tensor>>& outs,
                             bool async_op, uint64_t bytes);
  Work reduce_scatter_pieces_p2p(const std::vector<at::Tensor>& outs, const std::vector<std::vector<at::Tensor>>& ins,
                                 ReduceOp op, bool async_op, uint64_t bytes);
  int take_p2p_tags(size_t count);                // the first of `count` consecutive send/recv tags
  bool moves_as_bits(const at::Tensor& t) const;  // a 16-bit float the backend does not take
  std::string describe(const char* op) const;

  compat::BackendPtr backend_;
  BackendKind kind_;
  Capabilities caps_;
  std::vector<int> global_ranks_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::string name_;
  CommStats stats_;
  uint64_t seq_ = 0;
  uint32_t p2p_ops_ = 0;  // the send/recv tag of each point-to-point collective (same on every rank)
};

}  // namespace fsdp::comm
