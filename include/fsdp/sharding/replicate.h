#pragma once
// replicate: data parallelism without sharding (DDP), the alternative FSDP2's recipe names for
// models that fit on one device.
//
// Example:
//   auto ddp = fsdp::replicate(model);                          // broadcasts rank 0's values
//   torch::optim::AdamW opt(model->parameters(), 1e-3);         // the ordinary full parameters
//   auto logits = fsdp::call(model, tokens);                    // or model->forward(tokens)
//   loss.backward();                                            // gradients averaged over ranks
//
// Every rank holds the whole model. During backward, gradients are all-reduced in buckets as soon
// as every gradient of a bucket is ready, so communication overlaps the rest of backward (DDP's
// reducer); the end of backward waits for them. Parameters are not sharded: shard_info() returns
// nullopt for them and a checkpoint saves them whole.
#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <optional>

#include "fsdp/mesh/device_mesh.h"

namespace fsdp {

class ReplicateModule;
namespace detail {
class Reducer;
ReplicateModule make_replicate_module(std::shared_ptr<Reducer> reducer);  // the library's; not for users
}  // namespace detail

// Example: ReplicateOptions o; o.bucket_cap_bytes = 50 << 20;   // DDP's bucket_cap_mb = 50
struct ReplicateOptions {
  // 1-D mesh of the data-parallel ranks (default: all ranks of the runtime).
  std::optional<DeviceMesh> mesh;
  // Gradients are all-reduced in buckets of about this many bytes (DDP's bucket_cap_mb, 25 MiB).
  int64_t bucket_cap_bytes = 25 * 1024 * 1024;
  // The first bucket (the last parameters, whose gradients come first) is smaller, so the first
  // all-reduce starts early in backward (DDP's 1 MiB; capped by bucket_cap_bytes).
  int64_t first_bucket_cap_bytes = 1024 * 1024;
};

// The handle replicate returns. Copyable; the state lives as long as the module.
class ReplicateModule {
 public:
  // false: backward leaves the local gradients to accumulate in .grad, without communication; the
  // next backward with sync on all-reduces the accumulated sum (DDP's no_sync).
  void set_requires_gradient_sync(bool requires_sync);
  // Number of gradient buckets (reverse parameter order, as DDP builds them).
  size_t num_buckets() const;

 private:
  friend ReplicateModule detail::make_replicate_module(std::shared_ptr<detail::Reducer> reducer);
  explicit ReplicateModule(std::shared_ptr<detail::Reducer> reducer) : reducer_(std::move(reducer)) {}
  std::shared_ptr<detail::Reducer> reducer_;
};

ReplicateModule replicate(const std::shared_ptr<torch::nn::Module>& module, ReplicateOptions options = {});
template <typename Holder, typename = decltype(std::declval<Holder&>().ptr())>
ReplicateModule replicate(Holder& module, ReplicateOptions options = {}) {
  return replicate(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(options));
}

// The ReplicateModule of a module passed to replicate, if any.
std::optional<ReplicateModule> replicate_module(const torch::nn::Module& module);

}  // namespace fsdp
