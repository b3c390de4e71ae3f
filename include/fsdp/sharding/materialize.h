#pragma once
// Building models larger than one process's memory (FSDP2's meta-device initialisation):
//
// Example:
//   GPTConfig c; c.device = torch::kMeta;          // 1. construct on meta: no memory
//   GPT model(c);
//   for (auto& b : model->blocks) fsdp::fully_shard(b);
//   fsdp::fully_shard(model);                      // 2. shard: still no memory
//   fsdp::to_empty(*model, torch::kCPU);           // 3. allocate this rank's shards only
//   model->reset_parameters();                     // 4. initialise them (fsdp::init below)
//
// Initialisation must give the unsharded model's values whatever the world size, so fsdp::init
// draws a parameter's values by row, keyed by (seed, parameter name, row), on the parameter's own
// device (FSDP2's reset_parameters() after to_empty(device)): a shard draws just its rows, and
// gets exactly what the full parameter would hold there.
//  - CPU: every row from its own CPU generator.
//  - A GPU: chunks of about 1M values (whole rows, boundaries set by the full parameter's shape),
//    each from its own generator of that GPU; a rank draws the chunks its rows fall in and keeps
//    its rows. Equal to the unsharded init on the same kind of GPU (not to the CPU's values).
#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <string>

namespace fsdp {

// Gives every meta parameter and buffer of `module` uninitialised memory on `device`: a sharded
// parameter only its shard (and its unsharded form nothing until the next all-gather), any other
// tensor its full size. Call it before building the optimizer.
void to_empty(torch::nn::Module& module, c10::Device device);

namespace init {

// A parameter's stream seed, from a base seed and its name (stable across world sizes).
uint64_t param_seed(uint64_t base_seed, const std::string& name);
// Fill a full parameter, or a shard from fully_shard (its rows along ShardInfo::shard_dim), with
// the values the full parameter gets, by row, on its device.
void normal_(const at::Tensor& param, double mean, double std, uint64_t seed);
void uniform_(const at::Tensor& param, double low, double high, uint64_t seed);
void constant_(const at::Tensor& param, double value);

}  // namespace init
}  // namespace fsdp
