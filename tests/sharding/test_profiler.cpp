// Chrome traces with FSDP's phases (fsdp/debug/profiler.h): at 2 ranks, each rank records two
// training steps of the parity GPT (every block a unit, plus the root) into its own trace file,
// reads it back as JSON and finds, inside each step's "ProfilerStep#N" range, every unit's
// pre-forward all-gather, copy-out and post-backward reduce-scatter and the optimizer step, with
// non-zero durations; the file is Chrome's trace format (traceEvents, complete events with ts,
// dur, pid, tid). Both writers are checked where they exist: FSDP's own (any LibTorch) and
// LibTorch's Kineto (Backend::Auto picks it where the build has it: Debian sid's 2.x, not
// Debian 12's 1.13). Tensor parallel's collectives and activation checkpointing's recompute
// appear as ranges too; outside a session no range is recorded.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "fsdp/activation/activation_checkpointing.h"
#include "fsdp/debug/profiler.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "models/gpt_tp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using fsdp::models::GPT;
using fsdp::testing::global_batch;
using fsdp::testing::uneven_config;
namespace prof = fsdp::profiler;

namespace {

struct Span {
  std::string name;
  double ts = 0, dur = 0;
};

// Reads a Chrome trace and checks its format; returns its complete ("X") events.
std::vector<Span> read_trace(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in.good(), "no trace at ", path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  TORCH_CHECK(doc.is_object() && doc.contains("traceEvents") && doc["traceEvents"].is_array(), path,
              ": not a Chrome trace (no traceEvents array)");
  std::vector<Span> spans;
  for (const auto& e : doc["traceEvents"]) {
    TORCH_CHECK(e.is_object() && e.contains("ph") && e["ph"].is_string(), path, ": an event without ph: ", e.dump());
    const std::string ph = e["ph"];
    if (ph != "X" && ph != "B" && ph != "E") continue;
    for (const char* key : {"name", "ts", "pid", "tid"}) {
      TORCH_CHECK(e.contains(key), path, ": a ", ph, " event without ", key, ": ", e.dump());
    }
    TORCH_CHECK(e["ts"].is_number(), path, ": ts is not a number: ", e.dump());
    TORCH_CHECK(ph != "X" || (e.contains("dur") && e["dur"].is_number()), path, ": X event without dur: ", e.dump());
    if (ph == "X") spans.push_back({e["name"].get<std::string>(), e["ts"].get<double>(), e["dur"].get<double>()});
  }
  return spans;
}

const Span* find_in(const std::vector<Span>& spans, const std::string& name, const Span& within) {
  for (const auto& s : spans) {
    if (s.name == name && s.ts >= within.ts && s.ts <= within.ts + within.dur) return &s;
  }
  return nullptr;
}

bool any_prefixed(const std::vector<Span>& spans, const std::string& prefix) {
  for (const auto& s : spans) {
    if (s.name.rfind(prefix, 0) == 0) return true;
  }
  return false;
}

prof::Backend backend_from_env() {
  const char* b = std::getenv("TEST_PROFILER_BACKEND");
  const std::string v = b ? b : "auto";
  if (v == "builtin") return prof::Backend::Builtin;
  if (v == "kineto") return prof::Backend::Kineto;
  return prof::Backend::Auto;
}

// One training step of the parity GPT on this rank's slice, marked as torch.profiler and
// train_gpt mark them.
void train_step(GPT& model, torch::optim::Optimizer& opt, int step) {
  const auto c = uneven_config();
  auto world = fsdp::dist::world_comm();
  const prof::Range step_range("ProfilerStep#" + std::to_string(step));
  opt.zero_grad();
  auto data = global_batch(c, 2 * world->size(), step, 0).narrow(0, world->rank() * 2, 2);
  auto loss =
      fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
  loss.backward();
  const prof::Range opt_range("fsdp::optimizer_step");
  opt.step();
}

}  // namespace

