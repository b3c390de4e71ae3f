#pragma once
// The copy operators that FSDP's ranges issue themselves, counted while a RangeOpCounter lives:
// [Note: one copy kernel per unit] (src/sharding/collectives.cpp) says copy-in, copy-out and the
// reduce-scatter input are one op per unit where LibTorch has the op; this is how a test sees it.
//
// A global RecordFunction callback (every thread: on a GPU, backward and its hooks run on the
// device's autograd thread) keeps, per thread, the FSDP ranges open (fsdp::profiler::Range, a
// USER_SCOPE record named "fsdp::copy_in (blocks.0)") and the depth of ATen operators. An
// operator is counted for the innermost open range when no other operator encloses it inside that
// range (so the per-tensor copies inside CPU's _foreach_copy_ or split_with_sizes_copy are not).
//
//   fsdp::testing::RangeOpCounter counter;
//   ... a training step ...
//   counter.ranges("fsdp::copy_out");                           // how often the range ran
//   counter.ops("fsdp::copy_out")["aten::split_with_sizes_copy"];  // the ops it issued itself
//   counter.copies("fsdp::copy_out");                           // all of its copy ops
#include <ATen/record_function.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fsdp::testing {

class RangeOpCounter {
 public:
  RangeOpCounter() {
    auto cb = at::RecordFunctionCallback(&on_start, &on_end)
                  .needsInputs(false)
                  .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE});
    {
      std::lock_guard<std::mutex> lock(state().mu);
      state().on = true;
    }
    handle_ = at::addGlobalCallback(std::move(cb));
  }
  ~RangeOpCounter() {
    at::removeCallback(handle_);
    std::lock_guard<std::mutex> lock(state().mu);
    state().on = false;
    state().ops.clear();
    state().ranges.clear();
  }
  RangeOpCounter(const RangeOpCounter&) = delete;
  RangeOpCounter& operator=(const RangeOpCounter&) = delete;

  // How many times the range `name` ("fsdp::copy_in": the unit's label left out) ran.
  int64_t ranges(const std::string& name) const {
    std::lock_guard<std::mutex> lock(state().mu);
    auto it = state().ranges.find(name);
    return it == state().ranges.end() ? 0 : it->second;
  }
  // The operators the range issued itself, by name, summed over its runs.
  std::map<std::string, int64_t> ops(const std::string& name) const {
    std::lock_guard<std::mutex> lock(state().mu);
    auto it = state().ops.find(name);
    return it == state().ops.end() ? std::map<std::string, int64_t>() : it->second;
  }
  // Of those, the operators that copy data (each one a kernel launch or more on a GPU).
  int64_t copies(const std::string& name) const {
    int64_t n = 0;
    for (const auto& [op, count] : ops(name)) {
      if (is_copy(op)) n += count;
    }
    return n;
  }
  static bool is_copy(const std::string& op) {
    static const char* const kCopies[] = {"aten::copy_",      "aten::_foreach_copy_", "aten::cat",
                                          "aten::_chunk_cat", "aten::_to_copy",       "aten::split_with_sizes_copy",
                                          "aten::clone",      "aten::zero_",          "aten::fill_"};
    for (const char* c : kCopies) {
      if (op == c) return true;
    }
    return false;
  }
  // Every range seen, one line each (describe's).
  std::string describe_all() const {
    std::vector<std::string> names;
    {
      std::lock_guard<std::mutex> lock(state().mu);
      for (const auto& [name, count] : state().ranges) names.push_back(name);
    }
    std::string s;
    for (const auto& name : names) s += describe(name) + "\n";
    return s;
  }
  // "op: count, ..." of a range, for failure messages.
  std::string describe(const std::string& name) const {
    std::string s = name + " ran " + std::to_string(ranges(name)) + " times and issued:";
    for (const auto& [op, count] : ops(name)) s += " " + op + " x" + std::to_string(count);
    return s;
  }

 private:
  struct Open {
    std::string range;
    int depth = 0;  // the operator depth when the range opened
  };
  struct PerThread {
    std::vector<Open> open;
    int depth = 0;
  };
  struct State {
    std::mutex mu;
    bool on = false;
    std::map<std::string, std::map<std::string, int64_t>> ops;
    std::map<std::string, int64_t> ranges;
  };
  static State& state() {
    static State* s = new State();  // never destroyed: a callback may still run at exit
    return *s;
  }
  static PerThread& here() {
    thread_local PerThread t;
    return t;
  }
  static std::string base_name(const char* name) {
    std::string s = name ? name : "";
    const auto paren = s.find(" (");
    return paren == std::string::npos ? s : s.substr(0, paren);
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    PerThread& t = here();
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      std::string name = base_name(fn.name());
      if (name.rfind("fsdp::", 0) != 0) return nullptr;
      {
        std::lock_guard<std::mutex> lock(state().mu);
        if (state().on) ++state().ranges[name];
      }
      t.open.push_back({std::move(name), t.depth});
      return nullptr;
    }
    if (!t.open.empty() && t.depth == t.open.back().depth) {
      std::lock_guard<std::mutex> lock(state().mu);
      if (state().on) ++state().ops[t.open.back().range][fn.name() ? fn.name() : "?"];
    }
    ++t.depth;
    return nullptr;
  }
  static void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
    PerThread& t = here();
    if (fn.scope() == at::RecordScope::USER_SCOPE) {
      if (!t.open.empty() && base_name(fn.name()) == t.open.back().range) t.open.pop_back();
      return;
    }
    if (t.depth > 0) --t.depth;
  }

  at::CallbackHandle handle_{};
};

