// The operators FSDP issues per unit and phase of a steady training step at world size 2 (Gloo,
// CPU), counted by fsdp::testing::PhaseOpCounter (tests/support/op_counts.h): an input Linear, 4
// blocks (x + fc2(relu(fc1(x))), each a unit) and an output Linear (the root's). Printed as a table
// and one JSON line, and checked:
//  - always: every block gathered before forward and before backward and reduced after it, with
//    at most the copies of one copy-in and one copy-out per gather (a copy per parameter, 4 per
//    unit, fails), no operator in post-forward, at most one copy per parameter in a reduction (the
//    CPU's reduce-scatter input) and one for the gradient's write, and no operator FSDP issues
//    outside a known unit;
//  - where a python3 with torch.distributed.fsdp.fully_shard runs tests/sharding/fsdp2_op_counts.py
//    (the LibTorch 2.14 half of CI): FSDP2's counts on the same model, per phase and unit, printed
//    beside ours with every (phase, unit) where ours exceed FSDP2's (issue 64's target; the first
//    unit's gradient write-back runs in the final callback, where FSDP2 issues none:
//    docs/benchmarks.md); FSDP_OP_COUNTS_AT_MOST_FSDP2=1 makes each such line a failure. Elsewhere that part skips,
//    saying why; FSDP_REQUIRE_PYTHON_CHECKS=1 makes a skip a failure.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/debug/profiler.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "op_counts.h"
#include "subprocess.h"

using fsdp::profiler::Range;
using fsdp::testing::PhaseOpCounter;
using nlohmann::json;

namespace {

constexpr int64_t kDim = 16, kHidden = 64, kLayers = 4, kBatch = 4;
constexpr int kWarmup = 2, kSteps = 3;
constexpr int64_t kParamsPerUnit = 4;  // a block's fc1, fc2 weights and biases; the root's inp, out

// A hook on a unit's output, registered inside its forward, so before FSDP's post-forward adds its
// pre-backward hook to the same node: it runs just before FSDP's (PhaseOpCounter).
at::Tensor mark_pre_backward(at::Tensor y, const std::string& unit) {
  if (y.requires_grad()) y.register_hook([unit](const at::Tensor&) { PhaseOpCounter::enter_pre_backward_hook(unit); });
  return y;
}

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(std::string name)
      : name(std::move(name)),
        fc1(register_module("fc1", torch::nn::Linear(kDim, kHidden))),
        fc2(register_module("fc2", torch::nn::Linear(kHidden, kDim))) {}
  at::Tensor forward(const at::Tensor& x) {
    const Range body("test::body", name);
    return mark_pre_backward(x + fc2(torch::relu(fc1(x))), name);
  }
  std::string name;
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : inp(register_module("inp", torch::nn::Linear(kDim, kDim))),
        layers(register_module("layers", torch::nn::ModuleList())),
        out(register_module("out", torch::nn::Linear(kDim, kDim))) {
    for (int64_t i = 0; i < kLayers; ++i) {
      blocks.emplace_back("layers." + std::to_string(i));
      layers->push_back(blocks.back());
    }
  }
  at::Tensor forward(const at::Tensor& x) {
    const Range body("test::body", "root");
    at::Tensor h = inp(x);
    for (auto& block : blocks) {
      const Range call("test::call", block->name);
      h = fsdp::call(block, h);
    }
    return mark_pre_backward(out(h), "root");
  }
  torch::nn::Linear inp;
  torch::nn::ModuleList layers;
  torch::nn::Linear out;
  std::vector<Block> blocks;
};
TORCH_MODULE(Net);

}  // namespace

