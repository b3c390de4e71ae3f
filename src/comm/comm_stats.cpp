#include "fsdp/debug/comm_stats.h"

#include <cstdio>

namespace fsdp::comm {

const char* op_kind_name(OpKind kind) {
  switch (kind) {
    case OpKind::AllGather: return "all_gather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::AllToAll: return "all_to_all";
    case OpKind::Barrier: return "barrier";
    case OpKind::Count: break;
  }
  return "?";
}

uint64_t CommStatsSnapshot::total_bytes() const {
  uint64_t total = 0;
  for (const auto& op : ops) total += op.bytes_sent;
  return total;
}

CommStatsSnapshot CommStatsSnapshot::operator-(const CommStatsSnapshot& earlier) const {
  CommStatsSnapshot d;
  for (size_t i = 0; i < ops.size(); ++i) {
    d.ops[i].calls = ops[i].calls - earlier.ops[i].calls;
    d.ops[i].bytes_sent = ops[i].bytes_sent - earlier.ops[i].bytes_sent;
  }
  return d;
}

std::string CommStatsSnapshot::to_string() const {
  std::string out;
  char buf[96];
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].calls == 0) continue;
    std::snprintf(buf, sizeof(buf), "%s%s=%llu calls/%.3f MB", out.empty() ? "" : " ",
                  op_kind_name(static_cast<OpKind>(i)), static_cast<unsigned long long>(ops[i].calls),
                  static_cast<double>(ops[i].bytes_sent) / 1e6);
    out += buf;
  }
  return out.empty() ? "no collectives" : out;
}

void CommStats::record(OpKind kind, uint64_t bytes_sent) {
  auto i = static_cast<size_t>(kind);
  calls_[i].fetch_add(1, std::memory_order_relaxed);
  bytes_[i].fetch_add(bytes_sent, std::memory_order_relaxed);
}

CommStatsSnapshot CommStats::snapshot() const {
  CommStatsSnapshot s;
  for (size_t i = 0; i < s.ops.size(); ++i) {
    s.ops[i].calls = calls_[i].load(std::memory_order_relaxed);
    s.ops[i].bytes_sent = bytes_[i].load(std::memory_order_relaxed);
  }
  return s;
}

void CommStats::reset() {
  for (size_t i = 0; i < calls_.size(); ++i) {
    calls_[i].store(0);
    bytes_[i].store(0);
  }
}

CommStats& process_comm_stats() {
  static CommStats stats;
  return stats;
}

}  // namespace fsdp::comm
