#pragma once
// A waitable handle for an asynchronous collective.
//
// A collective may be several steps: the backend's own operation, then local work that only
// makes sense once it finished (summing an all_to_all into a reduce-scatter, dividing a sum into
// an average, copying a 16-bit pattern back). wait() runs those steps on the caller's thread, so
// the result is ready when wait() returns. Errors (including timeouts) surface from wait().
//
// NCCL (CUDA tensors): wait() does not block the host. It makes the caller's current CUDA stream
// wait for the collective ("ready" means: for kernels queued on that stream from now on), as
// ProcessGroupNCCL's Work::wait() does. The collective's end is watched on the device
// (comm/async_watch.h): the flight recorder marks it completed then, and a collective that fails
// or is not complete within the group's timeout ends the process (exit code 3) with the same
// message as a Gloo failure and the flight recorder's dump, before c10d's own watchdog would.
#include <chrono>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/compat/c10d.h"

namespace fsdp::comm {

// A collective failed or timed out; the message names the operation, the group and the likely fix.
class CommError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Work {
 public:
  Work() = default;  // an already-completed handle
  // `backend_work` may be null (nothing outstanding); `finish` runs once after it completes.
  Work(compat::WorkPtr backend_work, std::function<void()> finish, std::chrono::milliseconds timeout,
       std::string description);

  // Blocks until the collective and its local steps are done. Idempotent; rethrows failures with
  // the operation and group named.
  void wait();
  // True when wait() would not block on communication (local steps may still be pending).
  bool is_completed() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace fsdp::comm
