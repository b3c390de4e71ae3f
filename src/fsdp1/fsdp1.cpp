// FullyShardedDataParallel: FSDP1's options turned into fully_shard / replicate calls (the table
// in fsdp/fsdp1/fsdp1.h), and its state-dict and gradient helpers mapped onto this library's.
#include <torch/torch.h>

#include <stdexcept>
#include <string>

#include "fsdp/dist/runtime.h"
#include "fsdp/sharding/clip_grad.h"
#include "fsdp/sharding/materialize.h"
#include "fsdp1_state.h"

namespace fsdp {

namespace {

const char* strategy_name(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::FULL_SHARD: return "FULL_SHARD";
    case ShardingStrategy::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case ShardingStrategy::NO_SHARD: return "NO_SHARD";
    case ShardingStrategy::HYBRID_SHARD: return "HYBRID_SHARD";
    case ShardingStrategy::HYBRID_SHARD_ZERO2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

bool is_hybrid(ShardingStrategy s) {
  return s == ShardingStrategy::HYBRID_SHARD || s == ShardingStrategy::HYBRID_SHARD_ZERO2;
}

[[noreturn]] void refuse(const std::string& what) {
  throw std::invalid_argument("fsdp::FullyShardedDataParallel: " + what);
}

// Everything that cannot be honoured is refused before any collective runs (every rank throws).
void validate(const torch::nn::Module& root, const FSDPOptions& o) {
  const std::string strategy = strategy_name(o.sharding_strategy);
  if (o.mixed_precision) {
    if (o.mixed_precision->buffer_dtype) {
      refuse(
          "MixedPrecision::buffer_dtype is not supported (fully_shard keeps buffers in their dtype); leave it "
          "unset and cast the buffers yourself");
    }
    if (o.mixed_precision->keep_low_precision_grads) {
      refuse(
          "MixedPrecision::keep_low_precision_grads is not supported (gradients land on the fp32 shards); set it "
          "to false");
    }
  }
  if (o.backward_prefetch == BackwardPrefetch::BACKWARD_POST) {
    refuse(
        "BackwardPrefetch::BACKWARD_POST is not supported (fully_shard prefetches at pre-backward); use "
        "BACKWARD_PRE or NONE");
  }
  if (o.sharding_strategy == ShardingStrategy::NO_SHARD) {
    if (o.mixed_precision) refuse("NO_SHARD (fsdp::replicate) has no mixed precision; leave mixed_precision unset");
    if (o.cpu_offload && o.cpu_offload->offload_params) {
      refuse("NO_SHARD (fsdp::replicate) cannot offload parameters; leave cpu_offload unset");
    }
    if (!o.ignored_modules.empty()) refuse("NO_SHARD (fsdp::replicate) takes no ignored_modules; leave it empty");
  }
  if (o.device_mesh) {
    const int want = is_hybrid(o.sharding_strategy) ? 2 : 1;
    if (o.device_mesh->ndim() != want) {
      refuse(strategy + " takes a " + std::to_string(want) + "-D device_mesh, got a " +
             std::to_string(o.device_mesh->ndim()) + "-D one" +
             (want == 2 ? "; pass init_device_mesh({R, S}, {\"replicate\", \"shard\"})"
                        : "; a 2-D {\"replicate\", \"shard\"} mesh is HYBRID_SHARD"));
    }
  }
  for (const auto& m : o.ignored_modules) {
    if (!m) refuse("ignored_modules holds a null module");
    if (m.get() == &root) refuse("the root module itself is in ignored_modules; ignore its submodules instead");
  }
}

bool has_meta_tensors(torch::nn::Module& m) {
  for (const auto& p : m.parameters()) {
    if (p.is_meta()) return true;
  }
  for (const auto& b : m.buffers()) {
    if (b.is_meta()) return true;
  }
  return false;
}

// sync_module_states: rank 0's values everywhere, before anything is sharded.
void broadcast_from_rank0(torch::nn::Module& m) {
  auto world = dist::world_comm();
  torch::NoGradGuard no_grad;
  for (const auto& p : m.parameters()) world->broadcast(p.detach(), 0);
  for (const auto& b : m.buffers()) world->broadcast(b, 0);
}

DeviceMesh hybrid_default_mesh() {
  const int world = dist::world_size(), local = dist::local_world_size();
  if (local <= 0 || world % local != 0) {
    refuse("HYBRID_SHARD without device_mesh shards within a host, but the world (" + std::to_string(world) +
           ") is no multiple of the local world size (" + std::to_string(local) +
           "); pass device_mesh = init_device_mesh({R, S}, {\"replicate\", \"shard\"})");
  }
  return init_device_mesh({world / local, local}, {"replicate", "shard"});
}

std::vector<at::Tensor> ignored_params(const FSDPOptions& o) {
  std::vector<at::Tensor> out;
  for (const auto& m : o.ignored_modules) {
    for (const auto& p : m->parameters()) out.push_back(p);
  }
  return out;
}

MixedPrecisionPolicy mp_policy(const std::optional<MixedPrecision>& mp, bool root) {
  MixedPrecisionPolicy p;
  if (!mp) return p;
  p.param_dtype = mp->param_dtype;
  p.reduce_dtype = mp->reduce_dtype;
  p.cast_forward_inputs = root ? mp->cast_root_forward_inputs : mp->cast_forward_inputs;
  return p;
}

void shard(detail::FSDP1State& st) {
  const FSDPOptions& o = st.options;
  FullyShardOptions unit;
  unit.mesh = o.device_mesh;
  if (is_hybrid(o.sharding_strategy) && !unit.mesh) unit.mesh = hybrid_default_mesh();
  if (o.sharding_strategy == ShardingStrategy::SHARD_GRAD_OP ||
      o.sharding_strategy == ShardingStrategy::HYBRID_SHARD_ZERO2) {
    unit.reshard_after_forward = false;
  }  // FULL_SHARD / HYBRID_SHARD: unset, so every unit but the root reshards, as FSDP1's root does not
  if (o.cpu_offload && o.cpu_offload->offload_params) unit.offload_policy = CPUOffloadPolicy{};
  unit.ignored_params = ignored_params(o);
  FullyShardOptions root_options = unit;
  unit.mp_policy = mp_policy(o.mixed_precision, /*root=*/false);
  root_options.mp_policy = mp_policy(o.mixed_precision, /*root=*/true);

  apply_auto_wrap_policy(
      *st.root, o.auto_wrap_policy, [&](const std::shared_ptr<torch::nn::Module>& m) { fully_shard(m, unit); },
      o.ignored_modules);
  st.root_unit = fully_shard(st.root, root_options);

  for (auto& [name, u] : named_fsdp_modules(*st.root)) {
    if (!o.forward_prefetch) u.set_modules_to_forward_prefetch({});
    if (o.backward_prefetch == BackwardPrefetch::NONE) u.set_modules_to_backward_prefetch({});
  }
}

void materialize(detail::FSDP1State& st) {
  const FSDPOptions& o = st.options;
  if (!has_meta_tensors(*st.root)) return;
  if (!o.param_init_fn) {
    refuse(
        "the module has meta-device tensors but no param_init_fn; pass one that initialises them (e.g. "
        "[](torch::nn::Module& m) { static_cast<GPTImpl&>(m).reset_parameters(); })");
  }
  to_empty(*st.root, o.device_id.value_or(c10::Device(c10::kCPU)));
  o.param_init_fn(*st.root);
}

}  // namespace

FullyShardedDataParallelBase::FullyShardedDataParallelBase(std::shared_ptr<torch::nn::Module> module,
                                                           FSDPOptions options) {
  if (!module) refuse("the module is null");
  validate(*module, options);
  state_ = std::make_shared<detail::FSDP1State>();
  state_->root = std::move(module);
  state_->options = std::move(options);
  detail::FSDP1State& st = *state_;
  if (st.options.sync_module_states) {
    if (has_meta_tensors(*st.root)) {
      refuse(
          "sync_module_states with a meta-device model: there is nothing to broadcast before param_init_fn; "
          "initialise identically on every rank (fsdp::init) and drop sync_module_states");
    }
    broadcast_from_rank0(*st.root);
  }
  if (st.options.sharding_strategy == ShardingStrategy::NO_SHARD) {
    materialize(st);  // replicate broadcasts rank 0's initialised values
    ReplicateOptions r;
    r.mesh = st.options.device_mesh;
    st.replicated = replicate(st.root, r);
    return;
  }
  shard(st);
  materialize(st);
}

torch::nn::Module& FullyShardedDataParallelBase::root() const { return *state_->root; }
const FSDPOptions& FullyShardedDataParallelBase::options() const { return state_->options; }

NoSyncGuard FullyShardedDataParallelBase::no_sync() { return NoSyncGuard(state_); }

NoSyncGuard::NoSyncGuard(std::shared_ptr<detail::FSDP1State> state) : state_(std::move(state)) {
  if (state_->no_sync_depth++ > 0) return;
  if (state_->root_unit) state_->root_unit->set_requires_gradient_sync(false);
  if (state_->replicated) state_->replicated->set_requires_gradient_sync(false);
}

NoSyncGuard::~NoSyncGuard() {
  if (!state_ || --state_->no_sync_depth > 0) return;
  if (state_->root_unit) state_->root_unit->set_requires_gradient_sync(true);
  if (state_->replicated) state_->replicated->set_requires_gradient_sync(true);
}

namespace {

// FSDP1's comm hook as the units' custom reduce-scatter (custom_collectives.h).
class CommHookReduceScatter : public ReduceScatter {
 public:
  explicit CommHookReduceScatter(FullyShardedDataParallelBase::CommHook hook) : hook_(std::move(hook)) {}
  comm::Work operator()(const at::Tensor& output, const at::Tensor& input, comm::Comm& group, comm::ReduceOp /*op*/,
                        bool /*async_op*/) override {
    hook_(input, output, group);
    return comm::Work();
  }

