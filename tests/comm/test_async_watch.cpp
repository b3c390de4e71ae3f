// The watch over collectives whose wait() does not block the host (NCCL's; comm/async_watch.h),
// driven by a c10d::Work whose completion the test controls: the flight recorder's record is
// completed only when the work is, and a work that never completes (or fails) ends the process
// with our message, the flight recorder's dump and exit code 3, within its timeout.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <thread>

#include "comm/async_watch.h"
#include "fsdp/debug/flight_recorder.h"

namespace {

using fsdp::comm::FlightRecorder;
using fsdp::comm::FlightState;
using fsdp::comm::detail::kAsyncCollectiveExitCode;
using fsdp::comm::detail::watch_async_collective;
using fsdp::comm::detail::watched_collectives;
using namespace std::chrono_literals;

// A device-side collective as the host sees it: done when the test says so, maybe with an error.
class FakeWork : public c10d::Work {
 public:
  bool isCompleted() override { return done.load(); }
  std::exception_ptr exception() const override { return error; }
  std::atomic<bool> done{false};
  std::exception_ptr error;
};

uint64_t record_collective(const char* op) {
  return FlightRecorder::process().record("watched", {0}, 0, op, at::kFloat, 4, 4);
}

FlightState state_of(uint64_t ticket) {
  for (const auto& r : FlightRecorder::process().snapshot()) {
    if (r.id == ticket - 1) return r.state;
  }
  throw std::runtime_error("record gone");
}

TEST(AsyncWatch, RecordCompletesWhenTheWorkDoesNotWhenQueued) {
  ASSERT_TRUE(FlightRecorder::process().enabled());
  auto work = c10::make_intrusive<FakeWork>();
  const uint64_t ticket = record_collective("all_reduce");
  watch_async_collective(work, ticket, 10s, "fsdp: all_reduce on group 'watched'");
  std::this_thread::sleep_for(50ms);  // ten polls
  EXPECT_NE(state_of(ticket), FlightState::Completed) << "queued is not completed";
  EXPECT_EQ(watched_collectives(), 1u);
  work->done = true;
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (state_of(ticket) != FlightState::Completed && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(state_of(ticket), FlightState::Completed);
  while (watched_collectives() != 0 && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(watched_collectives(), 0u) << "a completed collective is no longer held";
}

class AsyncWatchDeath : public ::testing::Test {
 protected:
  void SetUp() override { GTEST_FLAG_SET(death_test_style, "threadsafe"); }
};

TEST_F(AsyncWatchDeath, HungCollectiveEndsTheProcessWithOurMessageAndTheDump) {
  // The death test's child re-runs this body in a new process: the folder's name comes with the
  // environment it inherits, not from its own pid.
  if (std::getenv("FSDP_TEST_WATCH_DIR") == nullptr) {
    const auto mine = std::filesystem::temp_directory_path() / ("fsdp_watch_" + std::to_string(::getpid()));
    ::setenv("FSDP_TEST_WATCH_DIR", mine.c_str(), 1);
  }
  const std::filesystem::path dir = std::getenv("FSDP_TEST_WATCH_DIR");
  std::filesystem::remove_all(dir);
  EXPECT_EXIT(
      {
        ::setenv("FSDP_FLIGHT_RECORDER_DIR", dir.c_str(), 1);
        auto work = c10::make_intrusive<FakeWork>();  // never completes
        watch_async_collective(work, record_collective("reduce_scatter_tensor"), 300ms,
                               "fsdp: reduce_scatter_tensor on group 'watched' (nccl, ranks [0])");
        std::this_thread::sleep_for(20s);  // the host goes on; the watch must end it
        std::exit(0);
      },
      ::testing::ExitedWithCode(kAsyncCollectiveExitCode),
      "reduce_scatter_tensor on group 'watched' \\(nccl, ranks \\[0\\]\\) failed: timed out after 0\\.3 s"
      ".*FSDP_COLLECTIVE_TIMEOUT_S.*Flight recorder: this rank's last collectives are in");
  // The dump names the collective as timed out.
  bool found = false;
  for (const auto& f : std::filesystem::directory_iterator(dir)) found = found || f.path().extension() == ".jsonl";
  EXPECT_TRUE(found) << "no flight recorder dump in " << dir;
  std::filesystem::remove_all(dir);
}

TEST_F(AsyncWatchDeath, FailedCollectiveEndsTheProcessNamingTheCause) {
  EXPECT_EXIT(
      {
        auto work = c10::make_intrusive<FakeWork>();
        work->error = std::make_exception_ptr(std::runtime_error("NCCL error: remote process exited"));
        work->done = true;
        watch_async_collective(work, record_collective("all_gather_into_tensor"), 10s,
                               "fsdp: all_gather_into_tensor on group 'watched'");
        std::this_thread::sleep_for(20s);
        std::exit(0);
      },
      ::testing::ExitedWithCode(kAsyncCollectiveExitCode),
      "all_gather_into_tensor on group 'watched' failed: NCCL error: remote process exited");
}

}  // namespace