FSDP_RANK_WORKER(trace_has_every_units_phases_per_step) {
  const auto c = uneven_config();
  auto world = fsdp::dist::world_comm();
  GPT model = fsdp::testing::parity_model(c);
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  auto opt = fsdp::testing::parity_optimizer(*model);
  train_step(model, opt, 1);  // not recorded: the ranges of a step outside the session are not in the file

  const std::string dir = std::getenv("TEST_TRACE_DIR");
  prof::TraceSession trace(prof::rank_trace_path(dir, world->rank()), {.backend = backend_from_env()});
  trace.start();
  const auto used = trace.backend();
  TORCH_CHECK(used != prof::Backend::Auto, "the backend was not resolved");
  TORCH_CHECK(
      used == (backend_from_env() == prof::Backend::Builtin || !prof::kineto_available() ? prof::Backend::Builtin
                                                                                         : prof::Backend::Kineto),
      "Auto chose ", prof::backend_name(used), " with kineto_available() ", prof::kineto_available());
  train_step(model, opt, 2);
  train_step(model, opt, 3);
  const size_t n = trace.stop();
  TORCH_CHECK(n > 0, "no events recorded");
  std::cout << "rank " << world->rank() << ": " << prof::backend_name(used) << ", " << n << " events\n";

  const auto spans = read_trace(trace.path());
  TORCH_CHECK(!find_in(spans, "ProfilerStep#1", {"", 0, 1e300}), "step 1 ran before start() but is in the trace");
  std::vector<std::string> units = {"root"};
  // Each block by its path from the root (the GPT registers them in its ModuleList h: "h.0", ...).
  for (const auto& block : model->blocks) {
    for (const auto& item : model->named_modules()) {
      if (item.value().get() == block.ptr().get()) units.push_back(item.key());
    }
  }
  TORCH_CHECK(units.size() == model->blocks.size() + 1 && units[1] == "h.0", "unit names: ", units.size());
  for (int step : {2, 3}) {
    const Span* s = find_in(spans, "ProfilerStep#" + std::to_string(step), {"", 0, 1e300});
    TORCH_CHECK(s && s->dur > 0, "no ProfilerStep#", step, " range");
    std::vector<std::string> wanted = {"fsdp::optimizer_step"};
    for (const auto& u : units) {
      for (const char* phase : {"fsdp::pre_forward_all_gather", "fsdp::copy_out", "fsdp::all_gather_wait",
                                "fsdp::post_backward_reduce_scatter", "fsdp::reduce_scatter_wait"}) {
        wanted.push_back(std::string(phase) + " (" + u + ")");
      }
      // The root keeps its parameters for backward (nothing to gather again); the blocks gather.
      if (u != "root") {
        wanted.push_back("fsdp::pre_backward_all_gather (" + u + ")");
        wanted.push_back("fsdp::copy_in (" + u + ")");
        wanted.push_back("fsdp::all_gather (" + u + ")");
        wanted.push_back("fsdp::reshard (" + u + ")");
      }
    }
    for (const auto& name : wanted) {
      const Span* r = find_in(spans, name, *s);
      if (!r) {
        std::set<std::string> names;
        for (const auto& sp : spans) {
          if (sp.name.rfind("fsdp::", 0) == 0) names.insert(sp.name);
        }
        std::string seen;
        for (const auto& n : names) seen += "\n  " + n;
        TORCH_CHECK(false, "rank ", world->rank(), ": no \"", name, "\" range in step ", step, " of ", trace.path(),
                    "; its fsdp:: ranges:", seen);
      }
      TORCH_CHECK(r->dur > 0, "\"", name, "\" has a zero duration in step ", step);
    }
  }
  // LibTorch's operators are in the trace too (recorded by default).
  TORCH_CHECK(any_prefixed(spans, "aten::"), "no aten:: operator in the trace");

  // Outside a session nothing is recorded and a new session starts empty.
  train_step(model, opt, 4);
  prof::TraceSession again(prof::rank_trace_path(dir + "/again", world->rank()),
                           {.backend = prof::Backend::Builtin, .record_ops = false});
  again.start();
  { const prof::Range only("only_this"); }
  again.stop();
  const auto second = read_trace(again.path());
  TORCH_CHECK(second.size() == 1 && second[0].name == "only_this", "the second session recorded ", second.size(),
              " events (expected only its own range)");
}