// [Note: one copy kernel per unit], checked on what `counter` saw over whole training steps: every
// unit was gathered and reduced (at least `units` of each), every copy-out issued exactly one copy,
// split_with_sizes_copy; with `copy_in_from_buffer` every copy-in one copy_ of the unit's shard
// buffer and no other operator ([Note: the shards in one buffer]: no per-parameter slice), and
// with `fused_reduce_input` every reduce-scatter input one _chunk_cat. Throws naming the range and
// what it issued.
inline void check_one_copy_op_per_unit(const RangeOpCounter& counter, int64_t units, bool copy_in_from_buffer,
                                       bool fused_reduce_input) {
  const auto one_op_each = [&](const std::string& range, const std::string& op, int64_t runs) {
    TORCH_CHECK(counter.ops(range)[op] == runs && counter.copies(range) == runs, range, ": one ", op,
                " per unit expected; ", counter.describe(range));
  };
  const int64_t gathers = counter.ranges("fsdp::copy_out"), reduces = counter.ranges("fsdp::reduce_scatter_input");
  TORCH_CHECK(gathers >= units && reduces >= units, "expected every unit gathered and reduced; ",
              counter.describe("fsdp::copy_out"), "; ", counter.describe("fsdp::reduce_scatter_input"));
  TORCH_CHECK(counter.ranges("fsdp::copy_in") == gathers, "a copy-in per all-gather expected; ",
              counter.describe("fsdp::copy_in"));
  one_op_each("fsdp::copy_out", "aten::split_with_sizes_copy", gathers);
  if (copy_in_from_buffer) {
    one_op_each("fsdp::copy_in", "aten::copy_", gathers);
    int64_t ops = 0;
    for (const auto& [op, count] : counter.ops("fsdp::copy_in")) ops += count;
    TORCH_CHECK(ops == gathers, "fsdp::copy_in: one operator per unit expected (no per-parameter slice); ",
                counter.describe("fsdp::copy_in"));
  }
  if (fused_reduce_input) one_op_each("fsdp::reduce_scatter_input", "aten::_chunk_cat", reduces);
}

}  // namespace fsdp::testing

