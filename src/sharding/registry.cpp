#include "registry.h"

#include <mutex>
#include <unordered_map>

#include "fsdp_param.h"
#include "fsdp_state.h"
#include "reducer.h"

namespace fsdp::detail {

namespace {

struct StateEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<FSDPState> state;
};

struct ParamEntry {
  FSDPParam* param;
  FSDPState* owner;
};

std::mutex g_mu;
// Destroyed in reverse order at exit: g_states first, whose FSDPStates unregister from the others.
std::unordered_map<const c10::TensorImpl*, ParamEntry> g_shards;
std::unordered_map<const c10::TensorImpl*, ParamEntry> g_unsharded;
std::unordered_map<const torch::nn::Module*, StateEntry> g_states;

struct ReplicatedEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<Reducer> reducer;
};
std::unordered_map<const torch::nn::Module*, ReplicatedEntry> g_replicated;

}  // namespace

void register_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                    const std::shared_ptr<FSDPState>& state) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (const auto& m : modules) g_states[m.get()] = StateEntry{m, state};
}

std::shared_ptr<FSDPState> lookup_state(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_states.find(module);
  if (it == g_states.end()) return nullptr;
  auto alive = it->second.module.lock();
  if (!alive || alive.get() != module) return nullptr;
  return it->second.state;
}

void purge_dead_states() {
  std::vector<std::shared_ptr<FSDPState>> dead;  // destroyed outside the lock (they unregister)
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto it = g_states.begin(); it != g_states.end();) {
      if (it->second.module.expired()) {
        dead.push_back(std::move(it->second.state));
        it = g_states.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void register_param(FSDPParam* param, FSDPState* owner) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_shards[param->sharded_param().unsafeGetTensorImpl()] = ParamEntry{param, owner};
  g_unsharded[param->unsharded_param().unsafeGetTensorImpl()] = ParamEntry{param, owner};
}

void unregister_params_of(const FSDPState* owner) {
  std::lock_guard<std::mutex> lock(g_mu);
  for (auto* map : {&g_shards, &g_unsharded}) {
    for (auto it = map->begin(); it != map->end();) {
      it = it->second.owner == owner ? map->erase(it) : std::next(it);
    }
  }
}

void rekey_shard(const c10::TensorImpl* old_shard, FSDPParam* param) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_shards.find(old_shard);
  if (it == g_shards.end()) return;
  ParamEntry entry = it->second;
  g_shards.erase(it);
  g_shards[param->sharded_param().unsafeGetTensorImpl()] = entry;
}

FSDPParam* param_of_shard(const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_shards.find(tensor.unsafeGetTensorImpl());
  return it == g_shards.end() ? nullptr : it->second.param;
}

FSDPState* owner_of_unsharded(const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_unsharded.find(tensor.unsafeGetTensorImpl());
  return it == g_unsharded.end() ? nullptr : it->second.owner;
}

FSDPParam* param_of_unsharded(const at::Tensor& tensor) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_unsharded.find(tensor.unsafeGetTensorImpl());
  return it == g_unsharded.end() ? nullptr : it->second.param;
}

void register_replicated(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<Reducer>& reducer) {
  std::lock_guard<std::mutex> lock(g_mu);
  // Drop destroyed modules' reducers (a Reducer does not call back into the registry).
  for (auto it = g_replicated.begin(); it != g_replicated.end();) {
    it = it->second.module.expired() ? g_replicated.erase(it) : std::next(it);
  }
  g_replicated[module.get()] = ReplicatedEntry{module, reducer};
}

std::shared_ptr<Reducer> lookup_replicated(const torch::nn::Module* module) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_replicated.find(module);
  if (it == g_replicated.end()) return nullptr;
  auto alive = it->second.module.lock();
  if (!alive || alive.get() != module) return nullptr;
  return it->second.reducer;
}

bool is_replicated(const torch::nn::Module* module) { return lookup_replicated(module) != nullptr; }

}  // namespace fsdp::detail
