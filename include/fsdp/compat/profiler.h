#pragma once
// LibTorch's profiler, where the versions differ (fsdp/debug/profiler.h uses these).
//  - Kineto: Debian 12's LibTorch 1.13 is built without it (USE_KINETO off: the Kineto API in
//    torch/csrc/autograd/profiler_kineto.h links, events are collected, but
//    ProfilerResult::save() throws "Saving a trace requires ... USE_KINETO=1"); Debian sid's 2.x
//    has it (libkineto inside libtorch_cpu). The headers are the same either way
//    (torch::profiler::kKinetoAvailable reflects the consumer's own USE_KINETO macro, not the
//    library's), so it is detected at run time, by the symbol libkineto exports: libkineto_init.
//  - RecordFunction::before(): 1.13 takes the name as const char* or std::string, 2.x as a
//    std::variant<std::string_view, schema>; a std::string argument selects the right one on both,
//    and the RecordFunction keeps its own copy on both.
#include <ATen/record_function.h>
#include <dlfcn.h>

#include <string>

namespace fsdp::compat {

// True when the LibTorch this process runs with has Kineto built in (so the Kineto profiler can
// write a Chrome trace).
inline bool kineto_in_libtorch() {
  static const bool found = dlsym(RTLD_DEFAULT, "libkineto_init") != nullptr;
  return found;
}

// Starts an active RecordFunction `guard` (check guard.isActive() first) under `name`.
inline void begin_record_function(at::RecordFunction& guard, const std::string& name) { guard.before(name); }

}  // namespace fsdp::compat
