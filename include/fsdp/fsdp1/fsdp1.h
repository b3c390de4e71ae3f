#pragma once
// FSDP1's API (torch.distributed.fsdp.FullyShardedDataParallel) on top of fully_shard, for code
// written against it: a wrapper around the user's module, a ShardingStrategy, an auto-wrap policy
// that picks the units, no_sync(), summon_full_params() and state_dict_type(). FSDP1's flat
// parameters are not copied: every parameter stays its own tensor (use_orig_params=True in effect)
// and keeps its original name (no "_fsdp_wrapped_module." prefixes). See docs/fsdp1.md.
//
// Example:
//   fsdp::FSDPOptions o;
//   o.sharding_strategy = fsdp::ShardingStrategy::FULL_SHARD;
//   o.auto_wrap_policy = fsdp::transformer_auto_wrap_policy<BlockImpl>();   // each Block a unit
//   fsdp::FSDP fsdp_model(model, o);                  // fully_shard(blocks...), fully_shard(model)
//   torch::optim::AdamW opt(fsdp_model.parameters(), 1e-3);   // the shards, original names
//   auto logits = fsdp_model(tokens);                 // forward through the wrapper runs the hooks
//   fsdp_model.clip_grad_norm_(1.0);
//
// How each strategy maps onto this library (FSDP1's root never reshards after forward, as
// fully_shard's root does by default):
//   ShardingStrategy     | calls                        | reshard_after_forward | mesh
//   ---------------------+------------------------------+-----------------------+---------------------------
//   FULL_SHARD           | fully_shard per unit, root   | unset (units true,    | 1-D (default: every rank)
//                        |                              | root false)           |
//   SHARD_GRAD_OP        | fully_shard per unit, root   | false                 | 1-D
//   NO_SHARD             | replicate(root) (DDP: policy | -                     | 1-D
//                        | ignored, one unit)           |                       |
//   HYBRID_SHARD         | fully_shard per unit, root   | unset                 | 2-D {"replicate", "shard"}
//   HYBRID_SHARD_ZERO2   | fully_shard per unit, root   | false                 | 2-D {"replicate", "shard"}
// (HYBRID_SHARD_ZERO2 is PyTorch's _HYBRID_SHARD_ZERO2: C++ reserves names starting with _ and a
// capital.) The default 2-D mesh shards within a host and replicates across hosts, as FSDP1 does:
// {world_size / local_world_size, local_world_size}.
#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/mesh/device_mesh.h"
#include "fsdp/sharding/call.h"
#include "fsdp/sharding/fully_shard.h"
#include "fsdp/sharding/policies.h"
#include "fsdp/sharding/replicate.h"

namespace torch::optim {
class Optimizer;
}

