#include "fsdp/comm/work.h"

#include <filesystem>
#include <iostream>
#include <mutex>

#include "fsdp/debug/flight_recorder.h"

namespace fsdp::comm {

struct Work::State {
  compat::WorkPtr backend_work;
  std::function<void()> finish;
  std::chrono::milliseconds timeout;
  std::string description;
  std::mutex mu;
  bool done = false;
  std::exception_ptr error;
  uint64_t flight_ticket = 0;
};

namespace {

// After a failed collective: the record's state, and the recorder's dump when a folder is named.
// Returns the note appended to the error ("" when nothing was written).
std::string flight_failure(uint64_t ticket, bool timed_out, const std::string& what) {
  FlightRecorder& fr = FlightRecorder::process();
  if (ticket == 0) return "";
  fr.finished(ticket, timed_out ? FlightState::TimedOut : FlightState::Failed);
  const std::string path = fr.dump_on_failure(what);
  if (path.empty()) return "";
  static std::once_flag told;
  std::call_once(told, [&] {
    std::cerr << "fsdp: flight recorder: rank " << fr.own_rank() << "'s last collectives written to " << path
              << std::endl;
  });
  return "\n  Flight recorder: this rank's last collectives are in " + path + "; line the ranks up with: fsdp-fr " +
         std::filesystem::path(path).parent_path().string();
}

// Gloo: "Timed out waiting 3000ms for recv operation to complete"; c10d: "Operation timed out!".
// Only the first line: our own advice below it mentions timeouts too.
bool looks_timed_out(const std::string& what) {
  const std::string first = what.substr(0, what.find('\n'));
  return first.find("timed out") != std::string::npos || first.find("Timed out") != std::string::npos;
}

}  // namespace

Work::Work(compat::WorkPtr backend_work, std::function<void()> finish, std::chrono::milliseconds timeout,
           std::string description)
    : state_(std::make_shared<State>()) {
  state_->flight_ticket = detail::flight_take_issued();
  state_->backend_work = std::move(backend_work);
  state_->finish = std::move(finish);
  state_->timeout = timeout;
  state_->description = std::move(description);
}

void Work::wait() {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->done) {
    if (state_->error) std::rethrow_exception(state_->error);
    return;
  }
  try {
    if (state_->backend_work) state_->backend_work->wait(state_->timeout);
    if (state_->finish) state_->finish();
    FlightRecorder::process().finished(state_->flight_ticket, FlightState::Completed);
  } catch (const CommError& e) {
    // Already explained by a nested collective (e.g. the all-gather half of a bf16 all_reduce).
    flight_failure(state_->flight_ticket, looks_timed_out(e.what()), e.what());
    state_->error = std::current_exception();
  } catch (const std::exception& e) {
    const std::string what = state_->description + " failed: " + e.what();
    const std::string note = flight_failure(state_->flight_ticket, looks_timed_out(e.what()), what);
    state_->error = std::make_exception_ptr(
        CommError(what +
                  "\n  If it timed out, another rank of the group probably crashed, stopped early, or issued "
                  "its collectives in a different order. The timeout is set by CommOptions/InitOptions "
                  "(env FSDP_COLLECTIVE_TIMEOUT_S)." +
                  note));
  }
  state_->done = true;
  // Release tensors and buffers held by the collective as soon as it is over.
  state_->backend_work.reset();
  state_->finish = nullptr;
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Work::is_completed() const {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done || !state_->backend_work || state_->backend_work->isCompleted();
}

}  // namespace fsdp::comm
