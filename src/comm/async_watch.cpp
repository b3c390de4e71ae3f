#include "comm/async_watch.h"

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <list>
#include <mutex>
#include <thread>

#include "fsdp/debug/flight_recorder.h"

namespace fsdp::comm::detail {

bool looks_timed_out(const std::string& what) {
  const std::string first = what.substr(0, what.find('\n'));
  return first.find("timed out") != std::string::npos || first.find("Timed out") != std::string::npos;
}

std::string collective_failure(const std::string& description, const std::string& cause, uint64_t flight_ticket,
                               bool timed_out) {
  std::string what = description + " failed: " + cause +
                     "\n  If it timed out, another rank of the group probably crashed, stopped early, or issued "
                     "its collectives in a different order. The timeout is set by CommOptions/InitOptions "
                     "(env FSDP_COLLECTIVE_TIMEOUT_S).";
  FlightRecorder& fr = FlightRecorder::process();
  if (flight_ticket == 0) return what;
  fr.finished(flight_ticket, timed_out ? FlightState::TimedOut : FlightState::Failed);
  const std::string path = fr.dump_on_failure(description + " failed: " + cause);
  if (path.empty()) return what;
  static std::once_flag told;
  std::call_once(told, [&] {
    std::cerr << "fsdp: flight recorder: rank " << fr.own_rank() << "'s last collectives written to " << path
              << std::endl;
  });
  return what + "\n  Flight recorder: this rank's last collectives are in " + path +
         "; line the ranks up with: fsdp-fr " + std::filesystem::path(path).parent_path().string();
}

namespace {

struct Watched {
  compat::WorkPtr work;
  uint64_t ticket;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout;
  std::string description;
};

// One thread, started with the first watched collective and left running (detached) for the
// process's life; it sleeps on the condition variable while nothing is watched.
struct Watch {
  std::mutex mu;
  std::condition_variable cv;
  std::list<Watched> items;
  size_t pending = 0;  // watched and not yet seen completed (items, plus the batch being polled)
  bool started = false;
  bool polling = false;  // the thread is between taking a batch and putting it back (on_exit waits)
};

Watch& watch() {
  static Watch* w = new Watch;  // never destroyed: the thread may outlive static destruction
  return *w;
}

// Set when the process exits normally: from then on CUDA may be torn down under the watch, so it
// reports nothing (a collective still queued at exit is not a failure of the collective), and
// destroys no Work: a WorkNCCL destroyed after CUDA's exit handler aborts the process ("CUDA
// error: driver shutting down", seen on the first GPU run). on_exit runs before CUDA's handler
// (registered later) and waits, briefly, for a poll under way to finish, so the thread touches
// CUDA no more once it returns.
std::atomic<bool> g_exiting{false};
void on_exit() {
  g_exiting = true;
  Watch& w = watch();
  std::unique_lock<std::mutex> lock(w.mu);
  w.cv.wait_for(lock, std::chrono::seconds(2), [&] { return !w.polling; });
}

// At exit the Works are left alive (see g_exiting).
void abandon(std::list<Watched>&& batch) { (void)new std::list<Watched>(std::move(batch)); }

[[noreturn]] void stop_process(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // No destructors: c10d's would wait for the very communicator that hangs.
  std::_Exit(kAsyncCollectiveExitCode);
}

void poll_loop() {
  Watch& w = watch();
  constexpr auto kPoll = std::chrono::milliseconds(5);
  std::unique_lock<std::mutex> lock(w.mu);
  for (;;) {
    w.cv.wait(lock, [&] { return !w.items.empty(); });
    // Poll outside the lock: isCompleted() queries CUDA events.
    std::list<Watched> batch;
    batch.swap(w.items);
    if (g_exiting) return abandon(std::move(batch));
    w.polling = true;
    lock.unlock();
    const auto now = std::chrono::steady_clock::now();
    for (auto it = batch.begin(); it != batch.end();) {
      bool done = false;
      std::exception_ptr error;
      try {
        done = it->work->isCompleted();
        if (done) error = it->work->exception();
      } catch (...) {
        done = true;
        error = std::current_exception();
      }
      if (error) {
        std::string cause = "the backend reported an error";
        try {
          std::rethrow_exception(error);
        } catch (const std::exception& e) {
          cause = e.what();
        } catch (...) {}
        if (g_exiting) break;
        stop_process(collective_failure(it->description, cause, it->ticket, looks_timed_out(cause)));
      }
      if (done && !g_exiting) {
        FlightRecorder::process().finished(it->ticket, FlightState::Completed);
        it = batch.erase(it);  // drops the Work (and the tensors it holds) here
        std::lock_guard<std::mutex> relock(w.mu);
        --w.pending;
        continue;
      }
      if (now >= it->deadline) {
        const double s = static_cast<double>(it->timeout.count()) / 1000.0;
        char cause[96];
        std::snprintf(cause, sizeof(cause), "timed out after %.1f s (not completed on the device)", s);
        if (g_exiting) break;
        stop_process(collective_failure(it->description, cause, it->ticket, /*timed_out=*/true));
      }
      ++it;
    }
    lock.lock();
    w.items.splice(w.items.begin(), batch);  // the still-running ones, oldest first
    w.polling = false;
    if (g_exiting) {
      w.cv.notify_all();  // on_exit may be waiting
      return abandon(std::move(w.items));
    }
    if (!w.items.empty()) {
      lock.unlock();
      std::this_thread::sleep_for(kPoll);
      lock.lock();
    }
  }
}

}  // namespace

void watch_async_collective(compat::WorkPtr work, uint64_t flight_ticket, std::chrono::milliseconds timeout,
                            std::string description) {
  if (!work) {
    FlightRecorder::process().finished(flight_ticket, FlightState::Completed);
    return;
  }
  Watch& w = watch();
  {
    std::lock_guard<std::mutex> lock(w.mu);
    w.items.push_back(
        {std::move(work), flight_ticket, std::chrono::steady_clock::now() + timeout, timeout, std::move(description)});
    ++w.pending;
    if (!w.started) {
      w.started = true;
      std::atexit(on_exit);
      std::thread(poll_loop).detach();
    }
  }
  w.cv.notify_one();
}

bool watch_stopped() { return g_exiting; }

size_t watched_collectives() {
  Watch& w = watch();
  std::lock_guard<std::mutex> lock(w.mu);
  return w.pending;
}

}  // namespace fsdp::comm::detail