 private:
  FullyShardedDataParallelBase::CommHook hook_;
};

}  // namespace

void FullyShardedDataParallelBase::register_comm_hook(CommHook hook) {
  const ShardingStrategy s = sharding_strategy();
  if (s != ShardingStrategy::FULL_SHARD && s != ShardingStrategy::SHARD_GRAD_OP) {
    throw std::invalid_argument(
        "fsdp::FSDP::register_comm_hook: not offered for " +
        std::string(s == ShardingStrategy::NO_SHARD ? "NO_SHARD" : "the hybrid strategies") +
        " (FSDP1 refuses hybrid strategies too); use FULL_SHARD or SHARD_GRAD_OP, or fully_shard's "
        "set_all_reduce_hook / set_custom_reduce_scatter");
  }
  if (!hook) throw std::invalid_argument("fsdp::FSDP::register_comm_hook: the hook is empty");
  if (state_->comm_hook_registered) {
    throw std::logic_error(
        "fsdp::FSDP::register_comm_hook: a communication hook is already registered (FSDP1 "
        "takes one per model)");
  }
  const auto reduce = std::make_shared<CommHookReduceScatter>(std::move(hook));
  for (auto& [name, unit] : named_fsdp_modules(root())) unit.set_custom_reduce_scatter(reduce);
  state_->comm_hook_registered = true;
}

double FullyShardedDataParallelBase::clip_grad_norm_(double max_norm, double norm_type) {
  return fsdp::clip_grad_norm_(root().parameters(), max_norm, norm_type);
}

SummonFullParams FullyShardedDataParallelBase::summon_full_params(bool writeback, bool rank0_only,
                                                                  bool offload_to_cpu) {
  return fsdp::summon_full_params(root(), writeback, rank0_only, offload_to_cpu);
}

FullyShardedDataParallelBase::ForwardScope::ForwardScope(detail::FSDP1State& s) : state(s) {
  detail::check_not_summoned(*state.root);
  ++detail::fsdp1_forward_depth();
}
FullyShardedDataParallelBase::ForwardScope::~ForwardScope() { --detail::fsdp1_forward_depth(); }

void FullyShardedDataParallelBase::set_state_dict_type(StateDictType type, FullStateDictConfig config) {
  state_->state_dict_type = type;
  state_->full_config = config;
}

StateDictType FullyShardedDataParallelBase::state_dict_type() const { return state_->state_dict_type; }

checkpoint::StateDictOptions FullyShardedDataParallelBase::state_dict_options(bool for_load) const {
  checkpoint::StateDictOptions o;
  if (state_->state_dict_type == StateDictType::SHARDED_STATE_DICT) return o;
  o.full_state_dict = true;
  if (for_load) {
    o.broadcast_from_rank0 = state_->full_config.rank0_only;
  } else {
    o.cpu_offload = state_->full_config.rank0_only;  // rank 0 keeps them, on the CPU
  }
  return o;
}

namespace {
// FULL_STATE_DICT with offload_to_cpu but not rank0_only: every rank keeps its full copy, on the CPU.
checkpoint::StateDict offload_if_asked(checkpoint::StateDict sd, const detail::FSDP1State& st) {
  if (st.state_dict_type != StateDictType::FULL_STATE_DICT || !st.full_config.offload_to_cpu) return sd;
  for (auto& [key, t] : sd) t = t.to(c10::kCPU);
  return sd;
}
}  // namespace

checkpoint::StateDict FullyShardedDataParallelBase::state_dict() {
  return offload_if_asked(checkpoint::get_model_state_dict(root(), state_dict_options(false)), *state_);
}

checkpoint::LoadResult FullyShardedDataParallelBase::load_state_dict(const checkpoint::StateDict& sd, bool strict) {
  auto o = state_dict_options(true);
  o.strict = strict;
  return checkpoint::set_model_state_dict(root(), sd, o);
}

StateDictTypeGuard::StateDictTypeGuard(FullyShardedDataParallelBase& model, StateDictType type,
                                       FullStateDictConfig config)
    : model_(model), previous_type_(model.state()->state_dict_type), previous_config_(model.state()->full_config) {
  model_.set_state_dict_type(type, config);
}

StateDictTypeGuard::~StateDictTypeGuard() { model_.set_state_dict_type(previous_type_, previous_config_); }

checkpoint::StateDict optim_state_dict(FullyShardedDataParallelBase& model, torch::optim::Optimizer& optim) {
  return offload_if_asked(checkpoint::get_optimizer_state_dict(model.root(), optim, model.state_dict_options(false)),
                          *model.state());
}

checkpoint::LoadResult optim_state_dict_to_load(FullyShardedDataParallelBase& model, torch::optim::Optimizer& optim,
                                                const checkpoint::StateDict& optim_state_dict) {
  return checkpoint::set_optimizer_state_dict(model.root(), optim, optim_state_dict, model.state_dict_options(true));
}

}  // namespace fsdp