// Tensor parallel (2 ranks) with activation checkpointing of every block: the TP collectives and
// the recompute appear as ranges.
FSDP_RANK_WORKER(trace_has_tp_collectives_and_recompute) {
  auto c = uneven_config();
  c.vocab_size = 64;  // tensor parallel splits the vocabulary and the heads over the 2 ranks
  auto world = fsdp::dist::world_comm();
  const std::string problem = fsdp::models::gpt_tp_problem(c, world->size());
  TORCH_CHECK(problem.empty(), problem);
  GPT model = fsdp::testing::parity_model(c);
  auto mesh = fsdp::init_device_mesh({world->size()}, {"tp"});
  fsdp::models::parallelize_gpt(model, mesh);
  fsdp::activation::apply_activation_checkpointing(*model, fsdp::activation::every_kth<fsdp::models::BlockImpl>(1));
  auto opt = fsdp::testing::parity_optimizer(*model);
  prof::TraceSession trace(prof::rank_trace_path(std::getenv("TEST_TRACE_DIR"), world->rank()),
                           {.backend = backend_from_env()});
  trace.start();
  {
    const prof::Range step_range("ProfilerStep#1");
    auto data = global_batch(c, 2, 0, 0);  // TP: every rank the same batch
    auto loss =
        fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
  }
  trace.stop();
  const auto spans = read_trace(trace.path());
  const Span* s = find_in(spans, "ProfilerStep#1", {"", 0, 1e300});
  TORCH_CHECK(s, "no step range");
  for (const char* name : {"fsdp::tp_collective (all_reduce)", "fsdp::activation_recompute"}) {
    const Span* r = find_in(spans, name, *s);
    TORCH_CHECK(r && r->dur > 0, "rank ", world->rank(), ": no \"", name, "\" range with a duration in ", trace.path());
  }
}

namespace {
void expect_traces(const char* worker, const char* backend) {
  fsdp::testing::TempDir dir;
  EXPECT_RANKS_PASS(2, worker,
                    {.timeout = std::chrono::seconds(120),
                     .env = {{"TEST_TRACE_DIR", dir.path}, {"TEST_PROFILER_BACKEND", backend}}});
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(std::filesystem::exists(prof::rank_trace_path(dir.path, r))) << "rank " << r;
  }
}
}  // namespace

TEST(Profiler, BuiltinTraceHasEveryUnitsPhasesOnEveryRank) {
  expect_traces("trace_has_every_units_phases_per_step", "builtin");
}

// Kineto where this LibTorch has it, else the builtin writer again (Backend::Auto's choice is
// checked in the worker).
TEST(Profiler, AutoTraceHasEveryUnitsPhasesOnEveryRank) {
  expect_traces("trace_has_every_units_phases_per_step", "auto");
}

TEST(Profiler, TensorParallelCollectivesAndRecomputeAreRanges) {
  expect_traces("trace_has_tp_collectives_and_recompute", "auto");
}

TEST(Profiler, KinetoRefusedWhereLibTorchLacksIt) {
  if (prof::kineto_available()) GTEST_SKIP() << "this LibTorch has Kineto";
  fsdp::testing::TempDir dir;
  prof::TraceSession trace(dir / "t.json", {.backend = prof::Backend::Kineto});
  EXPECT_ERROR_CONTAINS(trace.start(), "has no Kineto");
  // The failed start left nothing behind: another session starts.
  prof::TraceSession other(dir / "u.json", {.backend = prof::Backend::Builtin});
  other.start();
  EXPECT_GE(other.stop(), 0u);
}
