#pragma once
// fully_shard: FSDP2 for LibTorch modules.
//
// Example:
//   GPT model(config);
//   for (auto& block : model->blocks) fsdp::fully_shard(block);   // bottom-up: blocks first,
//   fsdp::fully_shard(model);                                      // then the root
//   torch::optim::AdamW opt(model->parameters(), 1e-3);            // the local shards
//   auto logits = fsdp::call(model, tokens);                       // not model(tokens)
//   fsdp::check_optimizer_params(opt);                             // built after fully_shard?
//
// C++ modules have no forward hooks, so a sharded unit is entered through fsdp::call(unit, args...)
// (see call.h): inside the model, `x = fsdp::call(block, x)` instead of `x = block(x)`. Unsharded
// models run the same code (call() then just calls forward), so one model source serves both.
//
// After fully_shard, module->parameters() / named_parameters() return this rank's shards (same
// names); the module's own fields (e.g. LinearImpl::weight) are the unsharded parameters that
// forward uses. Between forwards they are freed (zero elements): calling forward directly, around
// fsdp::call, fails with a shape error instead of reading freed memory.
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "fsdp/mesh/device_mesh.h"
#include "fsdp/sharding/custom_collectives.h"
#include "fsdp/sharding/policies.h"
#include "fsdp/tensor_parallel/placement.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp {

class FSDPModule;
namespace detail {
class FSDPState;
// The library's own access to a handle's state and construction of handles (src/sharding); not
// for users.
FSDPState* state_of(const FSDPModule& module);
FSDPModule make_fsdp_module(std::shared_ptr<FSDPState> state);
}  // namespace detail

// Example:
//   fsdp::FullyShardOptions opts;
//   opts.mesh = fsdp::init_device_mesh({2, 4}, {"replicate", "shard"});   // HSDP: 2 replicas of 4
//   opts.reshard_after_forward = 2;               // after forward keep 1/2 of each parameter
//   opts.mp_policy.param_dtype = at::kBFloat16;   // policies.h
//   opts.shard_placement_fn = [](const std::string& name, const at::Tensor& p) -> std::optional<int64_t> {
//     return name.find("experts") != std::string::npos ? std::optional<int64_t>(1) : std::nullopt;
//   };                                            // experts along dim 1, the rest along dim 0
//   fsdp::fully_shard(block, opts);
struct FullyShardOptions {
  // The data-parallel ranks (default: all ranks of the runtime, 1-D).
  //   1-D mesh: FSDP, parameters sharded over every rank of the mesh.
  //   2-D mesh: HSDP, init_device_mesh({R, S}, {"replicate", "shard"}): dim 0 replicates, dim 1
  //   shards (FSDP2's order). All-gather and reduce-scatter run within the S ranks of the shard
  //   group, then the sharded gradients are all-reduced over the R replicas.
  //   FSDP + TP: the data-parallel part of a mesh with a "tp" dimension, mesh["dp"] (or
  //   mesh[{"replicate", "shard"}]), after tp::parallelize_module over mesh["tp"].
  std::optional<DeviceMesh> mesh;
  // Free the unsharded parameters after forward and re-gather them for backward.
  //   true / false: free them all / keep them (ZeRO-3 / ZeRO-2-like).
  //   int k: keep a 1/k slice after forward, so the backward all-gather runs within a group of k
  //   consecutive ranks of the shard group (ZeRO++ hpZ). k must divide the shard size; 1 behaves
  //   as false, the shard size as true.
  // Unset: true for every unit but the root, false for the root (decided at the first forward).
  std::optional<std::variant<bool, int>> reshard_after_forward;
  MixedPrecisionPolicy mp_policy;
  std::optional<CPUOffloadPolicy> offload_policy;
  // Left unsharded and unreduced (e.g. parameters another mechanism handles).
  std::vector<at::Tensor> ignored_params;
  // FSDP2's shard_placement_fn: the dim each parameter is split along over the shard group, given
  // its name (relative to the module sharded) and the parameter; nullopt (or no function): dim 0.
  // E.g. MoE experts [E, dim, hidden] with fewer experts E than ranks, along dim 1. Negative dims
  // count from the end; uneven sizes are padded as dim 0's are. The sharded parameter is then
  // [.., its part of dim d, ..] (a view with permuted strides, not contiguous), and
  // fsdp::shard_info names the dim (ShardInfo::shard_dim); checkpoints reshard between any dims.
  // (The Example above.)
  std::function<std::optional<int64_t>(const std::string& name, const at::Tensor& param)> shard_placement_fn;
};

