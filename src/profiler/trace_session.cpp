#include "fsdp/debug/profiler.h"

#include <sys/syscall.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <unordered_set>
#include <vector>

namespace fsdp::profiler {

namespace {

std::atomic<bool> g_session_active{false};

// ---- FSDP's own writer: a global RecordFunction callback ---------------------------------------

struct Event {
  std::string name;
  bool user_scope;
  int64_t tid;
  int64_t start_ns;  // steady clock
  int64_t end_ns;
};

// One per process, never destroyed: an operator that began before stop() may end after it.
struct Recorder {
  std::mutex mu;
  bool on = false;
  std::vector<Event> events;
};
Recorder& recorder() {
  static auto* r = new Recorder();
  return *r;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

int64_t this_tid() {
  thread_local const int64_t tid = static_cast<int64_t>(::syscall(SYS_gettid));
  return tid;
}

struct StartTime : at::ObserverContext {
  int64_t ns = 0;
};

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction&) {
  auto ctx = std::make_unique<StartTime>();
  ctx->ns = now_ns();
  return ctx;
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  const int64_t end = now_ns();
  if (ctx == nullptr) return;
  Event e{fn.name(), fn.scope() == at::RecordScope::USER_SCOPE, this_tid(), static_cast<StartTime*>(ctx)->ns, end};
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.on) r.events.push_back(std::move(e));
}

void write_file(const std::string& path, const std::string& text) {
  const std::filesystem::path p(path);
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw std::runtime_error("fsdp::profiler: could not write the trace " + path + " (disk full?)");
}

}  // namespace

struct TraceSession::Impl {
  // Builtin
  at::CallbackHandle handle = at::INVALID_CALLBACK_HANDLE;
  int64_t steady_start_ns = 0;
  int64_t wall_start_us = 0;  // system clock at steady_start_ns: timestamps comparable across ranks
};

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::Auto: return "auto";
    case Backend::Kineto: return "kineto";
    case Backend::Builtin: return "builtin";
  }
  return "?";
}

bool kineto_available() { return compat::kineto_in_libtorch(); }

std::string rank_trace_path(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("trace_rank" + std::to_string(rank) + ".json")).string();
}

TraceSession::TraceSession(std::string path, TraceOptions options)
    : path_(std::move(path)), options_(options), resolved_(options.backend) {
  if (path_.empty())
    throw std::invalid_argument("fsdp::profiler::TraceSession: empty path; give the trace's file name");
}

TraceSession::~TraceSession() {
  if (!recording_) return;
  try {
    if (resolved_ == Backend::Kineto) {
      torch::autograd::profiler::disableProfiler();
    } else {
      at::removeCallback(impl_->handle);
      std::lock_guard<std::mutex> lock(recorder().mu);
      recorder().on = false;
      recorder().events.clear();
    }
  } catch (...) {}
  g_session_active = false;
}

void TraceSession::start() {
  if (recording_) throw std::logic_error("fsdp::profiler::TraceSession::start: already recording " + path_);
  if (g_session_active.exchange(true)) {
    throw std::logic_error(
        "fsdp::profiler::TraceSession::start: another trace session is recording in this process; "
        "stop it first (one at a time)");
  }
  resolved_ = options_.backend;
  if (resolved_ == Backend::Auto) resolved_ = kineto_available() ? Backend::Kineto : Backend::Builtin;
  try {
    if (resolved_ == Backend::Kineto) {
      if (!kineto_available()) {
        throw std::invalid_argument(
            "fsdp::profiler: this LibTorch has no Kineto (Debian 12's 1.13 is built without it); use Backend::Builtin "
            "or Backend::Auto");
      }
      namespace tp = torch::profiler::impl;
      const tp::ProfilerConfig config(tp::ProfilerState::KINETO);
      const std::set<tp::ActivityType> activities{tp::ActivityType::CPU};
      std::unordered_set<at::RecordScope> scopes;
      if (!options_.record_ops) scopes.insert(at::RecordScope::USER_SCOPE);
      torch::autograd::profiler::prepareProfiler(config, activities);
      torch::autograd::profiler::enableProfiler(config, activities, scopes);
    } else {
      impl_ = std::make_unique<Impl>();
      impl_->steady_start_ns = now_ns();
      impl_->wall_start_us =
          std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      {
        std::lock_guard<std::mutex> lock(recorder().mu);
        recorder().events.clear();
        recorder().on = true;
      }
      auto cb = at::RecordFunctionCallback(&on_start, &on_end).needsInputs(false);
      if (!options_.record_ops) cb.scopes({at::RecordScope::USER_SCOPE});
      impl_->handle = at::addGlobalCallback(std::move(cb));
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(recorder().mu);
      recorder().on = false;
    }
    g_session_active = false;
    throw;
  }
  recording_ = true;
}

size_t TraceSession::stop() {
  if (!recording_) throw std::logic_error("fsdp::profiler::TraceSession::stop: not recording " + path_);
  recording_ = false;
  struct Release {
    ~Release() { g_session_active = false; }
  } release;
  if (resolved_ == Backend::Kineto) {
    auto result = torch::autograd::profiler::disableProfiler();
    const std::filesystem::path p(path_);
    if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path());
    result->save(path_);
    return result->events().size();
  }
  at::removeCallback(impl_->handle);
  std::vector<Event> events;
  {
    std::lock_guard<std::mutex> lock(recorder().mu);
    recorder().on = false;
    events.swap(recorder().events);
  }
  const int64_t pid = ::getpid();
  nlohmann::json trace_events = nlohmann::json::array();
  trace_events.push_back({{"name", "process_name"},
                          {"ph", "M"},
                          {"pid", pid},
                          {"tid", 0},
                          {"args", {{"name", "fsdp (pid " + std::to_string(pid) + ")"}}}});
  for (const Event& e : events) {
    // Microseconds with nanosecond digits; a range is never shorter than 1 ns in the file.
    const double ts =
        static_cast<double>(impl_->wall_start_us) + static_cast<double>(e.start_ns - impl_->steady_start_ns) / 1000.0;
    const double dur = static_cast<double>(std::max<int64_t>(e.end_ns - e.start_ns, 1)) / 1000.0;
    trace_events.push_back({{"name", e.name},
                            {"cat", e.user_scope ? "user_annotation" : "cpu_op"},
                            {"ph", "X"},
                            {"ts", ts},
                            {"dur", dur},
                            {"pid", pid},
                            {"tid", e.tid}});
  }
  const nlohmann::json doc = {{"traceEvents", std::move(trace_events)},
                              {"displayTimeUnit", "ms"},
                              {"otherData", {{"writer", "fsdp::profiler (builtin)"}}}};
  write_file(path_, doc.dump());
  impl_.reset();
  return events.size();
}

}  // namespace fsdp::profiler
