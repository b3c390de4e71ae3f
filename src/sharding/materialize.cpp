#include "fsdp/sharding/materialize.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <functional>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/sharding/fully_shard.h"
#include "fsdp_param.h"
#include "registry.h"

namespace fsdp {

namespace {

// Turns a meta tensor into a real one on `device` without changing its identity: the module's
// fields, the registry and autograd keep pointing at the same tensor object.
void give_memory(const at::Tensor& t, at::IntArrayRef sizes, c10::Device device) {
  at::Tensor real = at::empty(sizes, t.options().device(device).requires_grad(false));
  t.unsafeGetTensorImpl()->shallow_copy_from(real.getIntrusivePtr());
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Calls fill(row_view, global_row) for each row this tensor holds of its full parameter.
void for_each_row(const at::Tensor& param, const std::function<void(at::Tensor, int64_t)>& fill) {
  if (param.device().is_meta()) {
    throw std::invalid_argument("fsdp::init: the parameter is on the meta device; call fsdp::to_empty first");
  }
  int64_t first = 0, rows = param.dim() == 0 ? 1 : param.size(0);
  if (auto info = shard_info(param)) {
    first = info->dim0_offset;
    rows = info->local_rows;
  }
  if (rows == 0) return;
  if (!param.is_contiguous()) throw std::invalid_argument("fsdp::init: the parameter must be contiguous");
  at::Tensor as_rows = param.detach().view({rows, -1});  // a view: filling rows fills the parameter
  for (int64_t r = 0; r < rows; ++r) fill(as_rows[r], first + r);
}

}  // namespace

void to_empty(torch::nn::Module& module, c10::Device device) {
  std::unordered_set<const c10::TensorImpl*> done;
  auto all = module.modules(/*include_self=*/true);
  for (const auto& m : all) {
    for (const auto& item : m->named_parameters(/*recurse=*/false)) {
      const at::Tensor& t = item.value();
      if (!done.insert(t.unsafeGetTensorImpl()).second) continue;
      if (detail::FSDPParam* p = detail::param_of_shard(t)) {
        if (!p->sharded_param().device().is_meta()) continue;
        done.insert(p->unsharded_param().unsafeGetTensorImpl());
        p->materialize(device);
      } else if (t.device().is_meta()) {
        give_memory(t, t.sizes(), device);
      }
    }
    for (const auto& item : m->named_buffers(/*recurse=*/false)) {
      const at::Tensor& t = item.value();
      if (t.device().is_meta() && done.insert(t.unsafeGetTensorImpl()).second) give_memory(t, t.sizes(), device);
    }
  }
}

namespace init {

uint64_t param_seed(uint64_t base_seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across runs and platforms
  for (unsigned char ch : name) h = (h ^ ch) * 1099511628211ull;
  return splitmix64(base_seed ^ h);
}

void normal_(const at::Tensor& param, double mean, double std, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for_each_row(param, [&](at::Tensor row, int64_t r) {
    auto gen = at::detail::createCPUGenerator(splitmix64(seed + static_cast<uint64_t>(r)));
    row.copy_(at::normal(mean, std, {row.numel()}, gen, row.options().dtype(at::kFloat).device(at::kCPU)));
  });
}

void uniform_(const at::Tensor& param, double low, double high, uint64_t seed) {
  torch::NoGradGuard no_grad;
  for_each_row(param, [&](at::Tensor row, int64_t r) {
    auto gen = at::detail::createCPUGenerator(splitmix64(seed + static_cast<uint64_t>(r)));
    at::Tensor values = at::empty({row.numel()}, row.options().dtype(at::kFloat).device(at::kCPU));
    values.uniform_(low, high, gen);
    row.copy_(values);
  });
}

void constant_(const at::Tensor& param, double value) {
  if (param.device().is_meta()) {
    throw std::invalid_argument("fsdp::init: the parameter is on the meta device; call fsdp::to_empty first");
  }
  torch::NoGradGuard no_grad;
  param.detach().fill_(value);
}

}  // namespace init
}  // namespace fsdp
