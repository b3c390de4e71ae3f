#include "fsdp/sharding/replicate.h"

#include <torch/torch.h>

#include <stdexcept>
#include <unordered_set>

#include "fsdp/dist/runtime.h"
#include "reducer.h"
#include "registry.h"

namespace fsdp {

ReplicateModule replicate(const std::shared_ptr<torch::nn::Module>& module, ReplicateOptions options) {
  using namespace detail;
  if (!module) throw std::invalid_argument("fsdp::replicate: the module is null");
  if (options.bucket_cap_bytes < 1 || options.first_bucket_cap_bytes < 1) {
    throw std::invalid_argument(
        "fsdp::replicate: bucket_cap_bytes and first_bucket_cap_bytes must be positive "
        "(DDP's defaults: 25 MiB and 1 MiB)");
  }
  for (const auto& sub : module->modules(/*include_self=*/true)) {
    if (is_replicated(sub.get())) {
      throw std::invalid_argument("fsdp::replicate: module " + sub->name() +
                                  " is already replicated; call replicate once, on the root");
    }
    if (lookup_state(sub.get())) {
      throw std::invalid_argument("fsdp::replicate: module " + sub->name() +
                                  " is sharded by fully_shard; a module is either replicated or sharded (for both, "
                                  "use fully_shard on a 2-D mesh: HSDP)");
    }
  }
  if (!dist::is_initialized()) dist::init_distributed();
  std::shared_ptr<comm::Comm> comm = dist::world_comm();
  if (options.mesh) {
    if (options.mesh->ndim() != 1) {
      throw std::invalid_argument(
          "fsdp::replicate: a " + std::to_string(options.mesh->ndim()) + "-D mesh (" + options.mesh->to_string() +
          "); replicate takes the 1-D mesh of the data-parallel ranks, e.g. mesh[\"replicate\"]");
    }
    comm = options.mesh->comm(0);
  }
  std::vector<at::Tensor> params;
  {
    // DDP's start: every replica begins from rank 0's parameters and buffers.
    torch::NoGradGuard no_grad;
    std::unordered_set<const c10::TensorImpl*> seen;  // tied weights are listed once per owner
    for (const auto& p : module->parameters()) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      comm->broadcast(p.detach(), 0);
      if (p.requires_grad()) params.push_back(p);
    }
    for (const auto& b : module->buffers()) comm->broadcast(b.detach(), 0);
  }
  auto reducer =
      std::make_shared<Reducer>(std::move(params), comm, options.bucket_cap_bytes, options.first_bucket_cap_bytes);
  reducer->install_hooks();
  // Every submodule too: fully_shard on a part of a replicated model is refused.
  for (const auto& sub : module->modules(/*include_self=*/true)) register_replicated(sub, reducer);
  return detail::make_replicate_module(reducer);
}

ReplicateModule detail::make_replicate_module(std::shared_ptr<Reducer> reducer) {
  return ReplicateModule(std::move(reducer));
}

std::optional<ReplicateModule> replicate_module(const torch::nn::Module& module) {
  auto r = detail::lookup_replicated(&module);
  if (!r) return std::nullopt;
  return detail::make_replicate_module(r);
}

void ReplicateModule::set_requires_gradient_sync(bool requires_sync) {
  reducer_->requires_gradient_sync = requires_sync;
}

size_t ReplicateModule::num_buckets() const { return reducer_->num_buckets(); }

}  // namespace fsdp