namespace fsdp {

enum class ShardingStrategy { FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 };
// PyTorch's backward_prefetch=None is NONE. BACKWARD_POST is refused: fully_shard issues the
// backward prefetch at pre-backward (BACKWARD_PRE).
enum class BackwardPrefetch { BACKWARD_PRE, BACKWARD_POST, NONE };
enum class StateDictType { FULL_STATE_DICT, SHARDED_STATE_DICT };

// FSDP1's MixedPrecision, mapped onto MixedPrecisionPolicy. buffer_dtype and
// keep_low_precision_grads cannot be honoured (buffers keep their dtype; gradients land on the
// fp32 shards) and are refused in one line.
// Example: fsdp::MixedPrecision mp; mp.param_dtype = at::kBFloat16; mp.reduce_dtype = at::kFloat;
struct MixedPrecision {
  std::optional<at::ScalarType> param_dtype;
  std::optional<at::ScalarType> reduce_dtype;
  std::optional<at::ScalarType> buffer_dtype;  // refused when set
  bool keep_low_precision_grads = false;       // refused when true
  bool cast_forward_inputs = false;            // every unit but the root casts its inputs
  bool cast_root_forward_inputs = true;        // the root casts its inputs
};

// offload_params: every unit gets CPUOffloadPolicy (pinned host memory): the shards, their
// gradients and the optimizer step stay on the CPU, and each unit's shards are copied to the
// compute device for its all-gather. A model on the CPU is already there: nothing moves, and
// training is the same as without it. Refused with NO_SHARD.
// Example: fsdp::CPUOffload off; off.offload_params = true;   // CPUOffloadPolicy on every unit
struct CPUOffload {
  bool offload_params = false;
};

// FSDP1's auto-wrap policy callable: policy(module, recurse, nonwrapped_numel). With recurse true
// it says whether to descend into `module`'s children; with recurse false, whether `module`
// becomes a unit, nonwrapped_numel counting its parameters that no unit below it took.
using AutoWrapPolicy = std::function<bool(torch::nn::Module& module, bool recurse, int64_t nonwrapped_numel)>;
// A module type test (PyTorch's classes): module_type<BlockImpl>() is isinstance(m, Block).
using ModuleType = std::function<bool(const torch::nn::Module&)>;
template <typename Impl>
ModuleType module_type() {
  return [](const torch::nn::Module& m) { return dynamic_cast<const Impl*>(&m) != nullptr; };
}

// Wraps every module of one of the given types (PyTorch's ModuleWrapPolicy).
// Example: fsdp::FSDPOptions o; o.auto_wrap_policy = fsdp::ModuleWrapPolicy({fsdp::module_type<BlockImpl>()});
class ModuleWrapPolicy {
 public:
  explicit ModuleWrapPolicy(std::vector<ModuleType> module_classes) : classes_(std::move(module_classes)) {}
  bool operator()(torch::nn::Module& module, bool recurse, int64_t nonwrapped_numel) const;

 private:
  std::vector<ModuleType> classes_;
};

// functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}).
// Example: auto policy = fsdp::transformer_auto_wrap_policy({fsdp::module_type<BlockImpl>()});
AutoWrapPolicy transformer_auto_wrap_policy(std::vector<ModuleType> transformer_layer_cls);
template <typename... Impl>
AutoWrapPolicy transformer_auto_wrap_policy() {
  return transformer_auto_wrap_policy({module_type<Impl>()...});
}

// Wraps a module when the parameters no unit below it took number at least min_num_params, and
// descends only into modules that large. force_leaf_modules are neither descended into nor
// wrapped (their parameters count toward the parent); exclude_wrap_modules are descended into but
// never wrapped (default: ModuleList and ModuleDict, as PyTorch's).
// Example: auto policy = fsdp::size_based_auto_wrap_policy(100000);
AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params = 100000000,
                                           std::vector<ModuleType> force_leaf_modules = {},
                                           std::optional<std::vector<ModuleType>> exclude_wrap_modules = {});

// Wraps the modules for which lambda_fn returns true.
// Example:
//   auto is_mlp = [](torch::nn::Module& m) { return dynamic_cast<fsdp::models::MLPImpl*>(&m) != nullptr; };
//   auto policy = fsdp::lambda_auto_wrap_policy(is_mlp);
AutoWrapPolicy lambda_auto_wrap_policy(std::function<bool(torch::nn::Module&)> lambda_fn);

// Example:
//   fsdp::FSDPOptions o;
//   o.sharding_strategy = fsdp::ShardingStrategy::HYBRID_SHARD;
//   o.device_mesh = fsdp::init_device_mesh({2, 4}, {"replicate", "shard"});
//   o.mixed_precision = fsdp::MixedPrecision{.param_dtype = at::kBFloat16};
//   o.ignored_modules = {model->lm_head.ptr()};
struct FSDPOptions {
  ShardingStrategy sharding_strategy = ShardingStrategy::FULL_SHARD;
  // Empty: the root is the only unit.
  AutoWrapPolicy auto_wrap_policy;
  std::optional<MixedPrecision> mixed_precision;
  std::optional<CPUOffload> cpu_offload;
  // FSDP1's device_mesh / process_group: a 1-D mesh (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD) or a 2-D
  // {"replicate", "shard"} mesh (HYBRID_*). From process groups: DeviceMesh::from_group(s).
  // Unset: every rank (HYBRID_*: shard within a host, replicate across hosts).
  std::optional<DeviceMesh> device_mesh;
  // Accepted for source compatibility; parameters always stay the original tensors (true).
  bool use_orig_params = true;
  // true: the next unit's all-gather starts at a unit's pre-forward (fully_shard's implicit order);
  // false (FSDP1's default): no prefetch in forward.
  bool forward_prefetch = false;
  // Accepted; fully_shard always bounds the all-gathers in flight, whatever the value.
  bool limit_all_gathers = true;
  BackwardPrefetch backward_prefetch = BackwardPrefetch::BACKWARD_PRE;
  // Broadcast rank 0's parameters and buffers before sharding.
  bool sync_module_states = false;
  // Meta-device models: after sharding, every meta tensor gets memory on device_id (the CPU when
  // unset; a shard only for sharded parameters, fsdp::to_empty) and param_init_fn(root) runs
  // once to initialise them (e.g. GPTImpl::reset_parameters, which fills shards row by row).
  std::function<void(torch::nn::Module&)> param_init_fn;
  std::optional<c10::Device> device_id;
  // Neither wrapped nor sharded: their parameters stay whole and unreduced.
  std::vector<std::shared_ptr<torch::nn::Module>> ignored_modules;
};

