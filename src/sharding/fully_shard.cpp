#include "fsdp/sharding/fully_shard.h"

#include <torch/optim/optimizer.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <unordered_set>

#include "fsdp/dist/runtime.h"
#include "fsdp/hooks/forward_hooks.h"
#include "fsdp/sharding/call.h"
#include "fsdp_state.h"
#include "registry.h"

namespace fsdp {

namespace detail {

namespace {

// The 1-D mesh over all ranks, made once per runtime (each mesh creates process groups).
DeviceMesh default_mesh() {
  static std::mutex mu;
  static std::shared_ptr<comm::Comm> for_world;
  static std::optional<DeviceMesh> mesh;
  std::lock_guard<std::mutex> lock(mu);
  if (!dist::is_initialized()) dist::init_distributed();
  if (!mesh || for_world != dist::world_comm()) {
    mesh = init_device_mesh({dist::world_size()}, {"shard"});
    for_world = dist::world_comm();
  }
  return *mesh;
}

std::string module_name(const torch::nn::Module& m) { return m.name(); }

std::string join_ranks(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) {
    // Two appends, not `(i ? "-" : "") + to_string(...)`: GCC 12 warns a false
    // -Wstringop-overflow on that operator+ once inlined here (GCC bug 105651).
    if (i) out += '-';
    out += std::to_string(ranks[i]);
  }
  return out;
}

// Step 3: FSDP (1-D) or HSDP (2-D: dim 0 replicates, dim 1 shards). Throws naming the problem and the fix.
void check_mesh(const DeviceMesh& mesh) {
  for (const auto& name : mesh.dim_names()) {
    if (name == "tp") {
      throw std::invalid_argument("fsdp::fully_shard: the mesh " + mesh.to_string() +
                                  " has a \"tp\" dimension; fully_shard shards over the data-parallel ranks: pass "
                                  "mesh[\"dp\"] (or mesh[{\"replicate\", \"shard\"}] for HSDP)");
    }
  }
  if (mesh.ndim() > 2) {
    throw std::invalid_argument("fsdp::fully_shard: a " + std::to_string(mesh.ndim()) + "-D mesh (" + mesh.to_string() +
                                "); fully_shard takes a 1-D mesh (FSDP) or a 2-D one (HSDP, replicate x shard): pass "
                                "the data-parallel sub-mesh");
  }
  if (mesh.ndim() == 2) {
    const auto& names = mesh.dim_names();
    const std::string fix = "; build it as fsdp::init_device_mesh({" + std::to_string(mesh.size(0)) + ", " +
                            std::to_string(mesh.size(1)) +
                            "}, {\"replicate\", \"shard\"}) (dim 0 replicates, dim 1 shards)";
    if (names[0] == "dim0" && names[1] == "dim1") {
      throw std::invalid_argument("fsdp::fully_shard: HSDP needs a 2-D mesh with named dimensions, got " +
                                  mesh.to_string() + fix);
    }
    if (names[0].find("shard") != std::string::npos || names[1].find("replicate") != std::string::npos) {
      throw std::invalid_argument("fsdp::fully_shard: HSDP mesh " + mesh.to_string() + " has dimensions (\"" +
                                  names[0] + "\", \"" + names[1] +
                                  "\"), but dim 0 must be the replicate dimension and dim 1 the "
                                  "shard dimension (FSDP2's order)" +
                                  fix);
    }
  }
  // Every dimension's group must be the ranks the mesh lists along it, in order.
  for (int d = 0; d < mesh.ndim(); ++d) {
    const auto& ranks = mesh.comm(d)->global_ranks();
    auto listed = mesh[mesh.dim_names()[static_cast<size_t>(d)]].mesh().reshape(-1);
    bool same = static_cast<int64_t>(ranks.size()) == listed.numel();
    for (size_t i = 0; same && i < ranks.size(); ++i)
      same = listed[static_cast<int64_t>(i)].item<int64_t>() == ranks[i];
    if (!same) {
      throw std::invalid_argument(
          "fsdp::fully_shard: the mesh's ranks do not match its process group; build the "
          "mesh with fsdp::init_device_mesh");
    }
  }
}

// The group of k consecutive ranks of `shard` that this rank belongs to, made once per process:
// every member creates it at fully_shard time, in the same order (fully_shard is SPMD).
std::shared_ptr<comm::Comm> post_forward_group(const comm::Comm& shard, int k) {
  static std::mutex mu;
  static std::map<std::string, std::pair<std::shared_ptr<comm::Comm>, std::shared_ptr<comm::Comm>>> groups;
  std::lock_guard<std::mutex> lock(mu);
  const int first = (shard.rank() / k) * k;
  std::vector<int> ranks(shard.global_ranks().begin() + first, shard.global_ranks().begin() + first + k);
  std::sort(ranks.begin(), ranks.end());
  const std::string tag = "post_forward/" + join_ranks(ranks);
  auto it = groups.find(tag);
  // Keyed by the ranks, and valid for one runtime (a new world has new process groups).
  if (it != groups.end() && it->second.first == dist::world_comm()) return it->second.second;
  auto group = dist::new_group(ranks, tag);
  groups[tag] = {dist::world_comm(), group};
  return group;
}

// reshard_after_forward as FSDPState takes it, plus the post-forward group size for an integer.
std::pair<std::optional<bool>, int> resolve_reshard(const std::optional<std::variant<bool, int>>& option,
                                                    int shard_size) {
  if (!option) return {std::nullopt, 0};
  if (const bool* b = std::get_if<bool>(&*option)) return {*b, 0};
  const int k = std::get<int>(*option);
  if (k < 1 || k > shard_size || shard_size % k != 0) {
    std::string divisors;
    for (int d = 1; d <= shard_size; ++d) {
      if (shard_size % d == 0) divisors += (divisors.empty() ? "" : ", ") + std::to_string(d);
    }
    throw std::invalid_argument("fsdp::fully_shard: reshard_after_forward = " + std::to_string(k) +
                                " does not divide the shard size " + std::to_string(shard_size) +
                                "; use a divisor of it (" + divisors + "), true or false");
  }
  if (k == 1) return {false, 0};  // a group of one is this rank keeping everything
  if (k == shard_size) return {true, 0};
  return {true, k};
}

// Step 1: the modules themselves (non-null, not already sharded, not under fsdp::replicate).
void validate_modules(const std::vector<std::shared_ptr<torch::nn::Module>>& modules) {
  if (modules.empty()) throw std::invalid_argument("fsdp::fully_shard: no module given");
  for (const auto& m : modules) {
    if (!m) throw std::invalid_argument("fsdp::fully_shard: a module is null");
    if (lookup_state(m.get())) {
      throw std::invalid_argument("fsdp::fully_shard: module " + module_name(*m) +
                                  " is already sharded; call fully_shard once per module (bottom-up: children, "
                                  "then parents)");
    }
  }
  for (const auto& m : modules) {
    for (const auto& sub : m->modules(/*include_self=*/true)) {
      if (is_replicated(sub.get())) {
        throw std::invalid_argument("fsdp::fully_shard: module " + module_name(*sub) +
                                    " is under fsdp::replicate; a module is either replicated or sharded");
      }
    }
  }
}

// Step 2: the mixed-precision dtypes are floating point.
void validate_mp_policy(const MixedPrecisionPolicy& mp) {
  for (auto [name, dtype] : {std::pair{"param_dtype", mp.param_dtype}, std::pair{"reduce_dtype", mp.reduce_dtype},
                             std::pair{"output_dtype", mp.output_dtype}}) {
    if (dtype && !at::isFloatingType(*dtype)) {
      throw std::invalid_argument(std::string("fsdp::fully_shard: MixedPrecisionPolicy::") + name + " is " +
                                  c10::toString(*dtype) +
                                  "; mixed precision dtypes must be floating point "
                                  "(e.g. at::kBFloat16, at::kHalf, at::kFloat)");
    }
  }
}

// The parameters one fully_shard call takes over, in registration order, with every registry
// slot that holds each (tied weights share one tensor and become one FSDPParam with several slots).
struct ManagedParams {
  std::vector<at::Tensor> order;
  std::map<const c10::TensorImpl*, std::pair<std::vector<ParamSlot>, std::string>> slots;  // slots, fqn
  const std::string& fqn(const at::Tensor& t) const { return slots.at(t.unsafeGetTensorImpl()).second; }
};

// Step 4: every parameter not already managed by an inner call nor ignored.
ManagedParams collect_managed_params(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                                     const std::vector<at::Tensor>& ignored_params) {
  std::unordered_set<const c10::TensorImpl*> ignored;
  for (const auto& t : ignored_params) ignored.insert(t.unsafeGetTensorImpl());
  ManagedParams out;
  for (const auto& root : modules) {
    for (const auto& item : root->named_modules()) {
      const std::shared_ptr<torch::nn::Module>& owner = item.value();
      for (const auto& p : owner->named_parameters(/*recurse=*/false)) {
        const at::Tensor& t = p.value();
        const std::string fqn = item.key().empty() ? p.key() : item.key() + "." + p.key();
        if (param_of_shard(t) != nullptr || ignored.count(t.unsafeGetTensorImpl())) continue;
        if (owner_of_unsharded(t) != nullptr) {
          throw std::invalid_argument("fsdp::fully_shard: parameter '" + fqn +
                                      "' is tied to a parameter of a module sharded by an earlier fully_shard call; "
                                      "tied parameters must be in one group: shard the modules that share it "
                                      "together (one fully_shard call, e.g. on their common parent)");
        }
        auto [it, inserted] = out.slots.try_emplace(t.unsafeGetTensorImpl());
        if (inserted) {
          out.order.push_back(t);
          it->second.second = fqn;
        }
        it->second.first.push_back(ParamSlot{owner, p.key()});
      }
    }
  }
  return out;
}

// Step 5: one device and one dtype per group, on the mesh's device (or meta).
void validate_managed_params(const ManagedParams& managed, const DeviceMesh& mesh) {
  for (const auto& t : managed.order) {
    const at::Tensor& front = managed.order.front();
    const std::string& fqn = managed.fqn(t);
    const std::string& first = managed.fqn(front);
    if (t.device() != front.device()) {
      throw std::invalid_argument("fsdp::fully_shard: parameters '" + first + "' (" + front.device().str() + ") and '" +
                                  fqn + "' (" + t.device().str() +
                                  ") are on different devices; move the module to one device first");
    }
    if (t.scalar_type() != front.scalar_type()) {
      throw std::invalid_argument("fsdp::fully_shard: parameters '" + first + "' (" +
                                  c10::toString(front.scalar_type()) + ") and '" + fqn + "' (" +
                                  c10::toString(t.scalar_type()) +
                                  ") differ in dtype; one group moves one dtype: shard them in separate calls or "
                                  "convert the module first");
    }
    // Meta parameters (every one of them, checked above) wait for fsdp::to_empty.
    if (!t.is_meta() && t.device().type() != c10::Device(mesh.device_type()).type()) {
      throw std::invalid_argument("fsdp::fully_shard: parameter '" + fqn + "' is on " + t.device().str() +
                                  " but the mesh computes on '" + mesh.device_type() +
                                  "'; move the module there first (meta parameters: materialise them first)");
    }
  }
}

// The dim shard_placement_fn chooses for parameter `t` (0 without one), negative dims normalized.
int64_t param_shard_dim(const FullyShardOptions& options, const std::string& fqn, const at::Tensor& t) {
  if (!options.shard_placement_fn) return 0;
  const std::optional<int64_t> chosen = options.shard_placement_fn(fqn, t);
  if (!chosen) return 0;
  const int64_t dim = *chosen < 0 ? *chosen + t.dim() : *chosen;
  if (dim < 0 || (dim > 0 && dim >= t.dim())) {
    throw std::invalid_argument("fsdp::fully_shard: shard_placement_fn returned dim " + std::to_string(*chosen) +
                                " for parameter '" + fqn + "' of " + std::to_string(t.dim()) +
                                " dims; return a dim in [-dim, dim) of the parameter, or nullopt for dim 0");
  }
  if (dim > 0) {
    if (auto tp = tp::tp_placement(t); tp && tp->blocks > 1) {
      throw std::invalid_argument("fsdp::fully_shard: parameter '" + fqn +
                                  "' has a strided (fused) tensor-parallel placement; shard it along dim 0 "
                                  "(shard_placement_fn returned " +
                                  std::to_string(*chosen) + ")");
    }
  }
  return dim;
}

// Step 6: the FSDPParams (each replaces its parameter by this rank's shard) and their group;
// null when the call manages no parameter.
std::unique_ptr<FSDPParamGroup> build_param_group(ManagedParams& managed, const DeviceMesh& mesh,
                                                  const FullyShardOptions& options) {
  if (managed.order.empty()) return nullptr;
  const int shard_dim = mesh.ndim() - 1;
  const int shard_rank = mesh.get_local_rank(shard_dim);
  const int shard_size = static_cast<int>(mesh.size(shard_dim));
  std::vector<std::unique_ptr<FSDPParam>> params;
  for (const auto& t : managed.order) {
    auto& [param_slots, fqn] = managed.slots[t.unsafeGetTensorImpl()];
    const int64_t dim = param_shard_dim(options, fqn, t);
    params.push_back(
        std::make_unique<FSDPParam>(t, param_slots, fqn, shard_rank, shard_size,
                                    ParamDtypes{options.mp_policy.param_dtype, options.mp_policy.reduce_dtype},
                                    ParamPlacement{options.offload_policy.has_value(),
                                                   options.offload_policy && options.offload_policy->pin_memory},
                                    dim));
  }
  return std::make_unique<FSDPParamGroup>(std::move(params), mesh);
}

// Step 7: the state of the modules, and the forward hooks through which fsdp::call runs it
// (fsdp/hooks/forward_hooks.h: after tensor parallel's, whatever order the two were applied in).
FSDPModule register_fsdp_state(const std::vector<std::shared_ptr<torch::nn::Module>>& modules,
                               std::unique_ptr<FSDPParamGroup> group, std::optional<bool> reshard_after_forward,
                               const MixedPrecisionPolicy& mp_policy) {
  auto state = std::make_shared<FSDPState>(modules, std::move(group), reshard_after_forward, mp_policy);
  register_state(modules, state);
  const std::weak_ptr<FSDPState> weak = state;  // the registry owns the state, the hooks must not
  hooks::ForwardHooks h;
  h.order = hooks::HookOrder::kSharding;
  h.pre = [weak](std::vector<at::Tensor> args) {
    auto s = weak.lock();
    return s ? s->pre_forward(std::move(args)) : args;
  };
  h.post = [weak](std::vector<at::Tensor>& outputs) {
    if (auto s = weak.lock()) s->post_forward(outputs);
  };
  h.abort = [weak]() noexcept {
    if (auto s = weak.lock()) s->abort_forward();
  };
  for (const auto& m : modules) hooks::register_forward_hooks(m, h);
  return detail::make_fsdp_module(state);
}

}  // namespace

}  // namespace detail