// kWarmup steps, then kSteps counted; rank 0 prints "OPCOUNTS_JSON {phase: {unit: {op: per step}}}".
FSDP_RANK_WORKER(op_counts_world_two) {
  const int rank = fsdp::dist::world_comm()->rank();
  torch::manual_seed(0);
  Net model;
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  torch::manual_seed(rank);
  const at::Tensor x = torch::randn({kBatch, kDim});
  PhaseOpCounter counter;
  const auto step = [&] {
    opt.zero_grad();
    at::Tensor y;
    {
      const Range call("test::call", "root");
      y = fsdp::call(model, x);
    }
    at::Tensor loss = y.pow(2).mean();
    // Runs first in backward, so its callback is queued before FSDP's final callback.
    loss.register_hook([](const at::Tensor&) {
      torch::autograd::Engine::get_default_engine().queue_callback([] { PhaseOpCounter::enter_final_callbacks(); });
    });
    {
      const Range backward("test::backward");
      loss.backward();
    }
    opt.step();
    TORCH_CHECK(PhaseOpCounter::open_records() == 0, PhaseOpCounter::open_records(), " records open after a step");
  };
  for (int i = 0; i < kWarmup; ++i) step();
  counter.reset();
  for (int i = 0; i < kSteps; ++i) step();
  json j = json::object();
  for (const auto& [phase, units] : counter.counts()) {
    for (const auto& [unit, ops] : units) {
      for (const auto& [op, n] : ops) j[phase][unit][op] = static_cast<double>(n) / kSteps;
    }
  }
  if (rank == 0) std::cout << "OPCOUNTS_JSON " << j.dump() << std::endl;
}

namespace {

json json_line(const std::string& output, const std::string& prefix) {
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) == 0) return json::parse(line.substr(prefix.size()));
  }
  throw std::runtime_error("no line starting with '" + prefix + "' in:\n" + output);
}

double total(const json& counts, const std::string& phase, const std::string& unit) {
  if (!counts.contains(phase) || !counts[phase].contains(unit)) return 0;
  double n = 0;
  for (const auto& [op, c] : counts[phase][unit].items()) n += c.get<double>();
  return n;
}

double copies(const json& counts, const std::string& phase, const std::string& unit) {
  if (!counts.contains(phase) || !counts[phase].contains(unit)) return 0;
  double n = 0;
  for (const auto& [op, c] : counts[phase][unit].items()) {
    if (fsdp::testing::RangeOpCounter::is_copy(op)) n += c.get<double>();
  }
  return n;
}

std::string listed(const json& counts, const std::string& phase, const std::string& unit) {
  if (!counts.contains(phase) || !counts[phase].contains(unit)) return "(none)";
  std::string s;
  for (const auto& [op, c] : counts[phase][unit].items()) {
    std::ostringstream o;
    o << op << 'x' << c.get<double>() << ' ';
    s += o.str();
  }
  return s;
}

// Every (phase, unit) either side has, in a fixed order.
std::vector<std::pair<std::string, std::string>> keys(const json& a, const json& b) {
  std::set<std::pair<std::string, std::string>> seen;
  for (const json* c : {&a, &b}) {
    for (const auto& [phase, units] : c->items()) {
      for (const auto& [unit, ops] : units.items()) seen.emplace(phase, unit);
    }
  }
  return {seen.begin(), seen.end()};
}

void print_table(const json& ours, const json& theirs) {
  std::cout << "phase             unit        ours  FSDP2  ours' operators (per step)\n";
  for (const auto& [phase, unit] : keys(ours, theirs)) {
    std::printf("%-18s%-10s%6g %6s  %s\n", phase.c_str(), unit.c_str(), total(ours, phase, unit),
                theirs.is_null() ? "-" : std::to_string(static_cast<int>(total(theirs, phase, unit))).c_str(),
                listed(ours, phase, unit).c_str());
  }
}