// FULL_STATE_DICT's settings (FSDP1's FullStateDictConfig).
// Example: fsdp::FullStateDictConfig cfg{.offload_to_cpu = true, .rank0_only = true};
struct FullStateDictConfig {
  bool offload_to_cpu = false;  // the full tensors on the CPU
  bool rank0_only = false;      // get: only rank 0 keeps them; load: only rank 0's dict is read
};

namespace detail {
struct FSDP1State;
}

// While alive, backward accumulates gradients locally without any communication; the first
// backward after it is gone reduces the sum (FSDP1's no_sync(), FSDP2's
// set_requires_gradient_sync(false)). Nestable.
class NoSyncGuard {
 public:
  NoSyncGuard(NoSyncGuard&& other) noexcept : state_(std::move(other.state_)) {}
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(NoSyncGuard&&) = delete;
  ~NoSyncGuard();

 private:
  friend class FullyShardedDataParallelBase;  // no_sync() makes one
  explicit NoSyncGuard(std::shared_ptr<detail::FSDP1State> state);
  std::shared_ptr<detail::FSDP1State> state_;
};

// The full parameters of every unit under a module, gathered while this guard lives (collective:
// every rank creates and destroys it at the same point). Reading and editing the module's fields
// (model->lm_head->weight) or named_parameters() below sees the full tensors; on destruction
// edits are written back to this rank's shards (writeback) and the full parameters freed.
// Works for FSDP2 models too (any module with fully_shard units, or one under replicate).
//   rank0_only: only rank 0 keeps the full parameters (others see their shards); with writeback
//               it is refused, as in PyTorch.
//   offload_to_cpu: named_parameters() gives CPU copies (the parameters are on the CPU already
//               for CPU models); edits to them are written back.
// Refused, in one line: nested over units an outer guard holds, created during forward (or with an
// all-gather in flight), forward through the wrapper while it lives, writeback under mixed
// precision (the full parameters are in param_dtype). A unit a forward left gathered (the root
// until its backward) is read as it is and left gathered.
class SummonFullParams {
 public:
  SummonFullParams(torch::nn::Module& module, bool writeback, bool rank0_only, bool offload_to_cpu);
  SummonFullParams(SummonFullParams&& other) noexcept;
  SummonFullParams(const SummonFullParams&) = delete;
  SummonFullParams& operator=(const SummonFullParams&) = delete;
  SummonFullParams& operator=(SummonFullParams&&) = delete;
  ~SummonFullParams();

  // module.named_parameters() with every sharded parameter replaced by its full tensor (on ranks
  // that hold them), original names.
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return params_; }
  at::Tensor parameter(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
};

// Example:
//   {
//     auto full = fsdp::summon_full_params(*model);     // every rank
//     torch::NoGradGuard no_grad;
//     model->lm_head->weight.mul_(0.5);                  // written back to the shards at the }
//   }
[[nodiscard]] SummonFullParams summon_full_params(torch::nn::Module& module, bool writeback = true,
                                                  bool rank0_only = false, bool offload_to_cpu = false);

