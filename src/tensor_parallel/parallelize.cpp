#include "fsdp/tensor_parallel/parallelize.h"

#include <fnmatch.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "comm_handle.h"
#include "fsdp/hooks/forward_hooks.h"
#include "fsdp/tensor_parallel/comm_functions.h"
#include "placement_registry.h"

namespace fsdp::tp {

namespace detail {

namespace {
std::mutex g_kinds_mu;
std::unordered_map<std::type_index, KindInfo>& kinds() {
  static std::unordered_map<std::type_index, KindInfo> map = [] {
    std::unordered_map<std::type_index, KindInfo> m;
    m.emplace(typeid(torch::nn::LinearImpl),
              KindInfo{ModuleKind::Linear, "torch::nn::Linear",
                       [](torch::nn::Module& x) { return dynamic_cast<torch::nn::LinearImpl&>(x).weight; },
                       [](torch::nn::Module& x) { return dynamic_cast<torch::nn::LinearImpl&>(x).bias; }});
    m.emplace(typeid(torch::nn::EmbeddingImpl),
              KindInfo{ModuleKind::Embedding, "torch::nn::Embedding",
                       [](torch::nn::Module& x) { return dynamic_cast<torch::nn::EmbeddingImpl&>(x).weight; },
                       [](torch::nn::Module&) { return at::Tensor(); }});
    return m;
  }();
  return map;
}
}  // namespace

void register_module_kind(std::type_index type, KindInfo info) {
  std::lock_guard<std::mutex> lock(g_kinds_mu);
  kinds().insert_or_assign(type, std::move(info));
}

std::optional<KindInfo> kind_of(const torch::nn::Module& m) {
  std::lock_guard<std::mutex> lock(g_kinds_mu);
  auto it = kinds().find(std::type_index(typeid(m)));
  if (it == kinds().end()) return std::nullopt;
  return it->second;
}

}  // namespace detail

namespace {

using detail::KindInfo;
using detail::ModuleKind;

const char* style_name(const ParallelStyle& s) {
  static const char* names[] = {"ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
                                "PrepareModuleOutput"};
  return names[s.index()];
}

std::vector<std::string> split_name(const std::string& name) {
  std::vector<std::string> out;
  if (name.empty()) return out;
  std::string part;
  std::istringstream in(name);
  while (std::getline(in, part, '.')) out.push_back(part);
  return out;
}

// PyTorch's rule: the pattern and the name have the same number of components, each matched by
// fnmatch ('*', '?', '[...]' within one component).
bool matches(const std::string& pattern, const std::string& name) {
  auto p = split_name(pattern), n = split_name(name);
  if (p.size() != n.size()) return false;
  for (size_t i = 0; i < p.size(); ++i) {
    if (fnmatch(p[i].c_str(), n[i].c_str(), 0) != 0) return false;
  }
  return true;
}

std::string in_quotes(const std::string& name) { return "\"" + name + "\""; }

[[noreturn]] void fail(const std::string& what) {
  throw std::invalid_argument("fsdp::tp::parallelize_module: " + what);
}

// named_parameters() returns its dict by value: it must outlive the pointer find() gives (a
// pointer into a destroyed temporary read freed memory: LibTorch 2.14 crashed in 1 run of ~10).
at::Tensor own_param(torch::nn::Module& m, const char* name) {
  const auto params = m.named_parameters(/*recurse=*/false);
  const at::Tensor* t = params.find(name);
  return t ? *t : at::Tensor();
}

// Replaces the data of `t` by its slice along `dim` in place (same tensor object: the module's
// field, its registry entry and any later fully_shard see the local tensor). blocks > 1: `dim` is
// that many equal blocks, each sliced alike, the slices concatenated (a strided placement).
void shard_in_place(const at::Tensor& t, int64_t dim, const DeviceMesh& mesh, int64_t blocks = 1) {
  const int n = static_cast<int>(mesh.size(0));
  const int64_t block = t.size(dim) / blocks;
  const int64_t size = block / n, offset = mesh.get_local_rank(0) * size;
  std::vector<int64_t> global_shape = t.sizes().vec(), local_shape = global_shape;
  local_shape[static_cast<size_t>(dim)] = size * blocks;
  at::Tensor local;
  {
    at::NoGradGuard no_grad;
    if (t.is_meta()) {
      local = at::empty(local_shape, t.options().requires_grad(false));
    } else {
      std::vector<at::Tensor> pieces;
      for (int64_t b = 0; b < blocks; ++b) pieces.push_back(t.detach().narrow(dim, b * block + offset, size));
      local = at::cat(pieces, dim).contiguous().clone();
    }
  }
  t.unsafeGetTensorImpl()->shallow_copy_from(local.getIntrusivePtr());
  detail::set_tp_placement(t, TPPlacement{mesh, dim, global_shape, offset, size, blocks});
}

// A pre-hook on a leaf's AccumulateGrad node: the gradient is all-reduced over the tp ranks
// before it accumulates (SequenceParallel's replicated parameters see part of the sequence each).
struct AllReduceGradPreHook : torch::autograd::FunctionPreHook {
  explicit AllReduceGradPreHook(std::shared_ptr<comm::Comm> comm) : comm_(std::move(comm)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    torch::autograd::variable_list out = grads;
    for (auto& g : out) {
      if (g.defined()) g = detail::all_reduce_sum(g, *comm_);
    }
    return out;
  }
  std::shared_ptr<comm::Comm> comm_;
};

// SequenceParallel's gradient all-reduce, installed on each parameter's AccumulateGrad node after a
// forward has made it (a node made earlier, e.g. on a meta parameter, would record the wrong
// device or shape) and kept alive (the leaf holds it weakly only; a new node would lack the hook).
// The tensors are the module's own (under fully_shard, the unsharded parameters forward uses).
struct GradAllReduce {
  std::shared_ptr<comm::Comm> comm;
  std::vector<at::Tensor> params;
  std::vector<std::shared_ptr<void>> nodes;  // owners of the hooked nodes
  std::vector<const void*> hooked;           // their addresses, per parameter