namespace detail {
FSDPState* state_of(const FSDPModule& module) { return module.state_.get(); }
FSDPModule make_fsdp_module(std::shared_ptr<FSDPState> state) { return FSDPModule(std::move(state)); }
}  // namespace detail

FSDPModule fully_shard(const std::shared_ptr<torch::nn::Module>& module, FullyShardOptions options) {
  return fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{module}, std::move(options));
}

FSDPModule fully_shard(const std::vector<std::shared_ptr<torch::nn::Module>>& modules, FullyShardOptions options) {
  // FSDP2's _fsdp_init in named steps; everything is validated before the first parameter is
  // replaced, so a refused call changes nothing.
  using namespace detail;
  purge_dead_states();
  validate_modules(modules);
  validate_mp_policy(options.mp_policy);
  const DeviceMesh mesh = options.mesh ? *options.mesh : default_mesh();
  check_mesh(mesh);
  const int shard_dim = mesh.ndim() - 1;  // HSDP: dim 1
  const int shard_size = static_cast<int>(mesh.size(shard_dim));
  const auto [reshard_after_forward, post_forward_size] = resolve_reshard(options.reshard_after_forward, shard_size);
  ManagedParams managed = collect_managed_params(modules, options.ignored_params);
  validate_managed_params(managed, mesh);
  std::unique_ptr<FSDPParamGroup> group = build_param_group(managed, mesh, options);
  // Every rank makes the post-forward group, even one without parameters here (SPMD: same calls).
  if (post_forward_size > 0) {
    auto pf = post_forward_group(*mesh.comm(shard_dim), post_forward_size);
    if (group) group->post_forward_comm = pf;
  }
  return register_fsdp_state(modules, std::move(group), reshard_after_forward, options.mp_policy);
}