// Waits for an asynchronous unshard().
class UnshardHandle {
 public:
  UnshardHandle() = default;
  void wait();

 private:
  friend class FSDPModule;
  explicit UnshardHandle(detail::FSDPState* state) : state_(state) {}
  detail::FSDPState* state_ = nullptr;
};

// The handle fully_shard returns: FSDP2's FSDPModule methods. Copyable; the state lives as long as
// the module (fully_shard keeps it in a registry keyed by the module).
class FSDPModule {
 public:
  // All-gather this unit's parameters (not its children's). pre-forward waits for it.
  UnshardHandle unshard(bool async_op = false);
  // Free the unsharded parameters (not the children's).
  void reshard();
  // false: skip the gradient reduce-scatter and accumulate unsharded gradients locally; the next
  // synced backward reduces the sum (FSDP1's no_sync).
  void set_requires_gradient_sync(bool requires_sync, bool recurse = true);
  // HSDP: false skips the all-reduce over the replicas (the reduce-scatter still runs and its
  // output accumulates); the next backward with it on all-reduces the sum. No effect on 1-D meshes.
  void set_requires_all_reduce(bool requires_all_reduce, bool recurse = true);
  void set_reshard_after_forward(bool reshard, bool recurse = true);
  // false: keep the parameters unsharded after backward (e.g. across micro-batches).
  void set_reshard_after_backward(bool reshard, bool recurse = true);
  // false: this unit's backward does not all-gather its parameters (FSDP2's, this unit only), for
  // units whose parameters backward never reads, such as embeddings: one all-gather a step saved.
  // Where backward does read one (a linear, a head tied to the embedding), backward fails with
  // LibTorch's error for a tensor without memory ("... out of bounds for storage of size 0" or
  // "... its data is not allocated yet"). From its forward to its backward the unit's parameters
  // keep their shapes over no memory (for the gradients autograd sets on them).
  //   fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{gpt->wte.ptr(), gpt->wpe.ptr()})
  //       .set_unshard_in_backward(false);
  void set_unshard_in_backward(bool unshard_in_backward);
  // false: the end of backward does not wait for the gradient reductions (micro-batching).
  void set_is_last_backward(bool is_last);
  // Explicit prefetch targets, replacing the implicit order recorded at the first forward.
  void set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules);
  void set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules);
  // GPU: the next forward's first all-gather (this module's, as the root) waits on `event`
  // instead of the whole current stream; record it right after optimizer.step() (FSDP2's
  // set_post_optim_event). Without one the all-gather waits on the current stream, which is also
  // correct. No effect on the CPU.
  //   auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
  //   event->record(c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device));
  //   fsdp::fsdp_module(*model)->set_post_optim_event(event);
  void set_post_optim_event(std::shared_ptr<c10::Event> event);
  // Gradients are divided by this instead of the data-parallel size (1.0: plain sum).
  void set_gradient_divide_factor(double factor);
  // FSDP2's set_force_sum_reduction_for_comms: this unit's reduce-scatter (and HSDP all-reduce) use
  // ReduceOp::Sum only, and the gradients are divided afterwards, where by default the collectives
  // average (NCCL's AVG). For transports without an average (zero-copy, custom collectives).
  void set_force_sum_reduction_for_comms(bool enable);
  // FSDP2's set_all_reduce_hook: `hook(reduce_output)` runs once per synced backward on this
  // unit's reduced gradients (not its children's), before they reach .grad: one flat tensor of this
  // rank's padded shard rows of the unit's parameters, in reduce_dtype, averaged over the shard
  // group (and under HSDP over the replicas too); what the hook writes into it in place becomes the
  // gradients. E.g. averaging over replicas that a process group of one's own connects:
  //   auto replicas = mesh.get_group("replicate");    // FSDP itself shards over mesh["shard"]
  //   fsdp::fsdp_module(*block)->set_all_reduce_hook(
  //       [replicas](const at::Tensor& g) { replicas->all_reduce(g, fsdp::comm::ReduceOp::Avg); });
  // On a GPU it runs on `stream` (default: FSDP's all-reduce stream; not under HSDP, where it follows
  // the all-reduce on that stream). An empty function removes it. [Note: the all-reduce hook] in
  // src/sharding/fsdp_param_group.cpp says where it runs.
  void set_all_reduce_hook(std::function<void(const at::Tensor&)> hook,
                           std::optional<c10::Stream> stream = std::nullopt);
  // FSDP2's set_custom_all_gather / set_custom_reduce_scatter: this unit's all-gathers or
  // reduce-scatters (not its children's) made by `comm` (custom_collectives.h); null: FSDP's own again.
  void set_custom_all_gather(std::shared_ptr<AllGather> comm);
  void set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm);

  std::vector<torch::nn::Module*> modules() const;

 private:
  friend detail::FSDPState* detail::state_of(const FSDPModule& module);
  friend FSDPModule detail::make_fsdp_module(std::shared_ptr<detail::FSDPState> state);
  explicit FSDPModule(std::shared_ptr<detail::FSDPState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::FSDPState> state_;
};

