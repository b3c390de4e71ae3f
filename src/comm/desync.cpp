// Collective desync detection: see include/fsdp/debug/desync.h.
#include "fsdp/debug/desync.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/comm/work.h"

namespace fsdp::comm {

namespace {

// -1: not read yet; 0 off; 1 on.
std::atomic<int> g_enabled{-1};
std::atomic<uint64_t> g_checks{0};
std::atomic<uint64_t> g_bytes{0};

bool read_env() {
  const char* v = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  if (v == nullptr || *v == '\0') return false;
  std::string s(v);
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  if (s == "DETAIL") return true;
  if (s == "OFF" || s == "INFO") return false;
  throw std::invalid_argument(std::string("fsdp: TORCH_DISTRIBUTED_DEBUG='") + v +
                              "' is not one of OFF, INFO, DETAIL (DETAIL checks that every rank issues the same "
                              "collectives; unset it or pick one of these)");
}

// The fingerprint: fixed size, so that the exchange itself can never mismatch.
constexpr int kMaxDims = 6;
constexpr int kTensorFields = 3 + kMaxDims;  // dtype, ndim, numel, dims (-1 past ndim)
enum Field : int {
  kMagic = 0,
  kSeq,
  kOp,
  kReduceOp,
  kRoot,
  kDevice,
  kIn,
  kOut = kIn + kTensorFields,
  kFields = kOut + kTensorFields,
};
constexpr int64_t kMagicValue = 0x4653445044455331;  // "FSDPDES1"
using Fingerprint = std::array<int64_t, kFields>;

void put_tensor(Fingerprint& f, int at, const at::Tensor& t) {
  if (!t.defined()) {
    for (int i = 0; i < kTensorFields; ++i) f[at + i] = -1;
    return;
  }
  f[at] = static_cast<int64_t>(t.scalar_type());
  f[at + 1] = t.dim();
  f[at + 2] = t.numel();
  for (int i = 0; i < kMaxDims; ++i) f[at + 3 + i] = i < t.dim() ? t.size(i) : -1;
}

const char* op_name(int64_t op) {
  switch (static_cast<OpKind>(op)) {
    case OpKind::AllGather: return "all_gather_into_tensor";
    case OpKind::ReduceScatter: return "reduce_scatter_tensor";
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::AllToAll: return "all_to_all";
    case OpKind::Barrier: return "barrier";
    case OpKind::Count: break;
  }
  return "unknown collective";
}

std::string dtype_name(int64_t code) {
  switch (static_cast<at::ScalarType>(code)) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: break;
  }
  if (code >= 0 && code < static_cast<int64_t>(at::ScalarType::NumOptions)) {
    return c10::toString(static_cast<at::ScalarType>(code));
  }
  return "dtype#" + std::to_string(code);
}

std::string shape(const Fingerprint& f, int at) {
  std::ostringstream os;
  os << '[';
  const int64_t ndim = f[at + 1];
  for (int64_t i = 0; i < ndim && i < kMaxDims; ++i) os << (i ? ", " : "") << f[at + 3 + i];
  if (ndim > kMaxDims) os << ", ... (" << f[at + 2] << " elements)";
  os << ']';
  return os.str();
}

const char* reduce_name(int64_t r) {
  switch (r) {
    case static_cast<int64_t>(ReduceOp::Sum): return "sum";
    case static_cast<int64_t>(ReduceOp::Avg): return "avg";
    case static_cast<int64_t>(ReduceOp::Max): return "max";
    default: return "?";
  }
}

// "all_gather_into_tensor float32 [2048] -> [4096]", "all_reduce float32 [10] sum", ...
std::string describe_call(const Fingerprint& f, bool with_seq) {
  if (f[kMagic] != kMagicValue)
    return "something else (not a desync check: is TORCH_DISTRIBUTED_DEBUG the same on every rank?)";
  std::ostringstream os;
  os << op_name(f[kOp]);
  const bool has_in = f[kIn] >= 0, has_out = f[kOut] >= 0;
  if (has_in) {
    os << ' ' << dtype_name(f[kIn]) << ' ' << shape(f, kIn);
    if (has_out) {
      if (f[kOut] != f[kIn])
        os << " -> " << dtype_name(f[kOut]) << ' ' << shape(f, kOut);
      else
        os << " -> " << shape(f, kOut);
    }
  }
  if (f[kReduceOp] >= 0) os << ' ' << reduce_name(f[kReduceOp]);
  if (f[kRoot] >= 0) os << " root " << f[kRoot];
  if (f[kDevice] != static_cast<int64_t>(c10::DeviceType::CPU) && f[kDevice] >= 0) {
    os << " on " << c10::DeviceTypeName(static_cast<c10::DeviceType>(f[kDevice]), /*lower_case=*/true);
  }
  if (with_seq) os << " (its sequence number " << f[kSeq] << ")";
  return os.str();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << (ranks.size() == 1 ? "rank " : "ranks ");
  for (size_t i = 0; i < ranks.size(); ++i) os << (i ? "," : "") << ranks[i];
  return os.str();
}

Fingerprint make_fingerprint(uint64_t seq, OpKind op, const at::Tensor& in, const at::Tensor& out, int reduce_op,
                             int root) {
  Fingerprint mine;
  mine[kMagic] = kMagicValue;
  mine[kSeq] = static_cast<int64_t>(seq);
  mine[kOp] = static_cast<int64_t>(op);
  mine[kReduceOp] = reduce_op;
  mine[kRoot] = root;
  const at::Tensor& any = in.defined() ? in : out;
  mine[kDevice] = any.defined() ? static_cast<int64_t>(any.device().type()) : -1;
  put_tensor(mine, kIn, in);
  put_tensor(mine, kOut, out);
  return mine;
}

// The exchange runs on the group's own backend: NCCL takes CUDA tensors only (the device of
// the call's tensors, else the current CUDA device); Gloo takes CPU ones.
at::Device exchange_device(const Comm& comm, const at::Tensor& any) {
  if (comm.backend_kind() != BackendKind::Nccl) return at::Device(at::kCPU);
  if (any.defined() && any.is_cuda()) return any.device();
  return c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getDevice();
}

// All-gathers every rank's fingerprint (in rank order) over the group's backend.
std::vector<Fingerprint> gather_fingerprints(const Comm& comm, uint64_t seq, Fingerprint& mine,
                                             const at::Device& device) {
  const int n = comm.size();
  at::Tensor local = at::from_blob(mine.data(), {kFields}, at::kLong).to(device, /*non_blocking=*/false, /*copy=*/true);
  at::Tensor gathered = at::empty({n, kFields}, local.options());
  std::vector<std::vector<at::Tensor>> outputs{gathered.unbind(0)};
  std::vector<at::Tensor> inputs{local};
  c10d::AllgatherOptions opts;
  opts.timeout = comm.timeout();

  std::ostringstream where;
  where << "fsdp: " << op_name(mine[kOp]) << " on group '" << comm.name() << "' (" << backend_name(comm.backend_kind())
        << ", this is rank " << comm.global_ranks()[comm.rank()]
        << "; its desync check, TORCH_DISTRIBUTED_DEBUG=DETAIL, "
        << "sequence number " << seq << ")";
  {
    Work work(comm.backend()->allgather(outputs, inputs, opts), nullptr,
              comm.backend_kind() == BackendKind::Nccl ? compat::kNoWaitTimeout : comm.timeout(), where.str());
    work.wait();
  }
  g_checks.fetch_add(1, std::memory_order_relaxed);
  g_bytes.fetch_add(static_cast<uint64_t>(n - 1) * sizeof(Fingerprint), std::memory_order_relaxed);

  const at::Tensor all = gathered.to(at::kCPU).contiguous();
  const int64_t* p = all.data_ptr<int64_t>();
  std::vector<Fingerprint> prints(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) std::copy(p + r * kFields, p + (r + 1) * kFields, prints[r].begin());
  return prints;
}

// The message every rank throws: each distinct call with the ranks that issued it.
std::string desync_message(const Comm& comm, uint64_t seq, const std::vector<Fingerprint>& prints) {
  const int n = static_cast<int>(prints.size());
  bool same_seq = true;
  for (int r = 0; r < n; ++r)
    if (prints[r][kSeq] != prints[0][kSeq]) same_seq = false;
  std::vector<std::pair<Fingerprint, std::vector<int>>> groups;  // distinct calls, in rank order
  for (int r = 0; r < n; ++r) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == prints[r]; });
    if (it == groups.end())
      groups.push_back({prints[r], {comm.global_ranks()[r]}});
    else
      it->second.push_back(comm.global_ranks()[r]);
  }
  std::ostringstream msg;
  msg << "fsdp: collective desync in group '" << comm.name() << "' ";
  if (same_seq)
    msg << "at sequence number " << seq;
  else
    msg << "(the ranks are at different sequence numbers; this rank at " << seq << ")";
  msg << ": ";
  const size_t shown = std::min<size_t>(groups.size(), 8);
  for (size_t i = 0; i < shown; ++i) {
    msg << (i ? ", " : "") << rank_list(groups[i].second) << " called " << describe_call(groups[i].first, !same_seq);
  }
  if (groups.size() > shown) msg << ", and " << groups.size() - shown << " other calls";
  msg << ". Every rank of a group must issue the same collectives in the same order with the same dtypes and "
         "shapes (a model or data that differs between ranks, or a collective inside a rank-dependent branch); "
         "checked because TORCH_DISTRIBUTED_DEBUG=DETAIL";
  return msg.str();
}

}  // namespace

