#pragma once
// The runtime's side of fsdp/debug/phase_timers.h: a scope that adds its wall and thread CPU time
// to a phase.
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>

#include "fsdp/debug/phase_timers.h"

namespace fsdp::detail {

// -1: FSDP_PHASE_TIMERS not read yet (read on first use, so that a bad value is an error thrown
// from the first hook, not at load time), 0 off, 1 on.
extern std::atomic<int> g_phase_timers_on;
int read_phase_timers_env();
inline bool phase_timers_on() {
  const int v = g_phase_timers_on.load(std::memory_order_relaxed);
  return v < 0 ? read_phase_timers_env() == 1 : v == 1;
}
// `unhooked`: a leaf phase that ran outside every Hooks scope of its thread.
void add_phase_time(Phase p, uint64_t ns, uint64_t cpu_ns, bool unhooked);

// The calling thread's CPU time (user + system), in nanoseconds.
inline uint64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}

// Adds the scope's wall and thread CPU time to `p` when the timers are on. Hooks nest (the final
// callback runs post_backward): only the outermost Hooks scope of a thread counts. Reading the
// thread's CPU clock is a system call (the wall clock is not), paid only when on.
class PhaseScope {
 public:
  explicit PhaseScope(Phase p) : phase_(p), on_(phase_timers_on()) {
    if (!on_) return;
    if (p == Phase::Hooks && hook_depth()++ > 0) {
      on_ = false;
      nested_ = true;
      return;
    }
    start_ = std::chrono::steady_clock::now();
    cpu_start_ = thread_cpu_ns();
  }
  ~PhaseScope() {
    if (nested_) --hook_depth();
    if (!on_) return;
    const uint64_t cpu = thread_cpu_ns() - cpu_start_;
    const auto wall = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count());
    if (phase_ == Phase::Hooks) --hook_depth();
    add_phase_time(phase_, wall, cpu, phase_ != Phase::Hooks && hook_depth() == 0);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  static int& hook_depth() {
    thread_local int depth = 0;
    return depth;
  }
  Phase phase_;
  bool on_;
  bool nested_ = false;
  std::chrono::steady_clock::time_point start_{};
  uint64_t cpu_start_ = 0;
};

}  // namespace fsdp::detail