  void install() {
    if (!torch::GradMode::is_enabled()) return;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) continue;
      auto node = torch::autograd::impl::try_get_grad_accumulator(params[i]);
      if (!node || node.get() == hooked[i]) continue;
      node->add_pre_hook(std::make_unique<AllReduceGradPreHook>(comm));
      hooked[i] = node.get();
      nodes[i] = std::make_shared<decltype(node)>(std::move(node));
    }
  }
};

// Converts a local tensor from one layout to another (PrepareModuleInput/Output): Shard ->
// Replicate all-gathers, Replicate -> Shard slices, Shard(a) -> Shard(b) is one all-to-all.
at::Tensor convert(const at::Tensor& x, const Layout& from, const Layout& to, const std::shared_ptr<comm::Comm>& comm) {
  if (from == to) return x;
  if (from.is_shard() && to.is_shard()) return shard_to_shard(x, from.dim, to.dim, comm);
  if (from.is_shard()) return gather_replicated_along_dim(x, from.dim, comm);
  return split_along_dim(x, to.dim, comm);
}

struct Target {
  std::string fqn;
  std::shared_ptr<torch::nn::Module> module;
  const ParallelStyle* style;
  std::optional<KindInfo> kind;
};

// The checks of validate(): each fails naming `where` (the module and its style).
void need_kind(const Target& t, const std::string& where) {
  if (!t.kind) {
    fail(where + " is a " + t.module->name() + "; " + style_name(*t.style) +
         " takes Linear or Embedding modules (torch::nn::Linear/Embedding, or a type registered with "
         "fsdp::tp::register_linear_type<T>() / register_embedding_type<T>())");
  }
}