std::optional<FSDPModule> fsdp_module(const torch::nn::Module& module) {
  auto s = detail::lookup_state(&module);
  if (!s) return std::nullopt;
  return detail::make_fsdp_module(s);
}

void UnshardHandle::wait() {
  if (state_ && state_->group()) state_->group()->wait_for_unshard();
}

UnshardHandle FSDPModule::unshard(bool async_op) {
  if (state_->group()) state_->group()->unshard(async_op);
  UnshardHandle h(state_.get());
  if (!async_op) h.wait();
  return h;
}

void FSDPModule::reshard() {
  if (state_->group()) state_->group()->reshard();
}

namespace {
template <typename F>
void for_states(detail::FSDPState* state, bool recurse, F&& f) {
  if (!recurse) {
    f(state);
    return;
  }
  for (auto* s : state->subtree_states()) f(s);
}
}  // namespace

void FSDPModule::set_requires_gradient_sync(bool requires_sync, bool recurse) {
  for_states(state_.get(), recurse, [&](detail::FSDPState* s) {
    if (s->group()) s->group()->requires_gradient_sync = requires_sync;
  });
}

void FSDPModule::set_requires_all_reduce(bool requires_all_reduce, bool recurse) {
  for_states(state_.get(), recurse, [&](detail::FSDPState* s) {
    if (s->group()) s->group()->requires_all_reduce = requires_all_reduce;
  });
}

