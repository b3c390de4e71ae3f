#include "tp_model.h"

#include <algorithm>
#include <cmath>

#include "models/tensor_parallel.h"

namespace fsdp::testing {

namespace F = torch::nn::functional;

TPAttentionImpl::TPAttentionImpl(const TPModelConfig& c) : head_dim(c.dim / c.heads) {
  q = register_module("q", models::Linear(c.dim, c.dim, true, c.device));
  k = register_module("k", models::Linear(c.dim, c.dim, true, c.device));
  v = register_module("v", models::Linear(c.dim, c.dim, true, c.device));
  o = register_module("o", models::Linear(c.dim, c.dim, true, c.device));
}

torch::Tensor TPAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1);
  // The local heads: q's width / head_dim (all heads in one process, heads / tp under TP).
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, -1, head_dim}).transpose(1, 2); };
  auto qh = heads(fsdp::call(q, x)), kh = heads(fsdp::call(k, x)), vh = heads(fsdp::call(v, x));
  auto att = torch::matmul(qh, kh.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(head_dim)));
  auto causal = torch::ones({T, T}, x.options().dtype(torch::kBool)).tril();
  att = F::softmax(att.masked_fill(causal.logical_not(), -INFINITY), F::SoftmaxFuncOptions(-1));
  auto y = torch::matmul(att, vh).transpose(1, 2).contiguous().view({B, T, -1});
  return fsdp::call(o, y);
}

TPMLPImpl::TPMLPImpl(const TPModelConfig& c) {
  fc = register_module("fc", models::Linear(c.dim, c.hidden, true, c.device));
  proj = register_module("proj", models::Linear(c.hidden, c.dim, true, c.device));
}

torch::Tensor TPMLPImpl::forward(const torch::Tensor& x) {
  return fsdp::call(proj, torch::gelu(fsdp::call(fc, x), "tanh"));
}

TPBlockImpl::TPBlockImpl(const TPModelConfig& c) {
  ln1 = register_module("ln1", models::LayerNorm(c.dim, c.device));
  attn = register_module("attn", TPAttention(c));
  ln2 = register_module("ln2", models::LayerNorm(c.dim, c.device));
  mlp = register_module("mlp", TPMLP(c));
}

torch::Tensor TPBlockImpl::forward(const torch::Tensor& x) {
  auto y = x + fsdp::call(attn, fsdp::call(ln1, x));
  return y + fsdp::call(mlp, fsdp::call(ln2, y));
}

TPEmbedImpl::TPEmbedImpl(const TPModelConfig& c) {
  wte = register_module("wte", models::Embedding(c.vocab, c.dim, c.device));
  wpe = register_module("wpe", models::Embedding(c.seq, c.dim, c.device));
}

torch::Tensor TPEmbedImpl::forward(const torch::Tensor& idx) {
  auto pos = torch::arange(idx.size(1), idx.options().dtype(torch::kLong));
  return fsdp::call(wte, idx) + wpe(pos);
}

TPModelImpl::TPModelImpl(const TPModelConfig& c) : config(c) {
  models::register_tp_module_types();
  embed = register_module("embed", TPEmbed(c));
  blocks = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.layers; ++i) {
    typed_blocks.emplace_back(c);
    blocks->push_back(typed_blocks.back());
  }
  ln_f = register_module("ln_f", models::LayerNorm(c.dim, c.device));
  head = register_module("head", models::Linear(c.dim, c.vocab, false, c.device));
  if (c.device.type() != torch::kMeta) reset_parameters();
}

torch::Tensor TPModelImpl::forward(const torch::Tensor& idx) {
  auto x = fsdp::call(embed, idx);
  for (auto& b : typed_blocks) x = fsdp::call(b, x);
  return fsdp::call(head, fsdp::call(ln_f, x));
}

void TPModelImpl::reset_parameters() {
  for (const auto& item : named_parameters()) {
    const std::string& name = item.key();
    const bool is_bias = name.size() >= 4 && name.compare(name.size() - 4, 4, "bias") == 0;
    const bool is_norm = name.find("ln") != std::string::npos;
    const uint64_t seed = fsdp::init::param_seed(config.seed, name);
    // Norms and biases drawn too (not constants), so a wrong slice of them shows.
    if (is_norm && !is_bias)
      fsdp::init::uniform_(item.value(), 0.8, 1.2, seed);
    else if (is_bias)
      fsdp::init::uniform_(item.value(), -0.1, 0.1, seed);
    else
      fsdp::init::normal_(item.value(), 0.0, 0.3, seed);
  }
}

