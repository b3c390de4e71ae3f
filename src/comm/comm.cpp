#include "fsdp/comm/comm.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <cstdlib>
#include <sstream>
#include <stdexcept>

#include "comm/async_watch.h"
#include "fsdp/comm/backend.h"
#include "fsdp/debug/desync.h"
#include "fsdp/debug/flight_recorder.h"
#include "memory/buffer_alloc.h"

namespace fsdp::comm {

const char* backend_name(BackendKind kind) {
  switch (kind) {
    case BackendKind::Local: return "local";
    case BackendKind::Gloo: return "gloo";
    case BackendKind::Nccl: return "nccl";
  }
  return "?";
}

Capabilities Capabilities::for_backend(BackendKind kind) {
  Capabilities c;
  switch (kind) {
    case BackendKind::Local: c = {true, true, true, true, true}; break;
    case BackendKind::Gloo:
      c.all_gather_base = compat::GlooCapabilities::all_gather_base;
      c.reduce_scatter_base = compat::GlooCapabilities::reduce_scatter_base;
      c.bfloat16 = compat::GlooCapabilities::bfloat16;
      c.float16 = compat::GlooCapabilities::float16;
      c.avg = compat::GlooCapabilities::avg;
      break;
    case BackendKind::Nccl: c = {true, true, true, true, true}; break;
  }
  return c;
}

std::chrono::milliseconds default_collective_timeout() {
  if (const char* s = std::getenv("FSDP_COLLECTIVE_TIMEOUT_S")) {
    char* end = nullptr;
    double seconds = std::strtod(s, &end);
    if (end != s && *end == '\0' && seconds > 0) {
      return std::chrono::milliseconds(static_cast<long long>(seconds * 1000.0));
    }
    throw std::invalid_argument(std::string("fsdp: FSDP_COLLECTIVE_TIMEOUT_S='") + s +
                                "' is not a positive number of seconds");
  }
  return std::chrono::minutes(5);
}

namespace {

[[noreturn]] void bad_argument(const std::string& op, const std::string& why) {
  throw std::invalid_argument("fsdp::Comm::" + op + ": " + why);
}

void check_tensor(const std::string& op, const char* what, const at::Tensor& t, BackendKind kind) {
  if (!t.defined()) bad_argument(op, std::string(what) + " is undefined");
  if (!t.is_contiguous()) bad_argument(op, std::string(what) + " must be contiguous (call .contiguous())");
  // Gloo also takes CUDA tensors (staged through pinned host memory by c10d): several ranks
  // sharing one GPU, which NCCL refuses.
  if (kind == BackendKind::Gloo && !t.device().is_cpu() && !t.device().is_cuda()) {
    bad_argument(op, std::string(what) + " is on " + t.device().str() + "; the Gloo backend takes CPU or CUDA tensors");
  }
  if (kind == BackendKind::Nccl && !t.device().is_cuda()) {
    bad_argument(op, std::string(what) + " is on " + t.device().str() + "; the NCCL backend takes CUDA tensors");
  }
}

// [Note: host tensors on NCCL] Control messages are host tensors: a checkpoint's save id and
// outcome, train_gpt's error texts, a state dict's rank-0 values. NCCL moves device memory only,
// so on an NCCL group broadcast, all_reduce and all_gather_into_tensor stage host tensors through
// the current CUDA device (the one the group is bound to: comm/backend.cpp) and wait, as c10d's
// Gloo stages CUDA tensors through the host. Without it train_gpt on a GPU failed at its first
// control message ("tensor is on cpu; the NCCL backend takes CUDA tensors"), found on the first
// GPU run. Data-path collectives (reduce_scatter, all_to_all, the piece forms) still refuse them.
bool stages_on_device(BackendKind kind, std::initializer_list<const at::Tensor*> tensors) {
  if (kind != BackendKind::Nccl) return false;
  for (const at::Tensor* t : tensors) {
    if (!t->defined() || !t->device().is_cpu() || !t->is_contiguous()) return false;
  }
  return true;
}

at::Tensor on_current_cuda_device(const at::Tensor& host) {
  const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  return host.to(cuda.getDevice());
}

// The staging itself: `run` gets device copies of `out` and `in` (one tensor for an in-place
// collective) and runs the collective on them to completion; `out` then gets the result.
Work run_staged(const at::Tensor& out, const at::Tensor& in,
                const std::function<void(const at::Tensor& device_out, const at::Tensor& device_in)>& run) {
  const at::Tensor device_out = on_current_cuda_device(out);
  run(device_out, in.is_same(out) ? device_out : on_current_cuda_device(in));
  out.copy_(device_out);
  return Work();
}

void check_same_dtype(const std::string& op, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type()) {
    bad_argument(op, std::string("out is ") + c10::toString(a.scalar_type()) + " but in is " +
                         c10::toString(b.scalar_type()) + "; both must have the same dtype");
  }
}

// Reductions of 16-bit floats done by us (not the backend) accumulate in float32.
at::Tensor accumulate_dtype(const at::Tensor& t) {
  return (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf) ? t.to(at::kFloat) : t;
}

// Reduces the (N, S) view of rank chunks into one chunk of S.
at::Tensor reduce_chunks(const at::Tensor& chunks, ReduceOp op, int n) {
  at::Tensor acc = accumulate_dtype(chunks);
  if (op == ReduceOp::Max) return std::get<0>(acc.max(0));
  at::Tensor sum = acc.sum(0, /*keepdim=*/false, acc.scalar_type());
  if (op == ReduceOp::Avg) sum.div_(n);
  return sum;
}

// reduce_chunks written into `out` (S elements, contiguous): one pass, no temporary, when the
// chunks need no wider accumulator.
void reduce_chunks_into(const at::Tensor& out, const at::Tensor& chunks, ReduceOp op, int n) {
  if (op == ReduceOp::Max || chunks.scalar_type() == at::kBFloat16 || chunks.scalar_type() == at::kHalf) {
    out.view(-1).copy_(reduce_chunks(chunks, op, n));
    return;
  }
  at::Tensor flat = out.view(-1);
  const int64_t first_dim[] = {0};
  at::sum_out(flat, chunks, at::IntArrayRef(first_dim));
  if (op == ReduceOp::Avg) flat.div_(n);
}

void check_avg_dtype(const std::string& op, ReduceOp rop, const at::Tensor& t) {
  if (rop == ReduceOp::Avg && !at::isFloatingType(t.scalar_type())) {
    bad_argument(op, std::string("ReduceOp::Avg needs a floating-point tensor, got ") + c10::toString(t.scalar_type()) +
                         "; use Sum and divide yourself");
  }
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return c10d::ReduceOp::SUM;
    case ReduceOp::Avg: return c10d::ReduceOp::AVG;
    case ReduceOp::Max: return c10d::ReduceOp::MAX;
  }
  return c10d::ReduceOp::SUM;
}

