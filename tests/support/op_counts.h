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
