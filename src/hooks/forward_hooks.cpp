// The module-hook registry (see [Note: one hook mechanism for fsdp::call] in
// fsdp/hooks/forward_hooks.h): forward hooks and call wrappers, keyed by module.
#include "fsdp/hooks/forward_hooks.h"
#include "fsdp/detail/hooks.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <unordered_map>

namespace fsdp::hooks {

using detail::CallWrapper;

namespace {

template <typename T>
struct Entry {
  std::weak_ptr<torch::nn::Module> module;  // a dead module's address may be reused: check it
  std::shared_ptr<const T> value;
};

template <typename T>
struct Registry {
  std::mutex mu;
  std::atomic<bool> any{false};  // lets a program without hooks skip the lock on every call
  std::unordered_map<const torch::nn::Module*, Entry<T>> map;

  void drop_dead() {  // under mu
    for (auto it = map.begin(); it != map.end();) it = it->second.module.expired() ? map.erase(it) : std::next(it);
  }

  std::shared_ptr<const T> find(const torch::nn::Module* module) {
    if (!any.load(std::memory_order_relaxed)) return nullptr;
    std::lock_guard<std::mutex> lock(mu);
    auto it = map.find(module);
    if (it == map.end()) return nullptr;
    auto alive = it->second.module.lock();
    if (!alive || alive.get() != module) return nullptr;
    return it->second.value;
  }
};

Registry<HookList>& hook_registry() {
  static Registry<HookList> r;
  return r;
}

Registry<CallWrapper>& wrapper_registry() {
  static Registry<CallWrapper> r;
  return r;
}

}  // namespace

void register_forward_hooks(const std::shared_ptr<torch::nn::Module>& module, ForwardHooks hooks) {
  auto& r = hook_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.drop_dead();
  auto& entry = r.map[module.get()];
  auto list =
      entry.value && !entry.module.expired() ? std::make_shared<HookList>(*entry.value) : std::make_shared<HookList>();
  // After every hook of the same or a lower order: registration order within an order.
  auto at = std::upper_bound(list->begin(), list->end(), hooks.order, [](HookOrder o, const ForwardHooks& h) {
    return static_cast<int>(o) < static_cast<int>(h.order);
  });
  list->insert(at, std::move(hooks));
  entry = Entry<HookList>{module, std::move(list)};
  r.any.store(true);
}

std::shared_ptr<const HookList> detail::find_forward_hooks(const torch::nn::Module* module) {
  return hook_registry().find(module);
}

void remove_forward_hooks(const torch::nn::Module* module, HookOrder order) {
  auto& r = hook_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.map.find(module);
  if (it == r.map.end() || !it->second.value) return;
  auto list = std::make_shared<HookList>(*it->second.value);
  list->erase(std::remove_if(list->begin(), list->end(), [&](const ForwardHooks& h) { return h.order == order; }),
              list->end());
  it->second.value = std::move(list);
}

void detail::set_call_wrapper(const std::shared_ptr<torch::nn::Module>& module, CallWrapper wrapper) {
  auto& r = wrapper_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.drop_dead();
  if (!wrapper) {
    r.map.erase(module.get());
    return;
  }
  r.map[module.get()] = Entry<CallWrapper>{module, std::make_shared<const CallWrapper>(std::move(wrapper))};
  r.any.store(true);
}

std::shared_ptr<const CallWrapper> detail::find_call_wrapper(const torch::nn::Module* module) {
  return wrapper_registry().find(module);
}

namespace detail {

std::vector<at::Tensor> run_pre(const HookList& hooks, std::vector<at::Tensor> args) {
  size_t ran = 0;
  try {
    for (; ran < hooks.size(); ++ran) {
      if (hooks[ran].pre) args = hooks[ran].pre(std::move(args));
    }
  } catch (...) {
    for (size_t i = ran; i-- > 0;) {  // the hook that threw cleans up after itself
      if (hooks[i].abort) hooks[i].abort();
    }
    throw;
  }
  return args;
}

void run_post(const HookList& hooks, std::vector<at::Tensor>& outputs) {
  for (const auto& h : hooks) {
    if (h.post) h.post(outputs);
  }
}

void run_abort(const HookList& hooks) noexcept {
  for (size_t i = hooks.size(); i-- > 0;) {
    if (hooks[i].abort) hooks[i].abort();
  }
}

}  // namespace detail
}  // namespace fsdp::hooks