void check_divides(const at::Tensor& w, int64_t dim, const std::string& what, int64_t n, const std::string& where) {
  if (!w.defined() || w.dim() != 2) fail(where + " has no 2-D weight; a Linear or Embedding weight is [out, in]");
  if (w.size(dim) % n != 0) {
    fail(where + " has " + std::to_string(w.size(dim)) + " " + what + ", which the tp size " + std::to_string(n) +
         " does not divide; choose a tp size that divides it (or resize the layer)");
  }
}

// Shard(999) in `ok` stands for any Shard(d).
constexpr int64_t kAnyShardDim = 999;

void check_layout(const std::optional<Layout>& l, std::initializer_list<Layout> ok, const char* field,
                  const std::string& where) {
  if (!l) return;
  for (const auto& o : ok) {
    if (*l == o || (l->is_shard() && o.is_shard() && o.dim == kAnyShardDim)) return;
  }
  std::string allowed;
  for (const auto& o : ok)
    allowed += (allowed.empty() ? "" : " or ") + (o.dim == kAnyShardDim ? std::string("Shard(d)") : o.to_string());
  fail(where + ": " + field + " " + l->to_string() + " is not supported; use " + allowed);
}

void validate_fused(const Target& t, const ColwiseParallel& c, const at::Tensor& w, int64_t n,
                    const std::string& where) {
  if (c.fused < 1)
    fail(where + ": fused " + std::to_string(c.fused) +
         " is not a block count; use 1 (plain) or more (3 for a fused q|k|v)");
  if (c.fused <= 1) return;
  if (t.kind->kind != ModuleKind::Linear) fail(where + ": fused applies to a Linear only; drop it for an Embedding");
  if (c.output_layouts && !c.output_layouts->is_shard())
    fail(where + ": fused " + std::to_string(c.fused) +
         " with output_layouts Replicate() is not supported; keep Shard(-1) and split the local blocks");
  if (w.defined() && w.dim() == 2 && w.size(0) % c.fused != 0)
    fail(where + " has " + std::to_string(w.size(0)) + " output features, which do not split into " +
         std::to_string(c.fused) + " fused blocks; fix fused or the layer");
  if (w.defined() && w.dim() == 2 && (w.size(0) / c.fused) % n != 0)
    fail(where + " has fused blocks of " + std::to_string(w.size(0) / c.fused) +
         " output features, which the tp size " + std::to_string(n) +
         " does not divide; choose a tp size that divides each block (e.g. the head count)");
}

void validate_colwise(const Target& t, const ColwiseParallel& c, int64_t n, const std::string& where) {
  need_kind(t, where);
  at::Tensor w = own_param(*t.module, "weight");
  validate_fused(t, c, w, n, where);
  if (t.kind->kind == ModuleKind::Linear) {
    check_divides(w, 0, "output features", n, where);
    check_layout(c.input_layouts, {Replicate(), Shard(kAnyShardDim)}, "input_layouts", where);
  } else {
    check_divides(w, 1, "embedding dims", n, where);
    check_layout(c.input_layouts, {Replicate()}, "input_layouts", where);
  }
  check_layout(c.output_layouts, {Replicate(), Shard(-1)}, "output_layouts", where);
}

void validate_rowwise(const Target& t, const RowwiseParallel& r, int64_t n, const std::string& where) {
  need_kind(t, where);
  at::Tensor w = own_param(*t.module, "weight");
  if (t.kind->kind == ModuleKind::Linear) {
    check_divides(w, 1, "input features", n, where);
    check_layout(r.input_layouts, {Replicate(), Shard(-1)}, "input_layouts", where);
  } else {
    check_divides(w, 0, "vocabulary rows", n, where);
    check_layout(r.input_layouts, {Replicate()}, "input_layouts", where);
  }
  check_layout(r.output_layouts, {Replicate(), Shard(kAnyShardDim)}, "output_layouts", where);
}

