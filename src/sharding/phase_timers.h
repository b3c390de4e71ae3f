#pragma once
// The runtime's side of fsdp/debug/phase_timers.h: a scope that adds its wall time to a phase.
#include <atomic>
#include <chrono>

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
void add_phase_time(Phase p, uint64_t ns);

// Adds the scope's wall time to `p` when the timers are on. Hooks nest (the final callback runs
// post_backward): only the outermost Hooks scope of a thread counts.
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
  }
  ~PhaseScope() {
    if (nested_) --hook_depth();
    if (!on_) return;
    if (phase_ == Phase::Hooks) --hook_depth();
    add_phase_time(
        phase_,
        static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count()));
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
};

}  // namespace fsdp::detail
