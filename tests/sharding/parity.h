#pragma once
// Parity harness: the same GPT trained by one process on the global batch and by N sharded ranks
// on their slices of it.
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "models/gpt.h"

namespace fsdp::testing {

// Dimensions that 2 and 3 do not divide (vocab 67, 11 positions, 20-wide rows, MLP 80).
models::GPTConfig uneven_config();

struct TrainResult {
  std::vector<double> losses;                    // global mean loss per optimizer step
  std::map<std::string, at::Tensor> parameters;  // final full parameters (reference only)
  models::GPT model{nullptr};                    // the trained sharded model (sharded runs only)
  double state_bytes = 0;                        // parameters + grads + optimizer state, this rank
};

// Batch of optimizer step `step`, micro-batch `micro` (the same on every rank): [B, T+1] tokens.
at::Tensor global_batch(const models::GPTConfig& c, int64_t batch, int step, int micro);

// One process, the whole global batch, AdamW; `micro_batches` accumulate into one step.
// `prepare` (optional) changes the fresh model first, as the sharded run's `shard` does before
// fully_shard (frozen parameters).
TrainResult train_reference(const models::GPTConfig& c, int steps, int64_t batch, int micro_batches,
                            const std::function<void(models::GPT&)>& prepare = {});

// Applies fully_shard to a fresh model (the caller decides how), then trains with this rank's
// slice of every global batch. `before_step(step, model)` may change settings per step.
struct ShardedRun {
  std::function<void(models::GPT&)> shard;
  std::function<void(int micro, int micro_batches, models::GPT&)> before_micro_batch;
  std::function<at::Tensor(models::GPT&, const at::Tensor&)> forward;  // default: fsdp::call(model, x)
  std::function<void(models::GPT&)> zero_grad;  // before each step; default: the optimizer's zero_grad()
};
TrainResult train_sharded(const models::GPTConfig& c, int steps, int64_t batch, int micro_batches,
                          const ShardedRun& run);

// Largest elementwise |shard - reference| / max(|reference|, 1) over every shard of `model` against
// the full reference parameters. Throws naming the parameter if above `tolerance`.
double check_shards_match(models::GPT& model, const std::map<std::string, at::Tensor>& reference, double tolerance);
// The same for unsharded parameters (fsdp::replicate): whole parameters against the reference.
double check_full_params_match(models::GPT& model, const std::map<std::string, at::Tensor>& reference,
                               double tolerance);
void check_losses_match(const std::vector<double>& got, const std::vector<double>& want, double tolerance);

// A FullyShardOptions::shard_placement_fn: matrices along their last dim, the rest along dim 0.
std::optional<int64_t> last_dim_of_matrices(const std::string& name, const at::Tensor& param);

// The model and optimizer both parity runs start from (seed 42; AdamW, see parity.cpp on eps).
models::GPT parity_model(const models::GPTConfig& c);
torch::optim::AdamW parity_optimizer(torch::nn::Module& model);

// Parameters + gradients + optimizer state bytes of a model and its AdamW.
double training_state_bytes(torch::nn::Module& model, torch::optim::AdamW& optimizer);

}  // namespace fsdp::testing