tp::ParallelizePlan tp_plan(bool sequence_parallel, bool loss_parallel) {
  using namespace fsdp::tp;
  const Layout head_out = loss_parallel ? Shard(-1) : Replicate();
  if (!sequence_parallel) {
    return {
        {"embed.wte", RowwiseParallel{}},         {"blocks.*.attn.q", ColwiseParallel{}},
        {"blocks.*.attn.k", ColwiseParallel{}},   {"blocks.*.attn.v", ColwiseParallel{}},
        {"blocks.*.attn.o", RowwiseParallel{}},   {"blocks.*.mlp.fc", ColwiseParallel{}},
        {"blocks.*.mlp.proj", RowwiseParallel{}}, {"head", ColwiseParallel{.output_layouts = head_out}},
    };
  }
  return {
      {"embed.wte", RowwiseParallel{}},
      {"embed", PrepareModuleOutput{.output_layouts = {Replicate()}, .desired_output_layouts = {Shard(1)}}},
      {"blocks.*.ln1", SequenceParallel{}},
      {"blocks.*.ln2", SequenceParallel{}},
      {"blocks.*.attn", PrepareModuleInput{.input_layouts = {Shard(1)}, .desired_input_layouts = {Replicate()}}},
      {"blocks.*.attn.q", ColwiseParallel{}},
      {"blocks.*.attn.k", ColwiseParallel{}},
      {"blocks.*.attn.v", ColwiseParallel{}},
      {"blocks.*.attn.o", RowwiseParallel{.output_layouts = Shard(1)}},
      {"blocks.*.mlp.fc", ColwiseParallel{.input_layouts = Shard(1)}},
      {"blocks.*.mlp.proj", RowwiseParallel{.output_layouts = Shard(1)}},
      {"ln_f", SequenceParallel{}},
      {"head", ColwiseParallel{.input_layouts = Shard(1), .output_layouts = head_out}},
  };
}

at::Tensor global_batch(const TPModelConfig& c, int step, int64_t batch, uint64_t seed_base) {
  auto gen = at::detail::createCPUGenerator(seed_base + static_cast<uint64_t>(step));
  return at::randint(c.vocab, {batch, c.seq + 1}, gen, at::kLong);
}

torch::optim::AdamW make_optimizer(torch::nn::Module& m) {
  return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1).eps(1e-3));
}

at::Tensor train_step(TPModel& model, torch::optim::Optimizer& opt, const at::Tensor& batch, int64_t dp_rank,
                      int64_t dp_size) {
  const int64_t seq = model->config.seq, rows = batch.size(0) / dp_size;
  at::Tensor x = batch.narrow(1, 0, seq).narrow(0, dp_rank * rows, rows);
  at::Tensor y = batch.narrow(1, 1, seq).narrow(0, dp_rank * rows, rows).contiguous();
  opt.zero_grad();
  at::Tensor loss = F::cross_entropy(fsdp::call(model, x).view({-1, model->config.vocab}), y.reshape(-1));
  loss.backward();
  fsdp::clip_grad_norm_(model->parameters(), 0.5);
  opt.step();
  return loss.detach();
}

double rel_diff(double got, double want) { return std::abs(got - want) / std::max(1.0, std::abs(want)); }

std::map<std::string, at::Tensor> snapshot(TPModel& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& item : model->named_parameters()) out[item.key()] = item.value().detach().clone();
  return out;
}

std::optional<tp::TPPlacement> tp_placement_of(const at::Tensor& param) {
  if (auto info = fsdp::shard_info(param)) return info->tp;
  return tp::tp_placement(param);
}

at::Tensor expected_local(const at::Tensor& param, const at::Tensor& full) {
  at::Tensor want = full;
  if (auto placement = tp_placement_of(param)) {
    std::vector<at::Tensor> pieces;
    for (int64_t b = 0; b < placement->blocks; ++b) {
      pieces.push_back(full.narrow(placement->dim, b * placement->block_len() + placement->offset, placement->size));
    }
    want = pieces.size() == 1 ? pieces[0] : at::cat(pieces, placement->dim);
  }
  if (auto info = fsdp::shard_info(param)) want = want.narrow(info->shard_dim, info->dim0_offset, info->local_rows);
  return want;
}

double max_param_diff(TPModel& model, const std::map<std::string, at::Tensor>& reference, double tol, bool gather) {
  double worst = 0;
  for (const auto& item : model->named_parameters()) {
    const at::Tensor& p = item.value();
    const at::Tensor& full = reference.at(item.key());
    if (auto placement = tp_placement_of(p)) {
      TORCH_CHECK(placement->global_shape == full.sizes().vec(), item.key(), ": placement's global shape ",
                  c10::IntArrayRef(placement->global_shape), " vs ", full.sizes());
    }
    const at::Tensor want = expected_local(p, full);
    TORCH_CHECK(p.sizes() == want.sizes(), item.key(), ": local shape ", p.sizes(), " vs expected ", want.sizes());
    const double d = p.numel() == 0 ? 0.0 : (p.detach() - want).abs().max().item<double>();
    TORCH_CHECK(d <= tol, item.key(), " differs by ", d);
    worst = std::max(worst, d);
    if (gather) {
      at::Tensor gathered = tp::gather_full(p);
      const double g = (gathered - full).abs().max().item<double>();
      TORCH_CHECK(g <= tol, item.key(), " gathered differs by ", g);
    }
  }
  return worst;
}

}  // namespace fsdp::testing
