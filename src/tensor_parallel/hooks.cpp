#include "fsdp/tensor_parallel/hooks.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace fsdp::tp::detail {

namespace {
struct Entry {
  std::weak_ptr<torch::nn::Module> module;  // a dead module's address may be reused: check it
  std::shared_ptr<const std::vector<ModuleHooks>> hooks;
};
std::mutex g_mu;
std::atomic<bool> g_any{false};
std::unordered_map<const torch::nn::Module*, Entry>& entries() {
  static std::unordered_map<const torch::nn::Module*, Entry> map;
  return map;
}
}  // namespace

void add_module_hooks(const std::shared_ptr<torch::nn::Module>& module, ModuleHooks hooks) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& map = entries();
  for (auto it = map.begin(); it != map.end();) it = it->second.module.expired() ? map.erase(it) : std::next(it);
  auto& entry = map[module.get()];
  auto list = entry.hooks && !entry.module.expired() ? std::make_shared<std::vector<ModuleHooks>>(*entry.hooks)
                                                     : std::make_shared<std::vector<ModuleHooks>>();
  list->push_back(std::move(hooks));
  entry = Entry{module, std::move(list)};
  g_any.store(true);
}

std::shared_ptr<const std::vector<ModuleHooks>> find_module_hooks(const torch::nn::Module* module) {
  if (!g_any.load(std::memory_order_relaxed)) return nullptr;
  std::lock_guard<std::mutex> lock(g_mu);
  auto& map = entries();
  auto it = map.find(module);
  if (it == map.end()) return nullptr;
  auto alive = it->second.module.lock();
  if (!alive || alive.get() != module) return nullptr;
  return it->second.hooks;
}

std::vector<at::Tensor> run_input_hooks(const std::vector<ModuleHooks>& hooks, std::vector<at::Tensor> args) {
  for (const auto& h : hooks) {
    if (h.input) args = h.input(std::move(args));
  }
  return args;
}

void run_output_hooks(const std::vector<ModuleHooks>& hooks, std::vector<at::Tensor>& outputs) {
  for (const auto& h : hooks) {
    if (h.output) h.output(outputs);
  }
}

}  // namespace fsdp::tp::detail