// What ours must issue at world 2 whatever FSDP2 does (see the top of the file).
void check_expected(const json& ours) {
  for (int64_t i = 0; i < kLayers; ++i) {
    const std::string u = "layers." + std::to_string(i);
    for (const char* gather : {"pre_forward", "pre_backward"}) {
      EXPECT_GE(copies(ours, gather, u), 1) << u << " was not gathered in " << gather;
      EXPECT_LE(copies(ours, gather, u), 2) << gather << " of " << u << ": " << listed(ours, gather, u);
    }
    // The reduce-scatter input: on the CPU one copy per parameter by design (test_mixed_precision);
    // and the reduced shard written to .grad in one op (a clone where .grad is none: 2.x's zero_grad).
    EXPECT_GE(copies(ours, "post_backward", u), 1) << u << " was not reduced after its backward";
    EXPECT_LE(copies(ours, "post_backward", u), kParamsPerUnit + 1)
        << "post_backward of " << u << ": " << listed(ours, "post_backward", u);
    // Resharding frees memory: no operator at all.
    EXPECT_EQ(total(ours, "post_forward", u), 0) << "post_forward of " << u << ": " << listed(ours, "post_forward", u);
  }
  EXPECT_GE(copies(ours, "pre_forward", "root"), 1) << "the root was not gathered before forward";
  EXPECT_LE(copies(ours, "pre_forward", "root"), 2) << listed(ours, "pre_forward", "root");
  // The root keeps its parameters after forward: nothing to gather before its backward.
  EXPECT_EQ(copies(ours, "pre_backward", "root"), 0) << listed(ours, "pre_backward", "root");
  // Its inputs take no gradient: the final callback reduces it.
  EXPECT_GE(copies(ours, "final_callback", "root"), 1) << "the root was not reduced";
  EXPECT_LE(copies(ours, "final_callback", "root"), kParamsPerUnit + 1) << listed(ours, "final_callback", "root");
  for (const auto& [phase, units] : ours.items()) {
    EXPECT_FALSE(units.contains("?")) << phase << ": operators outside any unit's range: " << listed(ours, phase, "?");
  }
}

bool python_required() {
  const char* v = std::getenv("FSDP_REQUIRE_PYTHON_CHECKS");
  return v && std::string(v) == "1";
}

bool at_most_fsdp2_required() {
  const char* v = std::getenv("FSDP_OP_COUNTS_AT_MOST_FSDP2");
  return v && std::string(v) == "1";
}

}  // namespace

TEST(OpCounts, PerUnitAndPhaseAtWorldTwoBesideFsdp2s) {
  fsdp::testing::RanksOptions options;
  options.timeout = std::chrono::seconds(120);
  const auto ranks = fsdp::testing::run_ranks(2, "op_counts_world_two", options);
  ASSERT_TRUE(ranks.all_ok()) << ranks.report();
  const json ours = json_line(ranks.ranks[0].output, "OPCOUNTS_JSON ");
  check_expected(ours);
#if defined(FSDP_PYTHON3) && defined(FSDP2_OP_COUNTS_PY)
  fsdp::testing::ProcessSpec spec;
  spec.argv = {FSDP_PYTHON3,           FSDP2_OP_COUNTS_PY, "--steps",
               std::to_string(kSteps), "--warmup",         std::to_string(kWarmup)};
  spec.env_set = {{"USE_LIBUV", "0"}};
  spec.timeout = std::chrono::seconds(200);
  const auto py = fsdp::testing::run_process(spec);
  const bool skipped = !py.timed_out && py.term_signal == 0 && py.exit_code == 77;
#else
  const fsdp::testing::ProcessResult py{77, 0, false, "no python3 was found when configuring"};
  const bool skipped = true;
#endif
  if (skipped) {
    print_table(ours, json());
    std::cout << "OPCOUNTS_JSON " << ours.dump() << "\n";
    ASSERT_FALSE(python_required()) << "FSDP_REQUIRE_PYTHON_CHECKS=1 but the FSDP2 side cannot run: " << py.output;
    GTEST_SKIP() << "the FSDP2 comparison (ours' expected counts were checked): " << py.output;
  }
  ASSERT_TRUE(py.ok()) << "fsdp2_op_counts.py failed:\n" << py.output;
  const json theirs = json_line(py.output, "FSDP2_JSON ");
  print_table(ours, theirs);
  std::cout << "OPCOUNTS_JSON " << json{{"ours", ours}, {"fsdp2", theirs}}.dump() << "\n";
  ASSERT_FALSE(theirs.empty()) << "fsdp2_op_counts.py counted nothing:\n" << py.output;
  int over = 0;
  for (const auto& [phase, unit] : keys(ours, theirs)) {
    if (total(ours, phase, unit) <= total(theirs, phase, unit)) continue;
    ++over;
    std::cout << "OVER_FSDP2 " << phase << " of " << unit << ": ours " << listed(ours, phase, unit) << "; FSDP2 "
              << listed(theirs, phase, unit) << "\n";
    EXPECT_FALSE(at_most_fsdp2_required()) << phase << " of " << unit << " issues more operators than FSDP2's";
  }
  std::cout << "phases_over_fsdp2=" << over << "\n";
}