namespace fsdp::testing {

// The ATen operators FSDP issues per phase and unit of a training step, counted by context rather
// than by FSDP's own ranges (which do not cover its whole hooks): the test marks where its code is
// with USER_SCOPE ranges (fsdp::profiler::Range) and this counter attributes every operator that no
// other operator encloses:
//   "test::call (U)"   around fsdp::call(U, ...) (the root's call included)
//   "test::body (U)"   around the body of U's forward (inside forward())
//   "test::backward"   around loss.backward(); PhaseOpCounter::enter_final_callbacks() from an
//                      engine callback queued before FSDP's (a hook on the loss) marks the rest of
//                      the backward as the final callback
// An operator inside "test::call (U)" but outside its body is FSDP's: pre_forward before the body
// ran, post_forward after. In backward, one outside every autograd node after the test's hook on
// U's output called enter_pre_backward_hook(U) (FSDP's pre-backward hook runs next) is
// pre_backward, one directly inside FSDP's "fsdp::PostBackward" node post_backward, and after
// enter_final_callbacks() final_callback. Module compute (inside a body or an autograd node) is
// not FSDP's. The unit is the innermost FSDP range's label ("fsdp::copy_in (layers.1)", a prefetch
// of layers.1 inside layers.0's hook counts for layers.1), else the hook's unit ("?" in backward's
// unlabeled work). An unlabeled operator in the root's pre-forward is phase "root_pre_forward".
// "autograd::engine::evaluate_function: X" (an operator-scope record around each node and its
// hooks) is no operator here. Records are matched by handle: c10d's work records may end out of
// order or on another thread.
class PhaseOpCounter {
 public:
  // phase -> unit -> operator -> count
  using Counts = std::map<std::string, std::map<std::string, std::map<std::string, int64_t>>>;

