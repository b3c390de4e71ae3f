// layer: comm
#pragma once
// Flight recorder: every process keeps its last N collectives in a ring buffer, and writes them
// to a file when a collective fails or times out, so that the ranks' records can be lined up
// afterwards (tools/fsdp_fr: `fsdp-fr DIR` names the first collective where the ranks diverge or
// that some rank never entered). PyTorch's NCCL flight recorder, for every backend.
//
// Environment (read once, when the first Comm is made; docs/multihost.md, "Flight recorder"):
//   FSDP_FLIGHT_RECORDER_SIZE=N   records kept (default 2000; 0 turns the recorder off). When it is
//                                 unset, PyTorch's TORCH_NCCL_TRACE_BUFFER_SIZE is taken instead.
//   FSDP_FLIGHT_RECORDER_DIR=DIR  where a failure writes DIR/rank_<global rank>.jsonl (read at
//                                 dump time; unset: nothing is written on failure).
//
// What a record holds: the group (name, global ranks), a sequence number per group (this
// recorder's own count of the collectives issued on that group by this process), the operation,
// dtype, input and output element counts, start and end (wall clock, microseconds) and a state:
//   scheduled  recorded, not yet handed to the backend
//   started    handed to the backend (Gloo: running or queued; NCCL: enqueued on the stream)
//   completed  Work::wait returned (NCCL: the caller's stream now waits for it)
//   failed / timed out   Work::wait threw
// Recording costs a lock and a few stores: the ring is allocated once, nothing else allocates.
//
// File format (one JSON object per line): the first line is the header
//   {"format":"fsdp-flight-recorder","version":1,"rank":R,"pid":..,"host":"..","capacity":N,
//    "recorded":total,"reason":"..","dumped_at_us":..,"groups":[{"name":"world","ranks":[0,1],"issued":S}]}
// then one line per record, oldest first:
//   {"id":7,"group":"world","group_ranks":[0,1],"seq":3,"op":"all_gather_into_tensor","dtype":"Float",
//    "in_numel":4,"out_numel":8,"start_us":..,"end_us":..,"state":"timed out"}
// (end_us is 0 while the collective is not over).
//
// Example:
//   auto& fr = fsdp::comm::FlightRecorder::process();
//   if (fr.enabled()) {
//     std::string path = fr.dump("/tmp/fr", "on demand");   // -> /tmp/fr/rank_<R>.jsonl
//     std::vector<fsdp::comm::FlightRecord> last = fr.snapshot();
//   }
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::comm {

enum class FlightState : uint8_t { Scheduled, Started, Completed, Failed, TimedOut };
// "scheduled", "started", "completed", "failed", "timed out".
const char* flight_state_name(FlightState state);

// One collective. Plain data: the ring is an array of these, filled in place.
struct FlightRecord {
  uint64_t id = 0;      // this process's record number: 0, 1, 2, ...
  uint64_t seq = 0;     // per-group sequence number
  const char* op = "";  // a string literal (the Comm operation's name)
  int64_t in_numel = 0;
  int64_t out_numel = 0;
  int64_t start_us = 0;  // wall clock (system_clock), microseconds since the epoch
  int64_t end_us = 0;    // 0 while not over
  int32_t group = -1;    // index into FlightRecorder::groups()
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  FlightState state = FlightState::Scheduled;
};

struct FlightGroup {
  std::string name;
  std::vector<int> global_ranks;
  uint64_t issued = 0;  // collectives recorded on this group so far (the next sequence number)
};

class FlightRecorder {
 public:
  // A recorder of `capacity` records (0: off, everything is a no-op).
  explicit FlightRecorder(size_t capacity);

  // The process's recorder, sized by FSDP_FLIGHT_RECORDER_SIZE (see above). Throws
  // std::invalid_argument, naming the variable, when the value is not a count.
  static FlightRecorder& process();
  // The size the environment asks for (the rule above).
  static size_t capacity_from_env();

  bool enabled() const { return capacity_ > 0; }
  size_t capacity() const { return capacity_; }

  // A group of collectives: the same name and ranks give the same index (one sequence for all
  // the Comm objects over it). `own_global_rank` names this process in the dump file. -1 when off.
  int register_group(const std::string& name, const std::vector<int>& global_ranks, int own_global_rank);

  // A collective is issued: records it as scheduled and returns a ticket for the calls below
  // (0 when the recorder is off or `group` is -1).
  uint64_t record(int group, const char* op, c10::ScalarType dtype, int64_t in_numel, int64_t out_numel);
  // The same, finding (or adding) the group by name and ranks under the same lock: what Comm calls.
  uint64_t record(const std::string& group_name, const std::vector<int>& global_ranks, int own_global_rank,
                  const char* op, c10::ScalarType dtype, int64_t in_numel, int64_t out_numel);
  void started(uint64_t ticket);
  void finished(uint64_t ticket, FlightState state);  // Completed, Failed or TimedOut

  // The records still in the ring, oldest first, and the groups.
  std::vector<FlightRecord> snapshot() const;
  std::vector<FlightGroup> groups() const;
  uint64_t recorded() const;  // records ever made (the ring keeps the last capacity() of them)
  int own_rank() const;       // the global rank the dump file is named after

  // The dump (format above) as text.
  std::string to_jsonl(const std::string& reason) const;
  // Writes DIR/rank_<R>.jsonl atomically (temporary file + rename), creating DIR; returns the
  // path. Throws std::runtime_error naming the path when it cannot.
  std::string dump(const std::string& dir, const std::string& reason) const;
  // After a failed collective: dumps to FSDP_FLIGHT_RECORDER_DIR when it is set and the recorder
  // is on, and returns the path ("" when nothing was written; never throws).
  std::string dump_on_failure(const std::string& reason) const;

 private:
  mutable std::mutex mu_;
  size_t capacity_;
  std::vector<FlightRecord> ring_;  // capacity_ slots, allocated once
  uint64_t next_id_ = 0;
  std::vector<FlightGroup> groups_;
  int own_rank_ = -1;

  int find_or_add_group_locked(const std::string& name, const std::vector<int>& global_ranks, int own_global_rank);
  uint64_t record_locked(int group, const char* op, c10::ScalarType dtype, int64_t in_numel, int64_t out_numel,
                         int64_t start_us);
};

namespace detail {
// From a Comm operation to its Work, on the issuing thread (src/comm only): comm.cpp records the
// collective with flight_issue() once its arguments are checked; the Work made for it takes the
// ticket (and marks it started) with flight_take_issued(), 0 when there is none.
void flight_issue(const std::string& group_name, const std::vector<int>& global_ranks, int own_global_rank,
                  const char* op, c10::ScalarType dtype, int64_t in_numel, int64_t out_numel);
uint64_t flight_take_issued();
}  // namespace detail

// Dumps the process's recorder to `dir` (default: FSDP_FLIGHT_RECORDER_DIR) now, e.g. from a
// program that decides it is stuck. Returns the path, "" when the recorder is off or no folder is
// named.
std::string dump_flight_recorder(const std::string& reason = "on demand", const std::string& dir = "");

}  // namespace fsdp::comm
