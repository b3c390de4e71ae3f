#include "fsdp/comm/work.h"

#include <mutex>

#include "comm/async_watch.h"
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
    FlightRecorder::process().finished(state_->flight_ticket,
                                       detail::looks_timed_out(e.what()) ? FlightState::TimedOut : FlightState::Failed);
    state_->error = std::current_exception();
  } catch (const std::exception& e) {
    state_->error = std::make_exception_ptr(CommError(detail::collective_failure(
        state_->description, e.what(), state_->flight_ticket, detail::looks_timed_out(e.what()))));
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