void FSDPModule::set_reshard_after_forward(bool reshard, bool recurse) {
  for_states(state_.get(), recurse, [&](detail::FSDPState* s) { s->set_reshard_after_forward(reshard); });
}

void FSDPModule::set_reshard_after_backward(bool reshard, bool recurse) {
  for_states(state_.get(), recurse, [&](detail::FSDPState* s) {
    if (s->group()) s->group()->reshard_after_backward = reshard;
  });
}

void FSDPModule::set_is_last_backward(bool is_last) {
  if (!state_->context()) {
    throw std::logic_error("fsdp: set_is_last_backward needs the root to have run forward once");
  }
  state_->context()->is_last_backward = is_last;
}

void FSDPModule::set_modules_to_forward_prefetch(const std::vector<FSDPModule>& modules) {
  state_->explicit_forward_prefetch.clear();
  for (const auto& m : modules) state_->explicit_forward_prefetch.push_back(detail::state_of(m));
  state_->has_explicit_forward_prefetch = true;
}

void FSDPModule::set_modules_to_backward_prefetch(const std::vector<FSDPModule>& modules) {
  state_->explicit_backward_prefetch.clear();
  for (const auto& m : modules) state_->explicit_backward_prefetch.push_back(detail::state_of(m));
  state_->has_explicit_backward_prefetch = true;
}

