#include "models/moe/moe.h"

#include <stdexcept>
#include <string>

#include "fsdp/expert_parallel/expert_parallel.h"
#include "fsdp/sharding/call.h"
#include "fsdp/sharding/materialize.h"

namespace fsdp::models {

namespace F = torch::nn::functional;

std::vector<int64_t> Grouped::splits() const {
  const at::Tensor c = counts.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

Grouped group_tokens(const at::Tensor& hidden, const at::Tensor& topk_idx, int64_t num_experts) {
  TORCH_CHECK(hidden.dim() == 2 && topk_idx.dim() == 2 && topk_idx.size(0) == hidden.size(0),
              "group_tokens: expected hidden [T, D] and topk_idx [T, k], got ", hidden.sizes(), " and ",
              topk_idx.sizes());
  const int64_t k = topk_idx.size(1);
  const at::Tensor flat = topk_idx.reshape({-1}).to(at::kLong);
  Grouped g;
  // Stable: within an expert, tokens in order (as transformers' torch.where over its mask).
  g.slot = std::get<1>(flat.sort(/*stable=*/true, /*dim=*/0, /*descending=*/false));
  g.token_index = at::div(g.slot, k, "floor");
  g.tokens = hidden.index_select(0, g.token_index);
  g.counts = at::bincount(flat, {}, num_experts);
  return g;
}

at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& topk_weight, const Grouped& grouped) {
  const at::Tensor w = topk_weight.reshape({-1}).index_select(0, grouped.slot);
  // In the weights' dtype, then back (transformers: output * weight, .to(the hidden dtype)).
  const at::Tensor weighted = (expert_out * w.unsqueeze(1)).to(expert_out.scalar_type());
  return at::zeros({topk_weight.size(0), expert_out.size(1)}, expert_out.options())
      .index_add(0, grouped.token_index, weighted);
}

Routing route(const at::Tensor& logits, int64_t top_k, bool renormalise, bool weights_in_float32) {
  Routing r;
  r.logits = logits;
  const at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);
  auto [top, idx] = probs.topk(top_k, -1);
  if (renormalise) top = top / top.sum(-1, /*keepdim=*/true);
  r.weights = weights_in_float32 ? top : top.to(logits.scalar_type());
  r.indices = idx;
  return r;
}

at::Tensor load_balancing_loss(const std::vector<at::Tensor>& router_logits, int64_t num_experts, int64_t top_k) {
  if (router_logits.empty()) return at::zeros({}, at::kFloat);
  const at::Tensor logits = at::cat(router_logits, 0);
  const at::Tensor probs = at::softmax(logits, -1);
  const at::Tensor selected = std::get<1>(probs.topk(top_k, -1));
  const at::Tensor mask = at::one_hot(selected, num_experts).to(probs.scalar_type());  // [N, k, E]
  const at::Tensor tokens_per_expert = mask.mean(0);                                   // [k, E]
  const at::Tensor prob_per_expert = probs.mean(0);                                    // [E]
  return (tokens_per_expert * prob_per_expert.unsqueeze(0)).sum() * static_cast<double>(num_experts);
}

MoEExpertImpl::MoEExpertImpl(const MoEConfig& c) {
  const int64_t D = c.base.hidden_size, I = c.moe_intermediate_size;
  const bool m = c.mixtral();
  gate = register_module(m ? "w1" : "gate_proj", Linear(D, I, false, c.base.device));
  up = register_module(m ? "w3" : "up_proj", Linear(D, I, false, c.base.device));
  down = register_module(m ? "w2" : "down_proj", Linear(I, D, false, c.base.device));
}

torch::Tensor MoEExpertImpl::forward(const torch::Tensor& x) {
  return fsdp::call(down, F::silu(fsdp::call(gate, x)) * fsdp::call(up, x));
}

MoEExpertsImpl::MoEExpertsImpl(const MoEConfig& c) : first(c.local_experts_first) {
  for (int64_t i = 0; i < c.local_count(); ++i)
    local.push_back(register_module(std::to_string(first + i), MoEExpert(c)));
}

SparseMoeBlockImpl::SparseMoeBlockImpl(const MoEConfig& c)
    : num_experts(c.num_experts),
      top_k(c.num_experts_per_tok),
      renormalise(c.norm_topk_prob),
      weights_in_float32(c.mixtral()) {
  gate = register_module("gate", Linear(c.base.hidden_size, c.num_experts, false, c.base.device));
  experts = register_module("experts", MoEExperts(c));
  if (c.expert_parallel()) ep = c.ep;
}

