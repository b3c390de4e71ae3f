#pragma once
// The watch over collectives whose Work::wait() does not block the host (NCCL: wait() is a stream
// wait). Such a collective's end is only known from the backend's own completion (its CUDA end
// event, queried by c10d::Work::isCompleted()), so one thread per process polls it:
//   - completed: the flight recorder's record is marked completed then, not when it was queued;
//   - failed, or not completed within the group's timeout (FSDP_COLLECTIVE_TIMEOUT_S): the record
//     is marked failed or timed out, the flight recorder is dumped (FSDP_FLIGHT_RECORDER_DIR), the
//     same CommError text as a Gloo collective's is printed, and the process ends with exit code
//     kAsyncCollectiveExitCode. Every other rank of a hung collective times out alike (or is
//     stopped by its launcher when this one ends), so no rank is left waiting.
// c10d's own watchdog is given a longer timeout (Comm does that), so ours fires first, with our
// message, instead of c10d's asynchronous abort.
#include <chrono>
#include <cstdint>
#include <string>

#include "fsdp/compat/c10d.h"

namespace fsdp::comm::detail {

inline constexpr int kAsyncCollectiveExitCode = 3;

// Watches `work` (already issued) until it completes; `flight_ticket` is its flight-recorder record
// (0: none), `description` names the operation and group, as Work's errors do.
void watch_async_collective(compat::WorkPtr work, uint64_t flight_ticket, std::chrono::milliseconds timeout,
                            std::string description);

// Collectives still watched (not yet seen completed).
size_t watched_collectives();

// True once the process has begun to exit: the watch has stopped and completes nothing more.
bool watch_stopped();

// The timeout c10d's own watchdog gets for a group whose collectives are watched here: long enough
// after ours that our message and dump come first, short enough that a process whose watch thread
// could not run still ends.
inline std::chrono::milliseconds backend_watchdog_timeout(std::chrono::milliseconds ours) {
  return 2 * ours + std::chrono::milliseconds(30000);
}

// A collective failed: marks its record failed or timed out, dumps the flight recorder when a
// folder is named, and returns the CommError text: "<description> failed: <cause>", the advice,
// and where the dump went. Shared by Work::wait (Gloo, blocking NCCL) and the watch.
std::string collective_failure(const std::string& description, const std::string& cause, uint64_t flight_ticket,
                               bool timed_out);

// c10d's "timed out" wordings (Gloo's "Timed out waiting ...", c10d's "Operation timed out!"),
// first line only.
bool looks_timed_out(const std::string& what);

}  // namespace fsdp::comm::detail