// Everything that can be refused, before anything changes.
void validate(const Target& t, const DeviceMesh& mesh) {
  const int64_t n = mesh.size(0);
  const std::string where = in_quotes(t.fqn) + " (" + style_name(*t.style) + ")";
  if (const auto* c = std::get_if<ColwiseParallel>(t.style)) {
    validate_colwise(t, *c, n, where);
  } else if (const auto* r = std::get_if<RowwiseParallel>(t.style)) {
    validate_rowwise(t, *r, n, where);
  } else if (const auto* pi = std::get_if<PrepareModuleInput>(t.style)) {
    if (pi->input_layouts.size() != pi->desired_input_layouts.size()) {
      fail(where + ": " + std::to_string(pi->input_layouts.size()) + " input_layouts but " +
           std::to_string(pi->desired_input_layouts.size()) +
           " desired_input_layouts; give one of each per tensor argument");
    }
  } else if (const auto* po = std::get_if<PrepareModuleOutput>(t.style)) {
    if (po->output_layouts.size() != po->desired_output_layouts.size()) {
      fail(where + ": " + std::to_string(po->output_layouts.size()) + " output_layouts but " +
           std::to_string(po->desired_output_layouts.size()) +
           " desired_output_layouts; give one of each per output tensor");
    }
  }
  if (std::holds_alternative<ColwiseParallel>(*t.style) || std::holds_alternative<RowwiseParallel>(*t.style)) {
    for (const auto& p : t.module->parameters(/*recurse=*/false)) {
      if (tp_placement(p)) fail(where + " is already parallelized; apply one sharding style per module, once");
    }
  }
}

// The hooks of each style (apply() shards the parameters through these too).
fsdp::hooks::ForwardHooks colwise_hooks(const Target& t, const ColwiseParallel& c, const DeviceMesh& mesh) {
  auto comm = mesh.comm(0);
  torch::nn::Module* m = t.module.get();
  fsdp::hooks::ForwardHooks hooks;
  const Layout in = c.input_layouts.value_or(Replicate()), out = c.output_layouts.value_or(Shard(-1));
  if (t.kind->kind == ModuleKind::Linear) {
    shard_in_place(own_param(*m, "weight"), 0, mesh, c.fused);
    if (at::Tensor b = own_param(*m, "bias"); b.defined()) shard_in_place(b, 0, mesh, c.fused);
    hooks.pre = [in, comm](std::vector<at::Tensor> args) {
      if (!args.empty())
        args[0] = in.is_shard() ? gather_along_dim(args[0], in.dim, comm) : copy_to_tp_region(args[0], comm);
      return args;
    };
  } else {
    shard_in_place(own_param(*m, "weight"), 1, mesh);
  }
  if (!out.is_shard()) {
    hooks.post = [comm](std::vector<at::Tensor>& outs) {
      for (auto& o : outs) o = gather_replicated_along_dim(o, -1, comm);
    };
  }
  return hooks;
}

using ReduceFn = std::function<at::Tensor(const at::Tensor&)>;

fsdp::hooks::ForwardHooks rowwise_linear_hooks(const Target& t, const RowwiseParallel& r, const DeviceMesh& mesh,
                                               const Layout& out, const ReduceFn& reduce) {
  auto comm = mesh.comm(0);
  torch::nn::Module* m = t.module.get();
  fsdp::hooks::ForwardHooks hooks;
  const Layout in = r.input_layouts.value_or(Shard(-1));
  shard_in_place(own_param(*m, "weight"), 1, mesh);
  if (!in.is_shard()) {
    hooks.pre = [comm](std::vector<at::Tensor> args) {
      if (!args.empty()) args[0] = split_along_dim(args[0], -1, comm);
      return args;
    };
  }
  // Every rank added the (replicated) bias to its partial sum: take it out before the
  // reduction and add it once after. Under a sharded output each rank's bias gradient covers
  // its part of the sequence only, so the added bias goes through copy_to_tp_region (its
  // gradient is all-reduced); with a replicated output that gradient is already whole.
  auto bias_of = t.kind->bias;
  hooks.post = [m, bias_of, reduce, out, comm](std::vector<at::Tensor>& outs) {
    at::Tensor b = bias_of(*m);
    for (auto& y : outs) {
      if (!b.defined()) {
        y = reduce(y);
      } else {
        y = reduce(y - b) + (out.is_shard() ? copy_to_tp_region(b, comm) : b);
      }
    }
  };
  return hooks;
}

