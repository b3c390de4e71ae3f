#pragma once
// The mixture-of-experts fixtures of scripts/make-moe-fixtures.py (tests/models/fixtures, see its
// README) as test_moe_hf, test_moe_ep and test_moe_train_ref read them: the folders, their
// reference.safetensors (transformers' logits, loss and auxiliary loss on fixed tokens), the loss
// as transformers computes it with labels, and the model loaded whole or at EP x FSDP.
// The including target defines FSDP_HF_FIXTURES (tests/models/CMakeLists.txt).
#include <cmath>
#include <string>
#include <vector>

#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/fsdp.h"
#include "models/moe/hf_moe.h"

namespace fsdp::testing::moe_fixture {

inline const std::vector<std::string> kFixtures = {"mixtral_tied", "mixtral_untied_sharded", "qwen3_moe_untied",
                                                   "qwen3_moe_sparse_step"};

inline std::string fixture(const std::string& name) { return std::string(FSDP_HF_FIXTURES) + "/" + name; }

struct Reference {
  at::Tensor tokens, logits;
  double loss, aux_loss;
};
inline Reference reference(const std::string& dir) {
  fsdp::safetensors::Reader r(dir + "/reference.safetensors");
  return {r.read("tokens"), r.read("logits"), r.read("loss").item<double>(), r.read("aux_loss").item<double>()};
}

// max |ours - theirs| / max |theirs|.
inline double rel_diff(const at::Tensor& ours, const at::Tensor& theirs) {
  return (ours - theirs).abs().max().item<double>() / theirs.abs().max().item<double>();
}

// transformers' loss with labels = tokens: logits and labels shifted by one.
inline at::Tensor shifted_loss(fsdp::models::MoECausalLM& model, const at::Tensor& logits, const at::Tensor& tokens) {
  const int64_t T = tokens.size(1);
  return model->loss(logits.narrow(1, 0, T - 1), tokens.narrow(1, 1, T - 1));
}

struct Diffs {
  double logits, loss, aux;
};
// Our logits, loss and auxiliary loss on the reference's tokens against transformers'.
inline Diffs compare(fsdp::models::MoECausalLM& model, const Reference& ref) {
  torch::NoGradGuard no_grad;
  const auto logits = fsdp::call(model, ref.tokens);
  const double loss = shifted_loss(model, logits, ref.tokens).item<double>();
  const double aux = model->aux_loss().item<double>();
  return {rel_diff(logits, ref.logits), std::abs(loss - ref.loss) / std::abs(ref.loss),
          std::abs(aux - ref.aux_loss) / std::abs(ref.aux_loss)};
}

inline fsdp::models::MoECausalLM load_unsharded(const std::string& dir) {
  fsdp::models::MoECausalLM model(fsdp::models::read_moe_config(dir));
  fsdp::models::load_moe_weights(*model, dir);
  return model;
}

// The torchtitan layout on a {dp, ep} mesh: each expert a unit over mesh["dp"] (the ranks holding
// the same experts), its gradient summed there and divided by the world size (each expert's
// gradient already sums the ep group's tokens); layers and root over all ranks.
inline fsdp::models::MoECausalLM load_ep_fsdp(const std::string& dir, const fsdp::DeviceMesh& mesh) {
  auto c = fsdp::models::read_moe_config(dir);
  c.set_expert_parallel(mesh);
  c.base.device = torch::kMeta;
  fsdp::models::MoECausalLM model(c);
  for (auto& layer : model->layers()) {
    if (layer->moe) {
      for (auto& expert : layer->moe->experts->local)
        fsdp::fully_shard(expert, {.mesh = mesh["dp"]}).set_gradient_divide_factor(static_cast<double>(mesh.size()));
    }
    fsdp::fully_shard(layer);
  }
  fsdp::fully_shard(model);
  fsdp::to_empty(*model, torch::kCPU);
  fsdp::models::load_moe_weights(*model, dir);
  return model;
}

}  // namespace fsdp::testing::moe_fixture
