// layer: comm
#pragma once
// Bytes each rank sends, per kind of collective. Benchmarks and the trainer report these.
//
// Convention: the bytes this rank puts on the wire when the collective runs as a ring (the
// bandwidth-optimal schedule), with the dtype actually moved. For a group of N ranks and a
// tensor of B bytes (the full, gathered or unscattered size):
//   all_gather      (N-1)/N * B      reduce_scatter (N-1)/N * B     all_reduce 2 (N-1)/N * B
//   all_to_all      (N-1)/N * B      broadcast      B (all but the last rank of the chain)
// A fallback that moves more bytes (e.g. bf16 upcast to fp32) is counted at what it moves.
#include <array>
#include <atomic>
#include <cstdint>
#include <string>

namespace fsdp::comm {

enum class OpKind : int { AllGather = 0, ReduceScatter, AllReduce, Broadcast, AllToAll, Barrier, Count };
const char* op_kind_name(OpKind kind);

struct OpCounters {
  uint64_t calls = 0;
  uint64_t bytes_sent = 0;
};

struct CommStatsSnapshot {
  std::array<OpCounters, static_cast<size_t>(OpKind::Count)> ops{};
  const OpCounters& operator[](OpKind k) const { return ops[static_cast<size_t>(k)]; }
  uint64_t total_bytes() const;
  CommStatsSnapshot operator-(const CommStatsSnapshot& earlier) const;
  std::string to_string() const;  // "all_gather=3/1.2MB reduce_scatter=..." for logs
};

class CommStats {
 public:
  void record(OpKind kind, uint64_t bytes_sent);
  CommStatsSnapshot snapshot() const;
  void reset();

 private:
  std::array<std::atomic<uint64_t>, static_cast<size_t>(OpKind::Count)> calls_{};
  std::array<std::atomic<uint64_t>, static_cast<size_t>(OpKind::Count)> bytes_{};
};

// Every Comm of this process also records here (all groups, all meshes).
CommStats& process_comm_stats();

}  // namespace fsdp::comm
