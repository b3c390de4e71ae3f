// layer: profiler
#pragma once
// Chrome traces of training steps, with FSDP's phases as named ranges (Perfetto and
// chrome://tracing open them).
//
// FSDP marks its phases with LibTorch's RecordFunction (USER_SCOPE, what PyTorch's
// record_function makes), named "<phase> (<unit>)", the unit being its module's path from the root
// ("root" for the root itself, "a,b" for a unit of several modules):
//   fsdp::pre_forward_all_gather (U)        before U's forward: its parameters gathered (waiting for a
//                                            prefetch, or copy-in + all-gather + wait + copy-out)
//   fsdp::pre_backward_all_gather (U)       the same before U's backward
//   fsdp::copy_in (U)                       the shards into the all-gather input
//   fsdp::all_gather (U)                    issuing the all-gather (also as a prefetch, inside the unit before)
//   fsdp::all_gather_wait (U)               blocked until the gathered rows are here
//   fsdp::copy_out (U)                      the all-gather output into the unsharded parameters
//   fsdp::reshard (U)                       freeing the unsharded parameters
//   fsdp::post_backward_reduce_scatter (U)  the reduce-scatter input and issuing the reduce-scatter
//   fsdp::reduce_scatter_input (U)          the unsharded gradients into the flat reduce-scatter input
//   fsdp::reduce_scatter_wait (U)           waiting for it (and HSDP's all-reduce), writing the sharded .grad
//   fsdp::tp_collective (OP)                a tensor-parallel collective (all_reduce, all_gather,
//                                            reduce_scatter, all_to_all), forward or backward
//   fsdp::activation_recompute              activation checkpointing's forward again, inside backward
// A trainer adds its own (train_gpt: "ProfilerStep#N" around each step, as torch.profiler names
// them, and "fsdp::optimizer_step"). Each range costs one thread-local check when no profiler
// or trace is active.
//
// A TraceSession records from start() to stop() and then writes one Chrome trace JSON file (give
// each rank its own: rank_trace_path). Backend::Auto takes LibTorch's Kineto profiler where this
// LibTorch has it (Debian sid's 2.x: every operator, FSDP's ranges as "user_annotation"), else
// FSDP's own writer (Debian 12's 1.13 lacks Kineto): a RecordFunction callback that records the
// ranges above, and LibTorch's operators unless TraceOptions::record_ops is false.
//
// Example:
//   const int rank = fsdp::dist::world_comm()->rank();
//   fsdp::profiler::TraceSession trace(fsdp::profiler::rank_trace_path("traces", rank));
//   trace.start();
//   for (int i = 1; i <= 3; ++i) {
//     fsdp::profiler::Range range("ProfilerStep#" + std::to_string(i));
//     fsdp::models::gpt_loss(fsdp::call(model, tokens), targets).backward();
//     {
//       fsdp::profiler::Range opt_range("fsdp::optimizer_step");
//       optimizer.step();
//     }
//     optimizer.zero_grad();
//   }
//   trace.stop();  // writes traces/trace_rank<rank>.json
#include <ATen/record_function.h>

#include <memory>
#include <string>
#include <string_view>

#include "fsdp/compat/profiler.h"

namespace fsdp::profiler {

enum class Backend {
  Auto,     // Kineto where this LibTorch has it, else Builtin
  Kineto,   // LibTorch's profiler (throws at start() where this LibTorch lacks Kineto)
  Builtin,  // FSDP's own Chrome-trace writer (any LibTorch)
};
const char* backend_name(Backend b);  // "auto", "kineto", "builtin"

// True when this process's LibTorch has Kineto (fsdp/compat/profiler.h).
bool kineto_available();

// Example: fsdp::profiler::TraceOptions o; o.backend = fsdp::profiler::Backend::Builtin; o.record_ops = false;
struct TraceOptions {
  Backend backend = Backend::Auto;
  // Also LibTorch's operators (aten::mm, autograd nodes), not only the named ranges. Kineto
  // records them anyway unless this is false.
  bool record_ops = true;
};

// DIR/trace_rank<rank>.json
std::string rank_trace_path(const std::string& dir, int rank);

// One recording. At most one session records at a time in a process (start() throws otherwise).
class TraceSession {
 public:
  explicit TraceSession(std::string path, TraceOptions options = {});
  ~TraceSession();  // a session still recording stops without writing
  TraceSession(const TraceSession&) = delete;
  TraceSession& operator=(const TraceSession&) = delete;

  void start();
  // Stops recording and writes the trace to path() (its folder is created). Returns the number of
  // events written.
  size_t stop();
  bool recording() const { return recording_; }
  // The backend in use once started (Auto resolved).
  Backend backend() const { return resolved_; }
  const std::string& path() const { return path_; }

  struct Impl;

 private:
  std::string path_;
  TraceOptions options_;
  Backend resolved_;
  bool recording_ = false;
  std::unique_ptr<Impl> impl_;
};

// A named range (RecordFunction, USER_SCOPE) from construction to destruction. When nothing
// records, construction is one check and the name is never built.
class Range {
 public:
  explicit Range(const char* name) : guard_(at::RecordScope::USER_SCOPE) {
    if (guard_.isActive()) compat::begin_record_function(guard_, std::string(name));
  }
  explicit Range(const std::string& name) : guard_(at::RecordScope::USER_SCOPE) {
    if (guard_.isActive()) compat::begin_record_function(guard_, name);
  }
  // "name (detail)", or just "name" when detail is empty.
  Range(const char* name, std::string_view detail) : guard_(at::RecordScope::USER_SCOPE) {
    if (!guard_.isActive()) return;
    std::string full(name);
    if (!detail.empty()) {
      full += " (";
      full += detail;
      full += ')';
    }
    compat::begin_record_function(guard_, full);
  }
  Range(const Range&) = delete;
  Range& operator=(const Range&) = delete;

 private:
  at::RecordFunction guard_;
};

}  // namespace fsdp::profiler
