#pragma once
// --profile-steps A:B: a Chrome trace of steps A to B (numbered as the progress lines number them,
// the first step is 1), one file per rank, DIR/trace_rank<r>.json, DIR being --profile-dir or else
// the metrics file's folder (else the current folder). Perfetto (ui.perfetto.dev) and
// chrome://tracing open it. LibTorch's Kineto profiler writes it where this LibTorch has Kineto
// (Debian sid's 2.x: every operator), FSDP's own writer otherwise (Debian 12's 1.13); either way
// each step is a "ProfilerStep#N" range and FSDP's phases are named ranges ("fsdp::copy_out
// (h.0)", ...: fsdp/debug/profiler.h), the optimizer step "fsdp::optimizer_step".
//
// In train_gpt.cpp:
//   StepProfiler profiler(o.profile_steps, profile_dir(o.profile_dir, o.metrics), run.rank, r0);
//   while (step < o.steps) {
//     const auto profiled = profiler.step(step + 1);  // starts at A, writes the traces after B
//     ...
//   }
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "fsdp/debug/profiler.h"

namespace CLI {
class App;
}

namespace train_gpt {

struct ProfileSteps {
  int64_t first = 0;  // 0: no profiling
  int64_t last = 0;
  bool on() const { return first > 0; }
};

// "" (off), "A:B" (1 <= A <= B) or "A" (A:A). Throws std::invalid_argument with one line naming
// the problem and the expected form.
ProfileSteps parse_profile_steps(const std::string& text);
// parse_profile_steps, and B within --steps.
void check_profile_steps(const std::string& text, int64_t steps);
// --profile-steps and --profile-dir.
void add_profile_options(CLI::App& app, std::string& steps, std::string& dir);
// --profile-dir when given, else the metrics file's folder, else ".".
std::string profile_dir(const std::string& dir_option, const std::string& metrics);

class StepProfiler {
 public:
  // `steps` as --profile-steps; `announce`: print where the traces went (rank 0).
  StepProfiler(const std::string& steps, std::string dir, int rank, bool announce);
  // A run that stops early (a signal, a non-finite loss) inside A..B still writes what it recorded.
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Marks one training step from its construction to its destruction ("ProfilerStep#N").
  class Step {
   public:
    Step(Step&& other) noexcept
        : owner_(std::exchange(other.owner_, nullptr)), number_(other.number_), range_(std::move(other.range_)) {}
    Step& operator=(Step&&) = delete;
    ~Step();

   private:
    friend class StepProfiler;
    Step(StepProfiler* owner, int64_t number);
    StepProfiler* owner_ = nullptr;  // null: this step is not recorded
    int64_t number_ = 0;
    std::unique_ptr<fsdp::profiler::Range> range_;
  };
  // Step `number` (1-based): starts recording at A (or at the first step run after it, on resume).
  [[nodiscard]] Step step(int64_t number);

 private:
  void finish(int64_t last_recorded) noexcept;

  ProfileSteps steps_;
  std::string dir_;
  int rank_;
  bool announce_;
  int64_t first_recorded_ = 0;
  std::unique_ptr<fsdp::profiler::TraceSession> session_;
};

}  // namespace train_gpt