// The non-template part of FullyShardedDataParallel<M>: copies share one state.
class FullyShardedDataParallelBase {
 public:
  FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module, FSDPOptions options);

  torch::nn::Module& root() const;
  const FSDPOptions& options() const;
  ShardingStrategy sharding_strategy() const { return options().sharding_strategy; }
  // The wrapped module's parameters: shards (NO_SHARD: full tensors), original names.
  std::vector<at::Tensor> parameters() const { return root().parameters(); }
  torch::OrderedDict<std::string, at::Tensor> named_parameters() const { return root().named_parameters(); }

  [[nodiscard]] NoSyncGuard no_sync();
  // FSDP1's register_comm_hook for FULL_SHARD and SHARD_GRAD_OP: `hook(grad, output, group)`
  // replaces every unit's gradient reduction. `grad` is the unit's flat gradient, [world * n] (rank
  // r's part at r * n, the padding zero), `output` the n elements of this rank's reduced part to
  // write, `group` the ranks that share the unit; the hook averages (or not) itself, as FSDP1's
  // do. Once per wrapper; NO_SHARD and the hybrid strategies are refused, as FSDP1 refuses hybrid.
  //   fsdp::FSDP m(model);
  //   m.register_comm_hook([](const at::Tensor& grad, const at::Tensor& output, fsdp::comm::Comm& group) {
  //     group.reduce_scatter_tensor(output, grad, fsdp::comm::ReduceOp::Sum);   // FSDP1's
  //     output.div_(group.size());                                               // reduce_scatter_hook
  //   });
  using CommHook = std::function<void(const at::Tensor& grad, const at::Tensor& output, comm::Comm& group)>;
  void register_comm_hook(CommHook hook);
  // Norm over every rank's gradients (fsdp::clip_grad_norm_); returns the norm before clipping.
  double clip_grad_norm_(double max_norm, double norm_type = 2.0);
  [[nodiscard]] SummonFullParams summon_full_params(bool writeback = true, bool rank0_only = false,
                                                    bool offload_to_cpu = false);

  // The kind of dict state_dict() / load_state_dict() / optim_state_dict() use from now on.
  void set_state_dict_type(StateDictType type, FullStateDictConfig config = {});
  StateDictType state_dict_type() const;
  // Model keys as named_parameters() plus buffers. FULL_STATE_DICT: collective.
  checkpoint::StateDict state_dict();
  checkpoint::LoadResult load_state_dict(const checkpoint::StateDict& state_dict, bool strict = true);
  // The StateDictOptions the current type maps to (state_dict.h).
  checkpoint::StateDictOptions state_dict_options(bool for_load) const;

  const std::shared_ptr<detail::FSDP1State>& state() const { return state_; }

 protected:
  // The wrapper's forward: refuses forward inside summon_full_params.
  struct ForwardScope {
    explicit ForwardScope(detail::FSDP1State& state);
    ~ForwardScope();
    detail::FSDP1State& state;
  };

  std::shared_ptr<detail::FSDP1State> state_;
};

// Sets the state-dict type for the guard's lifetime, then restores the previous one
// (FSDP.state_dict_type(model, ...) as a context manager).
class StateDictTypeGuard {
 public:
  StateDictTypeGuard(FullyShardedDataParallelBase& model, StateDictType type, FullStateDictConfig config);
  StateDictTypeGuard(const StateDictTypeGuard&) = delete;
  StateDictTypeGuard& operator=(const StateDictTypeGuard&) = delete;
  ~StateDictTypeGuard();

 private:
  FullyShardedDataParallelBase& model_;
  StateDictType previous_type_;
  FullStateDictConfig previous_config_;
};

// Example:
//   fsdp::FSDP fsdp_model(model, fsdp::FSDPOptions{.sharding_strategy = fsdp::ShardingStrategy::SHARD_GRAD_OP});
//   {
//     auto no_sync = fsdp_model.no_sync();               // accumulate locally...
//     fsdp::models::gpt_loss(fsdp_model(tokens), targets).backward();
//   }
//   fsdp::models::gpt_loss(fsdp_model(tokens), targets).backward();   // ...this one reduces the sum
//   {
//     fsdp::StateDictTypeGuard type(fsdp_model, fsdp::StateDictType::FULL_STATE_DICT, {.rank0_only = true});
//     auto sd = fsdp_model.state_dict();                          // full tensors, rank 0 only
//     auto osd = fsdp::optim_state_dict(fsdp_model, optimizer);   // the same layout
//   }
template <typename M>
class FullyShardedDataParallel : public FullyShardedDataParallelBase {
 public:
  // M: a module holder (GPT) or std::shared_ptr to a module.
  explicit FullyShardedDataParallel(M module, FSDPOptions options = {})
      : FullyShardedDataParallelBase(as_module(module), std::move(options)), module_(std::move(module)) {}