// A 16-bit float the backend does not take travels as its bytes: every Gloo build takes uint8
// (Gloo has no int16, and Debian sid's 2.14 rejects Half too). The ops that use it only copy
// memory, never do arithmetic on it; a flat view of n elements is 2n bytes, so chunks still split
// evenly.
constexpr at::ScalarType kBitsCarrier = at::kByte;

// Flight recorder: the collective is issued (its Work takes the record; flight_recorder.h).
void flight_issue(const Comm& c, const char* op, const at::Tensor& in, const at::Tensor& out) {
  detail::flight_issue(c.name(), c.global_ranks(), c.global_ranks()[static_cast<size_t>(c.rank())], op,
                       in.defined() ? in.scalar_type() : at::ScalarType::Undefined, in.defined() ? in.numel() : 0,
                       out.defined() ? out.numel() : 0);
}

uint64_t ring_share(uint64_t bytes, int n) { return n <= 1 ? 0 : bytes * static_cast<uint64_t>(n - 1) / n; }

// FSDP_NCCL_WORLD_OF_ONE=1 (a test mode): a group of one that has a backend (NCCL: make_comm
// gives a world of one on a GPU a one-rank communicator) sends its collectives through it instead
// of copying locally, so NCCL's kernels, stream waits, AVG, bf16 and error path run on one GPU.
bool one_rank_through_backend() {
  static const bool on = [] {
    const char* v = std::getenv("FSDP_NCCL_WORLD_OF_ONE");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

// A group whose collectives are local copies: one rank, and no backend asked to run them.
bool local_only(const Comm& c) { return c.size() == 1 && !(c.backend() && one_rank_through_backend()); }

// The timeout handed to c10d with each collective. NCCL: c10d's watchdog gets a longer one, so the
// collective watch (comm/async_watch.h) times the collective out first, with our message and dump.
std::chrono::milliseconds op_timeout(const Comm& c) {
  return c.backend_kind() == BackendKind::Nccl ? detail::backend_watchdog_timeout(c.timeout()) : c.timeout();
}

}  // namespace

std::shared_ptr<Comm> Comm::single_process(std::string name) {
  return std::make_shared<Comm>(compat::BackendPtr(), BackendKind::Local, std::vector<int>{0}, 0,
                                default_collective_timeout(), std::move(name));
}

Comm::Comm(compat::BackendPtr backend, BackendKind kind, std::vector<int> global_ranks, int rank,
           std::chrono::milliseconds timeout, std::string name)
    : backend_(std::move(backend)),
      kind_(kind),
      caps_(Capabilities::for_backend(kind)),
      global_ranks_(std::move(global_ranks)),
      rank_(rank),
      timeout_(timeout),
      name_(std::move(name)) {
  if (rank_ < 0 || rank_ >= size()) throw std::invalid_argument("fsdp::Comm: rank outside the group");
  if (kind_ != BackendKind::Local && !backend_) throw std::invalid_argument("fsdp::Comm: missing backend");
  if (kind_ == BackendKind::Local && size() != 1) throw std::invalid_argument("fsdp::Comm: a local group has one rank");
  FlightRecorder::process();  // a bad FSDP_FLIGHT_RECORDER_SIZE stops here, before any collective
}

std::string Comm::describe(const char* op) const {
  std::ostringstream os;
  os << "fsdp: " << op << " on group '" << name_ << "' (" << backend_name(kind_) << ", ranks [";
  for (size_t i = 0; i < global_ranks_.size() && i < 16; ++i) os << (i ? "," : "") << global_ranks_[i];
  if (global_ranks_.size() > 16) os << ",...";
  os << "], this is group rank " << rank_ << ")";
  return os.str();
}

bool Comm::moves_as_bits(const at::Tensor& t) const {
  return (t.scalar_type() == at::kBFloat16 && !caps_.bfloat16) || (t.scalar_type() == at::kHalf && !caps_.float16);
}

Work Comm::finish(OpKind kind, uint64_t bytes, compat::WorkPtr work, std::function<void()> after, bool async_op,
                  const char* op_name) {
  stats_.record(kind, bytes);
  process_comm_stats().record(kind, bytes);
  // NCCL: wait() makes the caller's current stream wait for the collective; a timeout would turn
  // it into a host wait (polling), which defeats the streams. The collective watch enforces the
  // timeout instead (comm/async_watch.h; work.h).
  const auto wait_timeout = kind_ == BackendKind::Nccl ? compat::kNoWaitTimeout : timeout_;
  if (kind_ == BackendKind::Nccl && work) {
    // Its end is known only on the device: the watch marks the flight record completed when the
    // collective's end event has passed, and times it out with our message (comm/async_watch.h).
    detail::watch_async_collective(work, detail::flight_take_issued(), timeout_, describe(op_name));
  }
  Work handle(std::move(work), std::move(after), wait_timeout, describe(op_name));
  if (!async_op) handle.wait();
  return handle;
}

compat::WorkPtr Comm::backend_all_gather(const at::Tensor& out, const at::Tensor& in) {
  at::Tensor flat_out = out.view(-1), flat_in = in.view(-1);
  if (moves_as_bits(in)) {
    flat_out = flat_out.view(kBitsCarrier);
    flat_in = flat_in.view(kBitsCarrier);
  }
  if (caps_.all_gather_base) {
    c10d::AllgatherOptions opts;
    opts.timeout = op_timeout(*this);
    return compat::all_gather_single(*backend_, flat_out, flat_in, opts);
  }
  // Fallback: the list form, with each rank's output a view into the flat buffer.
  std::vector<std::vector<at::Tensor>> outputs{flat_out.chunk(size())};
  std::vector<at::Tensor> inputs{flat_in};
  c10d::AllgatherOptions opts;
  opts.timeout = op_timeout(*this);
  return backend_->allgather(outputs, inputs, opts);
}

compat::WorkPtr Comm::backend_all_to_all(const at::Tensor& out, const at::Tensor& in) {
  at::Tensor flat_out = out.view(-1), flat_in = in.view(-1);
  if (moves_as_bits(in)) {
    flat_out = flat_out.view(kBitsCarrier);
    flat_in = flat_in.view(kBitsCarrier);
  }
  std::vector<int64_t> equal_splits;  // empty = equal splits
  c10d::AllToAllOptions opts;
  opts.timeout = op_timeout(*this);
  return compat::all_to_all_single(*backend_, flat_out, flat_in, equal_splits, equal_splits, opts);
}

Work Comm::all_gather_into_tensor(const at::Tensor& out, const at::Tensor& in, bool async_op) {
  const std::string op = "all_gather_into_tensor";
  if (stages_on_device(kind_, {&out, &in})) {  // [Note: host tensors on NCCL]
    return run_staged(out, in, [&](const at::Tensor& o, const at::Tensor& i) { all_gather_into_tensor(o, i, false); });
  }
  check_tensor(op, "out", out, kind_);
  check_tensor(op, "in", in, kind_);
  check_same_dtype(op, out, in);
  if (out.numel() != in.numel() * size()) {
    bad_argument(op, "out has " + std::to_string(out.numel()) + " elements, expected group size " +
                         std::to_string(size()) + " x in.numel() " + std::to_string(in.numel()));
  }
  detail::check_collective_matches(*this, ++seq_, OpKind::AllGather, in, out);
  flight_issue(*this, "all_gather_into_tensor", in, out);
  // Empty tensors: nothing to move (and Gloo divides by the element count). Sizes agree on every
  // rank, so every rank skips alike.
  // In place: `in` is already this rank's chunk of `out` (FSDP's all-gather input).
  const bool in_place = in.numel() > 0 && in.data_ptr() == static_cast<char*>(out.data_ptr()) + rank_ * in.nbytes();
  if (local_only(*this) || in.numel() == 0) {
    if (in.numel() > 0 && !in_place) out.view(-1).copy_(in.view(-1));  // a group of one: one copy
    return finish(OpKind::AllGather, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  }
  const uint64_t bytes = ring_share(out.nbytes(), size());
  // NCCL takes an input inside the output; Gloo's native one gets a separate input.
  const bool separate = in_place && caps_.all_gather_base && kind_ == BackendKind::Gloo;
  // Gloo's all-gather (the list form on 1.13, and what 2.x's _allgather_base calls) gathers
  // through a flat buffer of c10d's own, allocated (and page-faulted in) every call, and copies
  // the whole output back from it: the point-to-point one receives every chunk straight into its
  // row of `out` (FSDP's input already is its row: nothing to copy).
  if (kind_ == BackendKind::Gloo && in.is_cpu() && gloo_fallback() == GlooFallback::PointToPoint) {
    return all_gather_p2p(out, in, async_op, bytes);  // comm/p2p_collectives.cpp
  }
  auto work = backend_all_gather(out, separate ? in.clone() : in);
  return finish(OpKind::AllGather, bytes, std::move(work), nullptr, async_op, op.c_str());
}

Work Comm::reduce_scatter_tensor(const at::Tensor& out, const at::Tensor& in, ReduceOp rop, bool async_op) {
  const std::string op = "reduce_scatter_tensor";
  check_tensor(op, "out", out, kind_);
  check_tensor(op, "in", in, kind_);
  check_same_dtype(op, out, in);
  check_avg_dtype(op, rop, in);
  if (in.numel() != out.numel() * size()) {
    bad_argument(op, "in has " + std::to_string(in.numel()) + " elements, expected group size " +
                         std::to_string(size()) + " x out.numel() " + std::to_string(out.numel()));
  }
  detail::check_collective_matches(*this, ++seq_, OpKind::ReduceScatter, in, out, static_cast<int>(rop));
  flight_issue(*this, "reduce_scatter_tensor", in, out);
  if (local_only(*this) || out.numel() == 0) {
    out.view(-1).copy_(in.view(-1));
    return finish(OpKind::ReduceScatter, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  }
  const uint64_t bytes = ring_share(in.nbytes(), size());
  const bool native_dtype = !moves_as_bits(in);
  if (caps_.reduce_scatter_base && native_dtype && (rop != ReduceOp::Avg || caps_.avg)) {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(rop);
    opts.timeout = op_timeout(*this);
    at::Tensor flat_out = out.view(-1), flat_in = in.view(-1);
    auto work = compat::reduce_scatter_single(*backend_, flat_out, flat_in, opts);
    return finish(OpKind::ReduceScatter, bytes, std::move(work), nullptr, async_op, op.c_str());
  }
  if (native_dtype && in.is_cpu() && gloo_fallback() == GlooFallback::PointToPoint) {
    return reduce_scatter_p2p(out, in, rop, async_op, bytes);  // comm/p2p_collectives.cpp (Gloo's send/recv: CPU only)
  }
  // all_to_all brings every rank's chunk [rank()] here (ring bytes); then sum locally.
  // The all_to_all's output: scratch from the buffer pool (reused call after call); the chunks
  // are then summed straight into `out`.
  at::Tensor received = fsdp::detail::empty_buffer(in.sizes(), in.options(), BufferOwner::CommScratch);
  auto work = backend_all_to_all(received, in);
  const int n = size();
  auto after = [received, out, rop, n]() mutable {
    reduce_chunks_into(out, received.view({n, -1}), rop, n);
    fsdp::detail::release_buffer(received);  // now, not when Gloo's worker drops the work
  };
  return finish(OpKind::ReduceScatter, bytes, std::move(work), after, async_op, op.c_str());
}

namespace {

// The pieces' checks: one dtype, contiguous, `n` destinations each; `own(i)` is the piece this
// rank keeps of exchange i and `mine(i)` the one it contributes to itself (equal numels).
void check_pieces(const std::string& op, const std::vector<at::Tensor>& singles,
                  const std::vector<std::vector<at::Tensor>>& lists, int n, int rank, BackendKind kind) {
  if (singles.size() != lists.size()) {
    bad_argument(op, std::to_string(singles.size()) + " single pieces but " + std::to_string(lists.size()) +
                         " lists of pieces; give one list (one piece per rank) for each");
  }
  for (size_t i = 0; i < singles.size(); ++i) {
    const std::string at_i = " of exchange " + std::to_string(i);
    check_tensor(op, ("piece" + at_i).c_str(), singles[i], kind);
    if (lists[i].size() != static_cast<size_t>(n)) {
      bad_argument(op, "exchange " + std::to_string(i) + " lists " + std::to_string(lists[i].size()) +
                           " pieces; give one per rank of the group (" + std::to_string(n) + ")");
    }
    for (const auto& t : lists[i]) {
      check_tensor(op, ("a rank's piece" + at_i).c_str(), t, kind);
      check_same_dtype(op, t, singles.front());
    }
    check_same_dtype(op, singles[i], singles.front());
    if (lists[i][static_cast<size_t>(rank)].numel() != singles[i].numel()) {
      bad_argument(op, "exchange " + std::to_string(i) + ": this rank's piece has " +
                           std::to_string(lists[i][static_cast<size_t>(rank)].numel()) + " elements in the list but " +
                           std::to_string(singles[i].numel()) + " alone; they must match");
    }
  }
}

// What the desync check and the flight recorder see of a pieces operation: one tensor of the
// pieces' total numel, dtype and device (a stride-0 view of a piece: nothing is allocated).
at::Tensor pieces_summary(const std::vector<at::Tensor>& pieces) {
  int64_t total = 0;
  const at::Tensor* some = nullptr;
  for (const auto& t : pieces) {
    total += t.numel();
    if (!some && t.numel() > 0) some = &t;
  }
  if (!some) return pieces.empty() ? at::Tensor() : pieces.front();
  return some->view(-1).narrow(0, 0, 1).as_strided({total}, {0});
}

}  // namespace

bool Comm::takes_pieces(const at::Tensor& t) const {
  return local_only(*this) || (kind_ == BackendKind::Gloo && t.is_cpu());
}

Work Comm::all_gather_pieces(const std::vector<at::Tensor>& ins, const std::vector<std::vector<at::Tensor>>& outs,
                             bool async_op) {
  const std::string op = "all_gather_pieces";
  check_pieces(op, ins, outs, size(), rank_, kind_);
  if (!ins.empty() && !takes_pieces(ins.front())) {
    bad_argument(op, std::string("takes CPU tensors on a Gloo group (or a group of one); this is ") +
                         backend_name(kind_) + " with " + ins.front().device().str() +
                         " tensors: use all_gather_into_tensor");
  }
  std::vector<at::Tensor> gathered;
  uint64_t bytes = 0;
  for (size_t i = 0; i < ins.size(); ++i) {
    for (const auto& t : outs[i]) gathered.push_back(t);
    bytes += static_cast<uint64_t>(ins[i].nbytes()) * static_cast<uint64_t>(size() - 1);
  }
  const at::Tensor in_summary = pieces_summary(ins), out_summary = pieces_summary(gathered);
  detail::check_collective_matches(*this, ++seq_, OpKind::AllGather, in_summary, out_summary);
  flight_issue(*this, "all_gather_pieces", in_summary, out_summary);
  if (local_only(*this) || ins.empty()) {
    for (size_t i = 0; i < ins.size(); ++i) {
      const at::Tensor& own = outs[i][0];
      if (ins[i].numel() > 0 && own.data_ptr() != ins[i].data_ptr()) own.view(-1).copy_(ins[i].view(-1));
    }
    return finish(OpKind::AllGather, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  }
  return all_gather_pieces_p2p(ins, outs, async_op, bytes);  // comm/p2p_collectives.cpp
}

Work Comm::reduce_scatter_pieces(const std::vector<at::Tensor>& outs, const std::vector<std::vector<at::Tensor>>& ins,
                                 ReduceOp rop, bool async_op) {
  const std::string op = "reduce_scatter_pieces";
  check_pieces(op, outs, ins, size(), rank_, kind_);
  if (!outs.empty()) check_avg_dtype(op, rop, outs.front());
  if (!outs.empty() && !takes_pieces(outs.front())) {
    bad_argument(op, std::string("takes CPU tensors on a Gloo group (or a group of one); this is ") +
                         backend_name(kind_) + " with " + outs.front().device().str() +
                         " tensors: use reduce_scatter_tensor");
  }
  if (!outs.empty() && moves_as_bits(outs.front())) {
    bad_argument(op, std::string("the backend cannot add ") + c10::toString(outs.front().scalar_type()) +
                         "; reduce in float32 (FSDP's reduce_dtype) or use reduce_scatter_tensor");
  }
  std::vector<at::Tensor> sent;
  uint64_t bytes = 0;
  for (size_t i = 0; i < ins.size(); ++i) {
    for (int r = 0; r < size(); ++r) {
      sent.push_back(ins[i][static_cast<size_t>(r)]);
      if (r != rank_) bytes += static_cast<uint64_t>(ins[i][static_cast<size_t>(r)].nbytes());
    }
  }
  const at::Tensor in_summary = pieces_summary(sent), out_summary = pieces_summary(outs);
  detail::check_collective_matches(*this, ++seq_, OpKind::ReduceScatter, in_summary, out_summary,
                                   static_cast<int>(rop));
  flight_issue(*this, "reduce_scatter_pieces", in_summary, out_summary);
  if (local_only(*this) || outs.empty()) {
    for (size_t i = 0; i < outs.size(); ++i) {
      const at::Tensor& own = ins[i][0];
      if (outs[i].numel() > 0 && own.data_ptr() != outs[i].data_ptr()) outs[i].view(-1).copy_(own.view(-1));
    }
    return finish(OpKind::ReduceScatter, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  }
  return reduce_scatter_pieces_p2p(outs, ins, rop, async_op, bytes);  // comm/p2p_collectives.cpp
}

Work Comm::all_reduce(const at::Tensor& tensor, ReduceOp rop, bool async_op) {
  const std::string op = "all_reduce";
  if (stages_on_device(kind_, {&tensor})) {  // [Note: host tensors on NCCL]
    return run_staged(tensor, tensor, [&](const at::Tensor& o, const at::Tensor&) { all_reduce(o, rop, false); });
  }
  check_tensor(op, "tensor", tensor, kind_);
  check_avg_dtype(op, rop, tensor);
  detail::check_collective_matches(*this, ++seq_, OpKind::AllReduce, tensor, at::Tensor(), static_cast<int>(rop));
  flight_issue(*this, "all_reduce", tensor, tensor);
  if (local_only(*this) || tensor.numel() == 0)
    return finish(OpKind::AllReduce, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  const int n = size();
  if (moves_as_bits(tensor)) {
    // No 16-bit float arithmetic in the backend: reduce-scatter (as all_to_all of bit patterns,
    // summed in float32 here) then all-gather the reduced chunks; the bytes of a ring all-reduce.
    const int64_t numel = tensor.numel();
    const int64_t chunk = (numel + n - 1) / n;
    at::Tensor padded = at::zeros({chunk * n}, tensor.options());
    padded.narrow(0, 0, numel).copy_(tensor.view(-1));
    at::Tensor received = at::empty_like(padded);
    auto work = backend_all_to_all(received, padded);
    const uint64_t bytes = 2 * ring_share(padded.nbytes(), n);
    auto after = [this, received, padded, tensor, rop, n, numel, chunk]() {
      at::Tensor mine = reduce_chunks(received.view({n, chunk}), rop, n).to(tensor.scalar_type());
      auto gather = backend_all_gather(padded, mine);
      gather->wait(timeout_);
      tensor.view(-1).copy_(padded.narrow(0, 0, numel));
    };
    return finish(OpKind::AllReduce, bytes, std::move(work), after, async_op, op.c_str());
  }
  const bool divide_after = rop == ReduceOp::Avg && !caps_.avg;
  c10d::AllreduceOptions opts;
  opts.reduceOp = divide_after ? c10d::ReduceOp(c10d::ReduceOp::SUM) : to_c10d(rop);
  opts.timeout = op_timeout(*this);
  std::vector<at::Tensor> tensors{tensor};
  auto work = backend_->allreduce(tensors, opts);
  std::function<void()> after;
  if (divide_after) after = [tensor, n]() { tensor.div_(n); };
  return finish(OpKind::AllReduce, 2 * ring_share(tensor.nbytes(), n), std::move(work), after, async_op, op.c_str());
}

Work Comm::broadcast(const at::Tensor& tensor, int root, bool async_op) {
  const std::string op = "broadcast";
  if (stages_on_device(kind_, {&tensor})) {  // [Note: host tensors on NCCL]
    return run_staged(tensor, tensor, [&](const at::Tensor& o, const at::Tensor&) { broadcast(o, root, false); });
  }
  check_tensor(op, "tensor", tensor, kind_);
  if (root < 0 || root >= size()) {
    bad_argument(op, "root " + std::to_string(root) + " is not a group rank (0.." + std::to_string(size() - 1) + ")");
  }
  detail::check_collective_matches(*this, ++seq_, OpKind::Broadcast, tensor, at::Tensor(), -1, root);
  flight_issue(*this, "broadcast", tensor, tensor);
  if (local_only(*this) || tensor.numel() == 0)
    return finish(OpKind::Broadcast, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  at::Tensor moved = moves_as_bits(tensor) ? tensor.view(kBitsCarrier) : tensor;
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  opts.rootTensor = 0;
  opts.timeout = op_timeout(*this);
  std::vector<at::Tensor> tensors{moved};
  auto work = backend_->broadcast(tensors, opts);
  // In a chain from the root every rank forwards the data except the last one.
  const bool last_in_chain = rank_ == (root + size() - 1) % size();
  return finish(OpKind::Broadcast, last_in_chain ? 0 : tensor.nbytes(), std::move(work), nullptr, async_op, op.c_str());
}

Work Comm::all_to_all(const at::Tensor& out, const at::Tensor& in, bool async_op) {
  const std::string op = "all_to_all";
  check_tensor(op, "out", out, kind_);
  check_tensor(op, "in", in, kind_);
  check_same_dtype(op, out, in);
  if (out.numel() != in.numel() || in.numel() % size() != 0) {
    bad_argument(op, "in and out must have the same number of elements, divisible by the group size " +
                         std::to_string(size()) + " (got " + std::to_string(in.numel()) + " and " +
                         std::to_string(out.numel()) + ")");
  }
  detail::check_collective_matches(*this, ++seq_, OpKind::AllToAll, in, out);
  flight_issue(*this, "all_to_all", in, out);
  if (local_only(*this) || in.numel() == 0) {
    out.view(-1).copy_(in.view(-1));
    return finish(OpKind::AllToAll, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  }
  auto work = backend_all_to_all(out, in);
  return finish(OpKind::AllToAll, ring_share(in.nbytes(), size()), std::move(work), nullptr, async_op, op.c_str());
}

namespace {

// The checks of the uneven all-to-all: one dtype, rows of one shape, size() splits per side, each
// non-negative, summing to the tensor's rows. Returns the bytes of one row.
int64_t check_uneven_splits(const std::string& op, const at::Tensor& out, const at::Tensor& in,
                            const std::vector<int64_t>& out_splits, const std::vector<int64_t>& in_splits, int n,
                            BackendKind kind) {
  check_tensor(op, "out", out, kind);
  check_tensor(op, "in", in, kind);
  check_same_dtype(op, out, in);
  if (in.dim() < 1 || out.dim() < 1 || in.sizes().slice(1) != out.sizes().slice(1)) {
    bad_argument(op, "in " + c10::str(in.sizes()) + " and out " + c10::str(out.sizes()) +
                         " must be tensors of rows of one shape (split along dim 0)");
  }
  const auto check_side = [&](const char* name, const std::vector<int64_t>& splits, const at::Tensor& t) {
    if (splits.size() != static_cast<size_t>(n)) {
      bad_argument(op, std::string(name) + " has " + std::to_string(splits.size()) +
                           " entries; give one per rank of the group (" + std::to_string(n) + ")");
    }
    int64_t sum = 0;
    for (int64_t s : splits) {
      if (s < 0) bad_argument(op, std::string(name) + " has a negative entry " + std::to_string(s));
      sum += s;
    }
    if (sum != t.size(0)) {
      bad_argument(op, std::string(name) + " sum to " + std::to_string(sum) + " rows but the tensor has " +
                           std::to_string(t.size(0)) + "; the splits count rows of dim 0");
    }
  };
  check_side("in_splits", in_splits, in);
  check_side("out_splits", out_splits, out);
  int64_t row_numel = 1;
  for (int64_t d = 1; d < in.dim(); ++d) row_numel *= in.size(d);
  return row_numel * static_cast<int64_t>(in.element_size());
}

}  // namespace

Work Comm::all_to_all(const at::Tensor& out, const at::Tensor& in, const std::vector<int64_t>& out_splits,
                      const std::vector<int64_t>& in_splits, bool async_op) {
  const std::string op = "all_to_all_uneven";
  const int64_t row_bytes = check_uneven_splits(op, out, in, out_splits, in_splits, size(), kind_);
  // The desync check sees the kind, dtype and row shape (a rank's splits are its own).
  detail::check_collective_matches(*this, ++seq_, OpKind::AllToAll, in.narrow(0, 0, 0), out.narrow(0, 0, 0));
  flight_issue(*this, "all_to_all_uneven", in, out);
  if (local_only(*this)) {
    if (in.numel() > 0) out.copy_(in);
    return finish(OpKind::AllToAll, 0, compat::WorkPtr(), nullptr, async_op, op.c_str());
  }
  uint64_t bytes = 0;
  for (int j = 0; j < size(); ++j) {
    if (j != rank_) bytes += static_cast<uint64_t>(in_splits[static_cast<size_t>(j)] * row_bytes);
  }
  // Flat tensors with the splits in elements: c10d counts a split in rows of dim 0 and takes the
  // row size from numel / size(0), which a tensor of no rows leaves undefined.
  at::Tensor flat_out = out.view(-1), flat_in = in.view(-1);
  if (moves_as_bits(in)) {
    flat_out = flat_out.view(kBitsCarrier);
    flat_in = flat_in.view(kBitsCarrier);
  }
  const int64_t per_row = row_bytes / static_cast<int64_t>(flat_in.element_size());
  std::vector<int64_t> out_elems(out_splits.size()), in_elems(in_splits.size());
  for (size_t j = 0; j < out_splits.size(); ++j) {
    out_elems[j] = out_splits[j] * per_row;
    in_elems[j] = in_splits[j] * per_row;
  }
  c10d::AllToAllOptions opts;
  opts.timeout = op_timeout(*this);
  auto work = compat::all_to_all_single(*backend_, flat_out, flat_in, out_elems, in_elems, opts);
  return finish(OpKind::AllToAll, bytes, std::move(work), nullptr, async_op, op.c_str());
}

Work Comm::barrier(bool async_op) {
  detail::check_collective_matches(*this, ++seq_, OpKind::Barrier, at::Tensor(), at::Tensor());
  flight_issue(*this, "barrier", at::Tensor(), at::Tensor());
  if (local_only(*this)) return finish(OpKind::Barrier, 0, compat::WorkPtr(), nullptr, async_op, "barrier");
  c10d::BarrierOptions opts;
  opts.timeout = op_timeout(*this);
  auto work = backend_->barrier(opts);
  return finish(OpKind::Barrier, 0, std::move(work), nullptr, async_op, "barrier");
}

}  // namespace fsdp::comm