  PhaseOpCounter() {
    auto cb = at::RecordFunctionCallback(&on_start, &on_end)
                  .needsInputs(false)
                  .needsIds(true)
                  .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION, at::RecordScope::USER_SCOPE});
    reset();
    handle_ = at::addGlobalCallback(std::move(cb));
  }
  ~PhaseOpCounter() {
    at::removeCallback(handle_);
    std::lock_guard<std::mutex> lock(state().mu);
    state().on = false;
  }
  PhaseOpCounter(const PhaseOpCounter&) = delete;
  PhaseOpCounter& operator=(const PhaseOpCounter&) = delete;

  // Forgets what was counted (after the warm-up steps) and counts from here.
  void reset() {
    std::lock_guard<std::mutex> lock(state().mu);
    state().counts.clear();
    state().on = true;
  }
  Counts counts() const {
    std::lock_guard<std::mutex> lock(state().mu);
    return state().counts;
  }
  // The rest of this thread's backward (until "test::backward" ends) is the final callback.
  static void enter_final_callbacks() { here().final_callbacks = true; }
  // From a hook the test put on unit U's output before FSDP did (so it runs just before FSDP's
  // pre-backward hook on the same node): until that node's backward starts, what runs outside
  // every node is U's pre_backward. Elsewhere in backward, outside nodes, the engine's own work
  // (the first gradient, sums of gradients, reductions to an input's shape) is not FSDP's.
  static void enter_pre_backward_hook(std::string unit) { here().hook_unit = std::move(unit); }
  // The records open on this thread (0 between steps: every start was matched by its end).
  static size_t open_records() { return here().frames.size(); }

 private:
  enum class Kind { Op, Transparent, FsdpRange, Call, Body, Backward, Node, PostBackwardNode, Other };
  struct Frame {
    Kind kind;
    std::string unit;
    bool body_done = false;
    at::RecordFunctionHandle handle = 0;
  };
  struct PerThread {
    std::vector<Frame> frames;
    bool final_callbacks = false;
    std::string hook_unit;  // enter_pre_backward_hook's, until the next node starts
  };
  struct State {
    std::mutex mu;
    bool on = false;
    Counts counts;
  };
  static State& state() {
    static State* s = new State();  // never destroyed: a callback may still run at exit
    return *s;
  }
  static PerThread& here() {
    thread_local PerThread t;
    return t;
  }
  // "name (label)" -> label ("" without one).
  static std::string label_of(const std::string& name) {
    const auto open = name.find(" (");
    if (open == std::string::npos || name.back() != ')') return "";
    return name.substr(open + 2, name.size() - open - 3);
  }
  static Frame classify(const at::RecordFunction& fn) {
    const std::string name = fn.name() ? fn.name() : "";
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
      return {name == "fsdp::PostBackward" ? Kind::PostBackwardNode : Kind::Node, ""};
    }
    if (fn.scope() == at::RecordScope::FUNCTION) {
      return {name.rfind("autograd::engine::evaluate_function", 0) == 0 ? Kind::Transparent : Kind::Op, ""};
    }
    if (name.rfind("fsdp::", 0) == 0) return {Kind::FsdpRange, label_of(name)};
    if (name.rfind("test::call (", 0) == 0) return {Kind::Call, label_of(name)};
    if (name.rfind("test::body (", 0) == 0) return {Kind::Body, label_of(name)};
    if (name == "test::backward") return {Kind::Backward, ""};
    return {Kind::Other, ""};
  }
  // The phase and unit of an operator that starts with `t.frames` open; phase "" when not FSDP's.
  static std::pair<std::string, std::string> attribute(const PerThread& t) {
    std::string label;
    for (auto it = t.frames.rbegin(); it != t.frames.rend(); ++it) {
      switch (it->kind) {
        case Kind::Op: return {"", ""};  // nested in another operator
        case Kind::FsdpRange:
          if (label.empty()) label = it->unit;
          break;
        case Kind::Call: {
          if (it->body_done) return {"post_forward", label.empty() ? it->unit : label};
          if (label.empty() && it->unit == "root") return {"root_pre_forward", "root"};
          return {"pre_forward", label.empty() ? it->unit : label};
        }
        case Kind::PostBackwardNode: return {"post_backward", label.empty() ? "?" : label};
        case Kind::Backward:
          if (t.final_callbacks) return {"final_callback", label.empty() ? "?" : label};
          if (t.hook_unit.empty()) return {"", ""};  // the engine's
          return {"pre_backward", label.empty() ? t.hook_unit : label};
        case Kind::Body:
        case Kind::Node: return {"", ""};  // the module's own compute
        case Kind::Transparent:
        case Kind::Other: break;
      }
    }
    return {"", ""};
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    PerThread& t = here();
    Frame f = classify(fn);
    // Not kept: another scope (c10d's "gloo:all_gather" of a collective's work may end on Gloo's
    // thread, or out of order) is no context here.
    if (f.kind == Kind::Other) return nullptr;
    if (f.kind == Kind::Node || f.kind == Kind::PostBackwardNode) t.hook_unit.clear();
    f.handle = fn.handle();
    if (f.kind == Kind::Op) {
      auto [phase, unit] = attribute(t);
      if (!phase.empty()) {
        std::lock_guard<std::mutex> lock(state().mu);
        if (state().on) ++state().counts[phase][unit][fn.name() ? fn.name() : "?"];
      }
    }
    t.frames.push_back(std::move(f));
    return nullptr;
  }
  // By the record's handle: a record may end out of order (a range held across calls).
  static void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
    PerThread& t = here();
    for (auto it = t.frames.rbegin(); it != t.frames.rend(); ++it) {
      if (it->handle != fn.handle()) continue;
      const Kind kind = it->kind;
      auto below = t.frames.erase(std::next(it).base());
      if (kind == Kind::Body && below != t.frames.begin() && std::prev(below)->kind == Kind::Call) {
        std::prev(below)->body_done = true;
      }
      if (kind == Kind::Backward) {
        t.final_callbacks = false;
        t.hook_unit.clear();
      }
      return;
    }
  }

  at::CallbackHandle handle_{};
};

// The top-level ATen operators (scope FUNCTION, not inside another operator) of every thread, by
// name, counted while one lives.
class TopLevelOps {
 public:
  TopLevelOps() {
    std::lock_guard<std::mutex> lock(mu());
    counts().clear();
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_start, &on_end).needsInputs(false).scopes({at::RecordScope::FUNCTION}));
  }
  ~TopLevelOps() { at::removeCallback(handle_); }
  std::map<std::string, int64_t> ops() const {
    std::lock_guard<std::mutex> lock(mu());
    return counts();
  }

 private:
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static std::map<std::string, int64_t>& counts() {
    static std::map<std::string, int64_t> c;
    return c;
  }
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (depth()++ == 0) {
      std::lock_guard<std::mutex> lock(mu());
      ++counts()[fn.name() ? fn.name() : "?"];
    }
    return nullptr;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext*) { --depth(); }
  at::CallbackHandle handle_;
};

}  // namespace fsdp::testing