bool desync_detection_enabled() {
  int v = g_enabled.load(std::memory_order_relaxed);
  if (v < 0) {
    v = read_env() ? 1 : 0;
    g_enabled.store(v, std::memory_order_relaxed);
  }
  return v == 1;
}

void set_desync_detection(bool on) { g_enabled.store(on ? 1 : 0, std::memory_order_relaxed); }

DesyncCheckCounters desync_check_counters() {
  DesyncCheckCounters c;
  c.checks = g_checks.load(std::memory_order_relaxed);
  c.bytes_sent = g_bytes.load(std::memory_order_relaxed);
  return c;
}

namespace detail {

void check_collective_matches(const Comm& comm, uint64_t seq, OpKind op, const at::Tensor& in, const at::Tensor& out,
                              int reduce_op, int root) {
  if (comm.size() < 2 || comm.backend_kind() == BackendKind::Local || !desync_detection_enabled()) return;
  Fingerprint mine = make_fingerprint(seq, op, in, out, reduce_op, root);
  const std::vector<Fingerprint> prints =
      gather_fingerprints(comm, seq, mine, exchange_device(comm, in.defined() ? in : out));
  if (std::all_of(prints.begin(), prints.end(), [&](const Fingerprint& f) { return f == prints[0]; })) return;
  // Every rank sees every fingerprint, so every rank throws the same message.
  throw CommError(desync_message(comm, seq, prints));
}

}  // namespace detail
}  // namespace fsdp::comm
