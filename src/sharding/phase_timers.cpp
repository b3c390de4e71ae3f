#include "phase_timers.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fsdp {
namespace detail {
namespace {
bool from_env() {
  const char* v = std::getenv("FSDP_PHASE_TIMERS");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "0") == 0) return false;
  if (std::strcmp(v, "1") == 0) return true;
  throw std::invalid_argument(std::string("fsdp: FSDP_PHASE_TIMERS='") + v +
                              "' is not 0 or 1; use 1 to time FSDP's phases (fsdp/debug/phase_timers.h) or 0");
}
constexpr size_t kCount = static_cast<size_t>(Phase::Count);
std::array<std::atomic<uint64_t>, kCount> g_ns{};
std::array<std::atomic<uint64_t>, kCount> g_cpu_ns{};
std::array<std::atomic<uint64_t>, kCount> g_calls{};
std::atomic<uint64_t> g_unhooked_ns{0}, g_unhooked_cpu_ns{0};
}  // namespace

std::atomic<int> g_phase_timers_on{-1};

int read_phase_timers_env() {
  const int v = from_env() ? 1 : 0;
  int expected = -1;
  g_phase_timers_on.compare_exchange_strong(expected, v);  // set_phase_timers() wins over the environment
  return g_phase_timers_on.load();
}

void add_phase_time(Phase p, uint64_t ns, uint64_t cpu_ns, bool unhooked) {
  g_ns[static_cast<size_t>(p)].fetch_add(ns, std::memory_order_relaxed);
  g_cpu_ns[static_cast<size_t>(p)].fetch_add(cpu_ns, std::memory_order_relaxed);
  g_calls[static_cast<size_t>(p)].fetch_add(1, std::memory_order_relaxed);
  if (unhooked) {
    g_unhooked_ns.fetch_add(ns, std::memory_order_relaxed);
    g_unhooked_cpu_ns.fetch_add(cpu_ns, std::memory_order_relaxed);
  }
}
}  // namespace detail

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::CopyIn: return "copy-in";
    case Phase::AllGatherIssue: return "all-gather issue";
    case Phase::AllGatherWait: return "all-gather wait";
    case Phase::CopyOut: return "copy-out";
    case Phase::Reshard: return "reshard (free)";
    case Phase::ReduceScatterInput: return "reduce-scatter input";
    case Phase::ReduceScatterIssue: return "reduce-scatter issue";
    case Phase::ReduceScatterWait: return "reduce-scatter wait";
    case Phase::GradAccumulate: return "sharded grad write";
    case Phase::PoolTrim: return "pool trim";
    case Phase::Hooks: return "hooks (inclusive)";
    case Phase::Count: break;
  }
  return "?";
}

PhaseTimes PhaseTimes::operator-(const PhaseTimes& before) const {
  PhaseTimes d;
  for (size_t i = 0; i < detail::kCount; ++i) {
    d.ns[i] = ns[i] - before.ns[i];
    d.cpu_ns[i] = cpu_ns[i] - before.cpu_ns[i];
    d.calls[i] = calls[i] - before.calls[i];
  }
  d.unhooked_ns = unhooked_ns - before.unhooked_ns;
  d.unhooked_cpu_ns = unhooked_cpu_ns - before.unhooked_cpu_ns;
  return d;
}

std::string PhaseTimes::table(int steps) const {
  const double per = steps > 0 ? static_cast<double>(steps) : 1.0;
  std::string out = "| phase | calls / step | ms / step | CPU ms / step |\n|---|---|---|---|\n";
  // The leaves inside the hooks: all of them but those run directly (e.g. FSDPModule::unshard).
  double leaves = -static_cast<double>(unhooked_ns) / 1e6, leaves_cpu = -static_cast<double>(unhooked_cpu_ns) / 1e6;
  char line[200];
  for (size_t i = 0; i < detail::kCount; ++i) {
    const auto p = static_cast<Phase>(i);
    if (p != Phase::Hooks) {
      leaves += ms(p);
      leaves_cpu += cpu_ms(p);
    }
    std::snprintf(line, sizeof line, "| %s | %.1f | %.2f | %.2f |\n", phase_name(p),
                  static_cast<double>(calls[i]) / per, ms(p) / per, cpu_ms(p) / per);
    out += line;
  }
  std::snprintf(line, sizeof line, "| hooks minus the phases inside them (bookkeeping) | | %.2f | %.2f |\n",
                (ms(Phase::Hooks) - leaves) / per, (cpu_ms(Phase::Hooks) - leaves_cpu) / per);
  out += line;
  if (unhooked_ns > 0) {
    std::snprintf(line, sizeof line, "| phases outside the hooks (included above) | | %.2f | %.2f |\n",
                  static_cast<double>(unhooked_ns) / 1e6 / per, static_cast<double>(unhooked_cpu_ns) / 1e6 / per);
    out += line;
  }
  return out;
}

void set_phase_timers(bool on) { detail::g_phase_timers_on.store(on ? 1 : 0, std::memory_order_relaxed); }
bool phase_timers_enabled() { return detail::phase_timers_on(); }

void reset_phase_timers() {
  for (size_t i = 0; i < detail::kCount; ++i) {
    detail::g_ns[i].store(0, std::memory_order_relaxed);
    detail::g_cpu_ns[i].store(0, std::memory_order_relaxed);
    detail::g_calls[i].store(0, std::memory_order_relaxed);
  }
  detail::g_unhooked_ns.store(0, std::memory_order_relaxed);
  detail::g_unhooked_cpu_ns.store(0, std::memory_order_relaxed);
}

PhaseTimes phase_times() {
  PhaseTimes t;
  for (size_t i = 0; i < detail::kCount; ++i) {
    t.ns[i] = detail::g_ns[i].load(std::memory_order_relaxed);
    t.cpu_ns[i] = detail::g_cpu_ns[i].load(std::memory_order_relaxed);
    t.calls[i] = detail::g_calls[i].load(std::memory_order_relaxed);
  }
  t.unhooked_ns = detail::g_unhooked_ns.load(std::memory_order_relaxed);
  t.unhooked_cpu_ns = detail::g_unhooked_cpu_ns.load(std::memory_order_relaxed);
  return t;
}

}  // namespace fsdp
