#include "fsdp/comm/work.h"

#include <mutex>

namespace fsdp::comm {

struct Work::State {
  compat::WorkPtr backend_work;
  std::function<void()> finish;
  std::chrono::milliseconds timeout;
  std::string description;
  std::mutex mu;
  bool done = false;
  std::exception_ptr error;
};

Work::Work(compat::WorkPtr backend_work, std::function<void()> finish, std::chrono::milliseconds timeout,
           std::string description)
    : state_(std::make_shared<State>()) {
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
  } catch (const CommError&) {
    // Already explained by a nested collective (e.g. the all-gather half of a bf16 all_reduce).
    state_->error = std::current_exception();
  } catch (const std::exception& e) {
    state_->error = std::make_exception_ptr(CommError(
        state_->description + " failed: " + e.what() +
        "\n  If it timed out, another rank of the group probably crashed, stopped early, or issued "
        "its collectives in a different order. The timeout is set by CommOptions/InitOptions "
        "(env FSDP_COLLECTIVE_TIMEOUT_S)."));
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