  // Through fsdp::call: FSDP's pre- and post-forward run around the module's forward.
  template <typename... Args>
  auto forward(Args&&... args) {
    ForwardScope scope(*state_);
    return fsdp::call(module_, std::forward<Args>(args)...);
  }
  template <typename... Args>
  auto operator()(Args&&... args) {
    return forward(std::forward<Args>(args)...);
  }

  // FSDP1's `.module`: the wrapped module itself.
  M& module() { return module_; }
  auto* operator->() const { return module_.get(); }
  auto& operator*() const { return *module_.get(); }

 private:
  static std::shared_ptr<torch::nn::Module> as_module(const M& m) {
    if constexpr (requires { m.ptr(); }) {
      return std::static_pointer_cast<torch::nn::Module>(m.ptr());
    } else {
      return std::static_pointer_cast<torch::nn::Module>(m);
    }
  }

  M module_;
};

template <typename M>
FullyShardedDataParallel(M, FSDPOptions) -> FullyShardedDataParallel<M>;
template <typename M>
FullyShardedDataParallel(M) -> FullyShardedDataParallel<M>;
template <typename M>
using FSDP = FullyShardedDataParallel<M>;

// FSDP.optim_state_dict(model, optim): the optimizer state in the layout of model's state-dict
// type (get_optimizer_state_dict); keys "<parameter name>.<field>".
// Example: fsdp::FSDP m(model); auto osd = fsdp::optim_state_dict(m, optimizer);
checkpoint::StateDict optim_state_dict(FullyShardedDataParallelBase& model, torch::optim::Optimizer& optim);
// FSDP.optim_state_dict_to_load + optim.load_state_dict in one: LibTorch optimizers take no
// dict, so this loads it (set_optimizer_state_dict) and returns the missing / unexpected keys.
// Example: fsdp::FSDP m(model); fsdp::optim_state_dict_to_load(m, optimizer, fsdp::optim_state_dict(m, optimizer));
checkpoint::LoadResult optim_state_dict_to_load(FullyShardedDataParallelBase& model, torch::optim::Optimizer& optim,
                                                const checkpoint::StateDict& optim_state_dict);

// FSDP.fsdp_modules: the units under `module` (itself included), in module order, by name ("" for
// `module` itself).
std::vector<std::pair<std::string, FSDPModule>> named_fsdp_modules(torch::nn::Module& module);
// The names (relative to the root fully_shard ran under) of the parameters one unit manages.
std::vector<std::string> unit_parameter_names(const FSDPModule& unit);
// Bytes of full parameters `module` holds right now: gathered units' unsharded parameters plus
// parameters that are not sharded (replicate, ignored). Shards are not counted.
int64_t full_parameter_bytes(torch::nn::Module& module);

// Applies `policy` bottom-up as PyTorch's _recursive_wrap does, calling wrap(module) on every
// module it selects (children before parents; never `root` itself, never into `ignored`).
// FullyShardedDataParallel uses it with fully_shard; exposed for FSDP2 users who want a policy.
// Example:
//   auto shard = [](const std::shared_ptr<torch::nn::Module>& m) { fsdp::fully_shard(m); };
//   fsdp::apply_auto_wrap_policy(*model, fsdp::size_based_auto_wrap_policy(10000), shard);
void apply_auto_wrap_policy(torch::nn::Module& root, const AutoWrapPolicy& policy,
                            const std::function<void(const std::shared_ptr<torch::nn::Module>&)>& wrap,
                            const std::vector<std::shared_ptr<torch::nn::Module>>& ignored = {});

}  // namespace fsdp