fsdp::hooks::ForwardHooks rowwise_embedding_hooks(const Target& t, const DeviceMesh& mesh, const ReduceFn& reduce) {
  fsdp::hooks::ForwardHooks hooks;
  const at::Tensor w = own_param(*t.module, "weight");
  const int64_t rows = w.size(0) / mesh.size(0), first = mesh.get_local_rank(0) * rows;
  shard_in_place(w, 0, mesh);
  // Ids outside this rank's vocabulary slice look up row 0 and are zeroed after the lookup;
  // the sum over the ranks then holds every id's row exactly once (PyTorch's MaskPartial).
  auto masks = std::make_shared<std::vector<at::Tensor>>();
  hooks.pre = [masks, rows, first](std::vector<at::Tensor> args) {
    if (args.empty()) return args;
    at::Tensor ids = args[0];
    at::Tensor outside = (ids < first).logical_or(ids >= first + rows);
    masks->push_back(outside);
    args[0] = (ids - first).masked_fill(outside, 0);
    return args;
  };
  hooks.post = [masks, reduce](std::vector<at::Tensor>& outs) {
    if (masks->empty()) return;
    at::Tensor outside = masks->back();
    masks->pop_back();
    for (auto& y : outs) y = reduce(y.masked_fill(outside.unsqueeze(-1), 0));
  };
  return hooks;
}

fsdp::hooks::ForwardHooks rowwise_hooks(const Target& t, const RowwiseParallel& r, const DeviceMesh& mesh) {
  auto comm = mesh.comm(0);
  const Layout out = r.output_layouts.value_or(Replicate());
  auto reduce = [out, comm](const at::Tensor& y) {
    return out.is_shard() ? reduce_scatter_along_dim(y, out.dim, comm) : reduce_from_tp_region(y, comm);
  };
  if (t.kind->kind == ModuleKind::Linear) return rowwise_linear_hooks(t, r, mesh, out, reduce);
  return rowwise_embedding_hooks(t, mesh, reduce);
}

fsdp::hooks::ForwardHooks sequence_parallel_hooks(const Target& t, const DeviceMesh& mesh) {
  fsdp::hooks::ForwardHooks hooks;
  auto grads = std::make_shared<GradAllReduce>();
  grads->comm = mesh.comm(0);
  grads->params = t.module->parameters(/*recurse=*/true);
  grads->nodes.resize(grads->params.size());
  grads->hooked.resize(grads->params.size(), nullptr);
  hooks.post = [grads](std::vector<at::Tensor>&) { grads->install(); };
  hooks.keep_alive = grads;
  return hooks;
}

fsdp::hooks::ForwardHooks prepare_input_hooks(const Target& t, const PrepareModuleInput& pi, const DeviceMesh& mesh) {
  fsdp::hooks::ForwardHooks hooks;
  const auto from = pi.input_layouts, to = pi.desired_input_layouts;
  const std::string fqn = t.fqn;
  hooks.pre = [from, to, comm = mesh.comm(0), fqn](std::vector<at::Tensor> args) {
    if (args.size() != from.size()) {
      throw std::invalid_argument("fsdp::tp::PrepareModuleInput: module " + in_quotes(fqn) + " was called with " +
                                  std::to_string(args.size()) + " tensor arguments but its plan gives " +
                                  std::to_string(from.size()) + " layouts; give one layout per tensor argument");
    }
    for (size_t i = 0; i < args.size(); ++i) args[i] = convert(args[i], from[i], to[i], comm);
    return args;
  };
  return hooks;
}