torch::Tensor SparseMoeBlockImpl::run_experts(const at::Tensor& rows, const std::vector<int64_t>& counts) {
  auto& local = experts->local;
  TORCH_CHECK(counts.size() == local.size(), "SparseMoeBlock::run_experts: ", counts.size(), " counts for ",
              local.size(), " local experts");
  std::vector<at::Tensor> outs;
  int64_t offset = 0;
  for (size_t e = 0; e < local.size(); ++e) {
    outs.push_back(fsdp::call(local[e], rows.narrow(0, offset, counts[e])));
    offset += counts[e];
  }
  return at::cat(outs, 0);
}

torch::Tensor SparseMoeBlockImpl::forward(const torch::Tensor& x) {
  const at::Tensor h = x.reshape({-1, x.size(-1)});
  router_logits = fsdp::call(gate, h);
  const Routing r = route(router_logits, top_k, renormalise, weights_in_float32);
  if (ep) {  // the rows of this rank's experts from every rank of the group, and back
    const fsdp::ep::Dispatched d = fsdp::ep::dispatch(h, r.indices, num_experts, *ep);
    return fsdp::ep::combine(run_experts(d.tokens, d.counts), r.weights, d).view(x.sizes());
  }
  // Without expert parallelism every expert must be here.
  if (static_cast<int64_t>(experts->local.size()) != num_experts)
    throw std::invalid_argument("SparseMoeBlock: this process holds experts [" + std::to_string(experts->first) + ", " +
                                std::to_string(experts->first + static_cast<int64_t>(experts->local.size())) + ") of " +
                                std::to_string(num_experts) +
                                "; run it under expert parallelism (fsdp::ep dispatches the other experts' tokens) "
                                "or build it with all experts (MoEConfig::local_experts_count 0)");
  const Grouped g = group_tokens(h, r.indices, num_experts);
  return combine(run_experts(g.tokens, g.splits()), r.weights, g).view(x.sizes());
}

MoEDecoderLayerImpl::MoEDecoderLayerImpl(const MoEConfig& c, int64_t index) {
  self_attn = register_module("self_attn", LlamaAttention(c.base));
  if (c.is_sparse_layer(index))
    moe = register_module(c.mixtral() ? "block_sparse_moe" : "mlp", SparseMoeBlock(c));
  else
    mlp = register_module("mlp", LlamaMLP(c.base));
  const auto& b = c.base;
  input_layernorm = register_module("input_layernorm", RMSNorm(b.hidden_size, b.rms_norm_eps, b.device));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(b.hidden_size, b.rms_norm_eps, b.device));
}

torch::Tensor MoEDecoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto h = x + fsdp::call(self_attn, fsdp::call(input_layernorm, x), cos, sin);
  auto y = fsdp::call(post_attention_layernorm, h);
  return h + (moe ? fsdp::call(moe, y) : fsdp::call(mlp, y));
}

MoEModelImpl::MoEModelImpl(const MoEConfig& c)
    : DecoderModelImpl(c.base, [&c](int64_t i) { return MoEDecoderLayer(c, i); }) {}

MoECausalLMImpl::MoECausalLMImpl(const MoEConfig& c) : config(c) {
  c.validate();
  model = register_module("model", MoEModel(c));
  if (!c.base.tie_word_embeddings)
    lm_head = register_module("lm_head", Linear(c.base.hidden_size, c.base.vocab_size, false, c.base.device));
  inv_freq = rope_inv_freq(c.base);
  if (c.base.device.type() != torch::kMeta) reset_parameters();
}

void MoECausalLMImpl::reset_parameters() { reset_decoder_parameters(*this, config.base); }

torch::Tensor MoECausalLMImpl::encode(const torch::Tensor& idx) {
  return model->encode(idx, inv_freq, config.base, config.base.architecture);
}

torch::Tensor MoECausalLMImpl::forward(const torch::Tensor& idx) { return model->head(encode(idx), lm_head); }

torch::Tensor MoECausalLMImpl::aux_loss() const {
  std::vector<at::Tensor> logits;
  for (const auto& layer : model->layers)
    if (layer->moe && layer->moe->router_logits.defined()) logits.push_back(layer->moe->router_logits);
  return load_balancing_loss(logits, config.num_experts, config.num_experts_per_tok);
}

torch::Tensor MoECausalLMImpl::loss(const torch::Tensor& logits, const torch::Tensor& targets) const {
  const auto lm = F::cross_entropy(logits.reshape({-1, logits.size(-1)}).to(at::kFloat), targets.reshape({-1}));
  return lm + config.router_aux_loss_coef * aux_loss().to(lm.device());
}

}  // namespace fsdp::models