void FSDPModule::set_unshard_in_backward(bool unshard_in_backward) {
  if (state_->group()) state_->group()->unshard_in_backward = unshard_in_backward;
}

void FSDPModule::set_gradient_divide_factor(double factor) {
  if (!(factor > 0)) throw std::invalid_argument("fsdp: the gradient divide factor must be positive");
  if (state_->group()) state_->group()->gradient_divide_factor = factor;
}

void FSDPModule::set_all_reduce_hook(std::function<void(const at::Tensor&)> hook, std::optional<c10::Stream> stream) {
  detail::FSDPParamGroup* group = state_->group();
  if (!group) return;
  if (stream && group->is_hsdp()) {
    throw std::invalid_argument(
        "fsdp: set_all_reduce_hook: no stream under HSDP: the hook runs on FSDP's all-reduce stream, after "
        "the all-reduce over the replicas (FSDP2's rule). Leave `stream` out.");
  }
  const c10::Device device = group->params().front()->device();
  // The stream's device, index included (a stream of cuda:1 cannot order work on cuda:0's tensors).
  if (stream && (device.is_cpu() || stream->device_type() != device.type() ||
                 (device.has_index() && stream->device_index() != device.index()))) {
    throw std::invalid_argument("fsdp: set_all_reduce_hook: the stream is on " + stream->device().str() +
                                " but this unit's parameters are on " + device.str() +
                                (device.is_cpu() ? " (streams are for GPUs: leave `stream` out on the CPU)"
                                                 : "; give a stream of their device"));
  }
  group->all_reduce_hook = std::move(hook);
  group->all_reduce_hook_stream = group->all_reduce_hook ? stream : std::nullopt;
}