fsdp::hooks::ForwardHooks prepare_output_hooks(const Target& t, const PrepareModuleOutput& po, const DeviceMesh& mesh) {
  fsdp::hooks::ForwardHooks hooks;
  const auto from = po.output_layouts, to = po.desired_output_layouts;
  const std::string fqn = t.fqn;
  hooks.post = [from, to, comm = mesh.comm(0), fqn](std::vector<at::Tensor>& outs) {
    if (outs.size() != from.size()) {
      throw std::invalid_argument("fsdp::tp::PrepareModuleOutput: module " + in_quotes(fqn) + " returned " +
                                  std::to_string(outs.size()) + " tensors but its plan gives " +
                                  std::to_string(from.size()) + " layouts; give one layout per output tensor");
    }
    for (size_t i = 0; i < outs.size(); ++i) outs[i] = convert(outs[i], from[i], to[i], comm);
  };
  return hooks;
}

void apply(const Target& t, const DeviceMesh& mesh) {
  fsdp::hooks::ForwardHooks hooks;
  if (const auto* c = std::get_if<ColwiseParallel>(t.style)) {
    hooks = colwise_hooks(t, *c, mesh);
  } else if (const auto* r = std::get_if<RowwiseParallel>(t.style)) {
    hooks = rowwise_hooks(t, *r, mesh);
  } else if (std::holds_alternative<SequenceParallel>(*t.style)) {
    hooks = sequence_parallel_hooks(t, mesh);
  } else if (const auto* pi = std::get_if<PrepareModuleInput>(t.style)) {
    hooks = prepare_input_hooks(t, *pi, mesh);
  } else if (const auto* po = std::get_if<PrepareModuleOutput>(t.style)) {
    hooks = prepare_output_hooks(t, *po, mesh);
  }
  hooks.order = fsdp::hooks::HookOrder::kTensorParallel;
  fsdp::hooks::register_forward_hooks(t.module, std::move(hooks));
}

}  // namespace

void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMesh& tp_mesh,
                        const ParallelizePlan& plan) {
  if (!module) fail("the module is null");
  if (tp_mesh.ndim() != 1) {
    fail("the mesh " + tp_mesh.to_string() + " is " + std::to_string(tp_mesh.ndim()) +
         "-D; pass the 1-D tensor-parallel sub-mesh, e.g. mesh[\"tp\"]");
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named;
  for (const auto& item : module->named_modules()) named.emplace_back(item.key(), item.value());
  std::vector<Target> targets;
  std::map<const torch::nn::Module*, std::string> sharded_by;  // module -> the entry sharding it
  for (const auto& [pattern, style] : plan) {
    bool any = false;
    for (const auto& [name, m] : named) {
      if (!(pattern.empty() ? name.empty() : matches(pattern, name))) continue;
      any = true;
      targets.push_back(Target{name, m, &style, detail::kind_of(*m)});
      if (std::holds_alternative<ColwiseParallel>(style) || std::holds_alternative<RowwiseParallel>(style)) {
        auto [it, fresh] = sharded_by.emplace(m.get(), pattern);
        if (!fresh) {
          fail("module " + in_quotes(name) + " is matched by both " + in_quotes(it->second) + " and " +
               in_quotes(pattern) + "; give each module one sharding style");
        }
      }
    }
    if (!any) {
      std::string example;
      for (const auto& [name, m] : named) {
        if (!name.empty() && split_name(name).size() == split_name(pattern).size()) {
          example = name;
          break;
        }
      }
      fail("plan entry " + in_quotes(pattern) + " matches no module of " + module->name() +
           (example.empty() ? std::string("; check the name") : "; names look like " + in_quotes(example)) +
           " (fix the name, '*' matches one component)");
    }
  }
  for (const auto& t : targets) validate(t, tp_mesh);
  for (const auto& t : targets) apply(t, tp_mesh);
}

}  // namespace fsdp::tp
