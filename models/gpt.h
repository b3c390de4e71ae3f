#pragma once
// A small GPT (token + position embeddings, pre-LN blocks with causal self-attention and a GELU
// MLP, final LayerNorm, linear head) in plain LibTorch, used by the tests, the benchmark and the
// trainer. The only FSDP-specific line is `fsdp::call(block, x)` in GPTImpl::forward, which is
// exactly block->forward(x) when the block is not sharded.
//
// Its layers take a device, so the whole model can be built on torch::kMeta (no memory), sharded,
// then materialised shard by shard (fsdp::to_empty + reset_parameters). LibTorch's own
// torch::nn::Linear & co. always allocate on the CPU in their constructors, which a model larger
// than one process's memory cannot afford.
#include <torch/torch.h>

#include <vector>

namespace fsdp::models {

struct GPTConfig {
  int64_t vocab_size = 256;  // byte-level
  int64_t block_size = 128;  // longest sequence
  int64_t n_layer = 4;
  int64_t n_head = 4;
  int64_t n_embd = 256;
  bool tie_weights = false;  // head shares the token embedding (GPT-2 style)
  double dropout = 0.0;      // residual dropout in every block while training (0: none, no RNG drawn)
  // Attention through LibTorch's fused scaled_dot_product_attention where this LibTorch has it
  // (fsdp::compat::kHasFusedAttention: 2.x; on a GPU that is FlashAttention); false, or on 1.13:
  // the written-out softmax(QK^T / sqrt(d), causal mask) V. Same numbers within fp32 rounding.
  bool fused_attention = true;
  torch::Device device = torch::kCPU;  // torch::kMeta: build without memory, initialise later
  uint64_t init_seed = 0;              // reset_parameters' seed (same values for any sharding)
  void validate() const;               // throws std::invalid_argument naming the bad field
};

// y = x W^T + b, parameters created on a given device.
struct LinearImpl : torch::nn::Module {
  LinearImpl(int64_t in, int64_t out, bool bias, torch::Device device);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
};
TORCH_MODULE(Linear);

struct EmbeddingImpl : torch::nn::Module {
  EmbeddingImpl(int64_t num, int64_t dim, torch::Device device);
  torch::Tensor forward(const torch::Tensor& idx);
  torch::Tensor weight;
};
TORCH_MODULE(Embedding);

struct LayerNormImpl : torch::nn::Module {
  LayerNormImpl(int64_t dim, torch::Device device);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight, bias;
};
TORCH_MODULE(LayerNorm);

struct CausalSelfAttentionImpl : torch::nn::Module {
  explicit CausalSelfAttentionImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  Linear c_attn{nullptr}, c_proj{nullptr};
  int64_t n_head;
  bool fused = false;  // config.fused_attention && this LibTorch has the fused op
};
TORCH_MODULE(CausalSelfAttention);

struct MLPImpl : torch::nn::Module {
  explicit MLPImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  Linear c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(MLP);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c);
  torch::Tensor forward(const torch::Tensor& x);
  LayerNorm ln_1{nullptr}, ln_2{nullptr};
  CausalSelfAttention attn{nullptr};
  MLP mlp{nullptr};
  double dropout = 0.0;
};
TORCH_MODULE(Block);

// The output projection. With tied weights it registers the token embedding's tensor as its own
// parameter (one tensor, two registry entries), as GPT-2 does.
struct HeadImpl : torch::nn::Module {
  HeadImpl(int64_t n_embd, int64_t vocab_size, torch::Device device, const torch::Tensor& tied_weight = {});
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;
};
TORCH_MODULE(Head);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c);
  // idx: [B, T] int64 token ids -> logits [B, T, vocab]
  torch::Tensor forward(const torch::Tensor& idx);
  // Entry points besides forward; on a sharded model call them through fsdp::call_method
  // (fsdp/sharding/forward_method.h). encode: the final hidden states [B, T, n_embd] (after ln_f,
  // an encoder-only pass); next_token_logits: the last position's logits [B, vocab] (sampling).
  torch::Tensor encode(const torch::Tensor& idx);
  torch::Tensor next_token_logits(const torch::Tensor& idx);
  // Weights as GPT-2 initialises them: N(0, 0.02), zero biases, unit LayerNorm. Drawn row by row
  // from streams keyed by (init_seed, parameter name, row) (fsdp::init), so a sharded model
  // initialises its shards to exactly the values of the unsharded model.
  void reset_parameters();

  GPTConfig config;
  Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h{nullptr};
  std::vector<Block> blocks;  // the same modules as h, typed
  LayerNorm ln_f{nullptr};
  Head lm_head{nullptr};
};
TORCH_MODULE(GPT);

// Mean cross-entropy of next-token prediction.
torch::Tensor gpt_loss(const torch::Tensor& logits, const torch::Tensor& targets);

}  // namespace fsdp::models
