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

struct ReplicatedEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<Reducer> reducer;
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, ParamEntry> shards;
  std::unordered_map<const c10::TensorImpl*, ParamEntry> unsharded;
  std::unordered_map<const torch::nn::Module*, StateEntry> states;
  std::unordered_map<const torch::nn::Module*, ReplicatedEntry> replicated;
};

// Never destroyed. The states it holds may own CUDA events and tensors, and a static destroyed at
// exit runs after the CUDA runtime has unloaded (its exit handler is registered at CUDA's first
// use, after this library's statics are made): an FSDPParamGroup's event destroyed then aborts the
// process ("CUDA error: driver shutting down", seen on the first GPU run). States of destroyed
// modules are freed while the program runs (purge_dead_states); those alive at exit stay, as the
// process ends.
Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

}  // namespace

void register_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                    const std::shared_ptr<FSDPState>& state) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const auto& m : modules) r.states[m.get()] = StateEntry{m, state};
}

std::shared_ptr<FSDPState> lookup_state(const torch::nn::Module* module) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.states.find(module);
  if (it == r.states.end()) return nullptr;
  auto alive = it->second.module.lock();
  if (!alive || alive.get() != module) return nullptr;
  return it->second.state;
}

void purge_dead_states() {
  std::vector<std::shared_ptr<FSDPState>> dead;  // destroyed outside the lock (they unregister)
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto it = r.states.begin(); it != r.states.end();) {
      if (it->second.module.expired()) {
        dead.push_back(std::move(it->second.state));
        it = r.states.erase(it);
      } else {
        ++it;
      }
    }
  }
}

void register_param(FSDPParam* param, FSDPState* owner) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.shards[param->sharded_param().unsafeGetTensorImpl()] = ParamEntry{param, owner};
  r.unsharded[param->unsharded_param().unsafeGetTensorImpl()] = ParamEntry{param, owner};
}

void unregister_params_of(const FSDPState* owner) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto* map : {&r.shards, &r.unsharded}) {
    for (auto it = map->begin(); it != map->end();) {
      it = it->second.owner == owner ? map->erase(it) : std::next(it);
    }
  }
}

void rekey_shard(const c10::TensorImpl* old_shard, FSDPParam* param) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.shards.find(old_shard);
  if (it == r.shards.end()) return;
  ParamEntry entry = it->second;
  r.shards.erase(it);
  r.shards[param->sharded_param().unsafeGetTensorImpl()] = entry;
}

FSDPParam* param_of_shard(const at::Tensor& tensor) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.shards.find(tensor.unsafeGetTensorImpl());
  return it == r.shards.end() ? nullptr : it->second.param;
}

FSDPState* owner_of_unsharded(const at::Tensor& tensor) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.unsharded.find(tensor.unsafeGetTensorImpl());
  return it == r.unsharded.end() ? nullptr : it->second.owner;
}

FSDPParam* param_of_unsharded(const at::Tensor& tensor) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.unsharded.find(tensor.unsafeGetTensorImpl());
  return it == r.unsharded.end() ? nullptr : it->second.param;
}

void register_replicated(const std::shared_ptr<torch::nn::Module>& module, const std::shared_ptr<Reducer>& reducer) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  // Drop destroyed modules' reducers (a Reducer does not call back into the registry).
  for (auto it = r.replicated.begin(); it != r.replicated.end();) {
    it = it->second.module.expired() ? r.replicated.erase(it) : std::next(it);
  }
  r.replicated[module.get()] = ReplicatedEntry{module, reducer};
}

std::shared_ptr<Reducer> lookup_replicated(const torch::nn::Module* module) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.replicated.find(module);
  if (it == r.replicated.end()) return nullptr;
  auto alive = it->second.module.lock();
  if (!alive || alive.get() != module) return nullptr;
  return it->second.reducer;
}

bool is_replicated(const torch::nn::Module* module) { return lookup_replicated(module) != nullptr; }

}  // namespace fsdp::detail