// Shards `module`'s parameters that no inner fully_shard call already manages.
FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options = {});
// Several modules, one group (one all-gather, one reduce-scatter), e.g. {norm, head}.
FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, FullyShardOptions options = {});
// ModuleHolder form: fully_shard(block) for `Block block` (a TORCH_MODULE holder).
template <typename Holder, typename = decltype(std::declval<Holder&>().ptr())>
FSDPModule fully_shard(Holder& module, FullyShardOptions options = {}) {
  return fully_shard(std::static_pointer_cast<torch::nn::Module>(module.ptr()), std::move(options));
}

// The FSDPModule of a module sharded by fully_shard, if any.
std::optional<FSDPModule> fsdp_module(const torch::nn::Module& module);

// Where a sharded parameter (an element of module->parameters()) sits in the full one. Under HSDP
// the rows are those of this rank's position in the shard group, and every replica holds the same
// rows: only replica_rank 0 needs to write them to a checkpoint, and every replica reads them back.
// Parameters under fsdp::replicate are not shards (shard_info returns nullopt).
// Rows are slices along shard_dim (0 unless FullyShardOptions::shard_placement_fn chose another).
struct ShardInfo {
  std::vector<int64_t> global_shape;  // the unsharded parameter's shape
  int64_t dim0_offset = 0;            // first row of the full parameter held here (along shard_dim)
  int64_t local_rows = 0;             // rows held here (0 for an empty shard)
  int64_t padded_rows = 0;            // rows per rank, ceil(rows / N), N the shard group's size
  std::string fqn;                    // name relative to the root module it was sharded under
  DeviceMesh mesh;                    // the 1-D mesh the parameter is sharded over (HSDP: its "shard" dim)
  int64_t replica_rank = 0;           // this rank's index along the replicate dimension (0 for FSDP)
  int64_t num_replicas = 1;           // size of the replicate dimension (1 for FSDP)
  // FSDP + TP: the parameter fully_shard took over was TP-local (parallelize_module ran first);
  // global_shape and dim0_offset above then describe the TP-local tensor, and `tp` where that
  // tensor sits in the full parameter. nullopt without tensor parallelism.
  std::optional<tp::TPPlacement> tp = std::nullopt;
  int64_t shard_dim = 0;  // the dim the rows are taken along
};
std::optional<ShardInfo> shard_info(const at::Tensor& sharded_param);

// FSDP2's debug checklist: throws when the optimizer holds parameters that are not the sharded
// ones (built before fully_shard), naming the first such parameter and the fix.
void check_optimizer_params(const torch::optim::Optimizer& optimizer);

}  // namespace fsdp