void FSDPModule::set_force_sum_reduction_for_comms(bool enable) {
  if (state_->group()) state_->group()->force_sum_reduction_for_comms = enable;
}

void FSDPModule::set_custom_all_gather(std::shared_ptr<AllGather> comm) {
  if (state_->group()) state_->group()->custom_all_gather = std::move(comm);
}

void FSDPModule::set_custom_reduce_scatter(std::shared_ptr<ReduceScatter> comm) {
  if (state_->group()) state_->group()->custom_reduce_scatter = std::move(comm);
}

void FSDPModule::set_post_optim_event(std::shared_ptr<c10::Event> event) {
  state_->post_optim_event = std::move(event);
}

std::vector<torch::nn::Module*> FSDPModule::modules() const { return state_->modules(); }

std::optional<ShardInfo> shard_info(const at::Tensor& sharded_param) {
  detail::FSDPParam* p = detail::param_of_shard(sharded_param);
  if (p == nullptr) return std::nullopt;
  auto* group = detail::owner_of_unsharded(p->unsharded_param())->group();
  ShardInfo info{p->global_shape(), p->dim0_offset(), p->local_rows(), p->padded_rows(), p->fqn(), group->shard_mesh()};
  info.tp = tp::tp_placement(p->unsharded_param());
  info.shard_dim = p->shard_dim();
  if (group->is_hsdp()) {
    info.replica_rank = group->mesh().get_local_rank(0);
    info.num_replicas = group->mesh().size(0);
  }
  return info;
}

void check_optimizer_params(const torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      if (detail::FSDPParam* param = detail::param_of_unsharded(p)) {
        throw std::logic_error("fsdp: the optimizer holds the unsharded parameter '" + param->fqn() +
                               "' (it was built before fully_shard); build it after sharding, from "
                               "module->parameters(), which returns the shards");
      }
    }
  }
}

}  // namespace fsdp
