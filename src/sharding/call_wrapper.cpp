// fsdp::call's extension points (see fsdp/sharding/call.h): per-module call wrappers, and the
// thread's activation-checkpointing recompute flag.
#include <mutex>
#include <unordered_map>

#include "fsdp/sharding/call.h"

namespace fsdp::detail {

namespace {
struct WrapperEntry {
  std::weak_ptr<torch::nn::Module> module;  // a dead module's address may be reused: check it
  std::shared_ptr<const CallWrapper> wrapper;
};
std::mutex g_mu;
std::unordered_map<const torch::nn::Module*, WrapperEntry>& wrappers() {
  static std::unordered_map<const torch::nn::Module*, WrapperEntry> map;
  return map;
}
thread_local int t_recompute_depth = 0;
}  // namespace

void set_call_wrapper(const std::shared_ptr<torch::nn::Module>& module, CallWrapper wrapper) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& map = wrappers();
  for (auto it = map.begin(); it != map.end();) {  // drop entries of destroyed modules
    it = it->second.module.expired() ? map.erase(it) : std::next(it);
  }
  if (!wrapper) {
    map.erase(module.get());
    return;
  }
  map[module.get()] = WrapperEntry{module, std::make_shared<const CallWrapper>(std::move(wrapper))};
}

std::shared_ptr<const CallWrapper> find_call_wrapper(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& map = wrappers();
  if (map.empty()) return nullptr;
  auto it = map.find(module);
  if (it == map.end()) return nullptr;
  auto alive = it->second.module.lock();
  if (!alive || alive.get() != module) return nullptr;
  return it->second.wrapper;
}

bool in_recompute() { return t_recompute_depth > 0; }
RecomputeScope::RecomputeScope() { ++t_recompute_depth; }
RecomputeScope::~RecomputeScope() { --t_recompute_depth; }

}  // namespace fsdp::detail
