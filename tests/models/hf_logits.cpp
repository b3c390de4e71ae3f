// hf_logits: our Llama's logits for Hugging Face folders, for the checks against transformers in
// tests/python/ (the other side of the comparison runs in Python).
//
//   hf_logits OUT_DIR FOLDER...               one process: the model unsharded
//   fsdprun --nproc-per-node N -- hf_logits OUT_DIR FOLDER...
//                                             N ranks: fully_shard per decoder layer then the root,
//                                             built on meta, each rank loading only its rows
//   fsdprun --nproc-per-node N -- hf_logits --tp-size T OUT_DIR FOLDER...
//                                             dp N/T x tp T, as train_gpt --tp-size composes them:
//                                             models/llama/llama_tp.h's plan over "tp" on meta, then
//                                             fully_shard over "dp"; the logits (split over the
//                                             vocabulary by lm_head) gathered over tp
//
// Each FOLDER holds config.json, the weights and reference.safetensors (its "tokens", I64 [B, T],
// as scripts/make-hf-fixtures.py writes them); rank 0 writes OUT_DIR/<folder name>.safetensors
// holding "logits" (F32 [B, T, vocab]) and prints one line per folder. A mixture-of-experts folder
// (MixtralForCausalLM, Qwen3MoeForCausalLM: models/moe/) gives our MoECausalLM's logits, and
// "loss" (F32 [1]: the shifted cross-entropy plus router_aux_loss_coef x the load-balancing loss,
// transformers' loss with labels = tokens and output_router_logits=True) and "aux_loss"; it runs
// unsharded or under fully_shard, not under --tp-size. Exit 1 with one line on any error.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/fsdp.h"
#include "fsdp/mesh/device_mesh.h"
#include "fsdp/tensor_parallel/comm_functions.h"
#include "models/llama/hf.h"
#include "models/llama/llama_tp.h"
#include "models/moe/hf_moe.h"

namespace fs = std::filesystem;

namespace {

// `mesh`: {"dp", "tp"} under --tp-size, else unset (FSDP over all ranks when `sharded`).
at::Tensor logits_for(const std::string& dir, const at::Tensor& tokens, bool sharded,
                      const std::optional<fsdp::DeviceMesh>& mesh) {
  auto config = fsdp::models::read_hf_config(dir);
  if (sharded) config.device = torch::kMeta;
  fsdp::models::Llama model(config);
  if (mesh) fsdp::models::parallelize_llama(model, (*mesh)["tp"]);  // on meta, before fully_shard
  if (sharded) {
    fsdp::FullyShardOptions so;
    if (mesh) so.mesh = (*mesh)["dp"];
    for (auto& layer : model->layers()) fsdp::fully_shard(layer, so);
    fsdp::fully_shard(model, so);
    fsdp::to_empty(*model, torch::kCPU);
  }
  fsdp::models::load_hf_weights(*model, dir);
  model->eval();
  torch::NoGradGuard no_grad;
  at::Tensor logits = fsdp::call(model, tokens).to(at::kFloat).contiguous();
  // lm_head is column-wise under TP: each tp rank holds a slice of the vocabulary.
  if (mesh) logits = fsdp::tp::gather_replicated_along_dim(logits, 2, (*mesh)["tp"].comm()).contiguous();
  return logits;
}

// A MoE folder: logits, loss and auxiliary loss, unsharded or FSDP over every rank.
std::map<std::string, at::Tensor> moe_outputs_for(const std::string& dir, const at::Tensor& tokens, bool sharded) {
  auto config = fsdp::models::read_moe_config(dir);
  if (sharded) config.base.device = torch::kMeta;
  fsdp::models::MoECausalLM model(config);
  if (sharded) {
    for (auto& layer : model->layers()) fsdp::fully_shard(layer);
    fsdp::fully_shard(model);
    fsdp::to_empty(*model, torch::kCPU);
  }
  fsdp::models::load_moe_weights(*model, dir);
  model->eval();
  torch::NoGradGuard no_grad;
  const at::Tensor logits = fsdp::call(model, tokens).to(at::kFloat).contiguous();
  const int64_t T = tokens.size(1);
  const at::Tensor loss = model->loss(logits.narrow(1, 0, T - 1), tokens.narrow(1, 1, T - 1));
  return {{"logits", logits}, {"loss", loss.reshape({1})}, {"aux_loss", model->aux_loss().reshape({1})}};
}

}  // namespace

int main(int argc, char** argv) {
  int first = 1;
  int64_t tp_size = 1;
  if (argc > 2 && std::string(argv[1]) == "--tp-size") {
    tp_size = std::atoll(argv[2]);
    first = 3;
  }
  if (argc < first + 2 || tp_size < 1) {
    std::fprintf(stderr,
                 "usage: hf_logits [--tp-size T] OUT_DIR FOLDER... (under fsdprun for FSDP ranks; T >= 1 divides "
                 "the world size)\n");
    return 2;
  }
  try {
    fsdp::dist::init_distributed();
    const int world = fsdp::dist::world_size();
    if (world % tp_size != 0) {
      throw std::invalid_argument("--tp-size " + std::to_string(tp_size) + " does not divide the world size " +
                                  std::to_string(world) + ": run under fsdprun with a multiple of it");
    }
    std::optional<fsdp::DeviceMesh> mesh;
    if (tp_size > 1) mesh = fsdp::init_device_mesh({world / tp_size, tp_size}, {"dp", "tp"});
    const std::string out = argv[first];
    if (fsdp::dist::rank() == 0) fs::create_directories(out);
    const std::string layout =
        tp_size > 1 ? "s (dp " + std::to_string(world / tp_size) + " x tp " + std::to_string(tp_size) + ")"
        : world > 1 ? "s (FSDP)"
                    : "";
    for (int i = first + 1; i < argc; ++i) {
      const std::string dir = argv[i];
      const auto tokens = fsdp::safetensors::Reader(dir + "/reference.safetensors").read("tokens");
      std::map<std::string, at::Tensor> outputs;
      if (fsdp::models::is_moe_folder(dir)) {
        if (mesh) throw std::invalid_argument(dir + ": a mixture-of-experts folder runs without --tp-size");
        outputs = moe_outputs_for(dir, tokens, world > 1);
      } else {
        outputs = {{"logits", logits_for(dir, tokens, world > 1, mesh)}};
      }
      const at::Tensor& logits = outputs.at("logits");
      if (fsdp::dist::rank() == 0) {
        const std::string name = fs::path(dir).filename().string();
        std::vector<fsdp::safetensors::NamedTensor> tensors;
        for (const auto& [key, t] : outputs) tensors.push_back({key, t});
        fsdp::safetensors::write_file(out + "/" + name + ".safetensors", tensors);
        std::printf("hf_logits: %s at %d rank%s: logits %s\n", name.c_str(), world, layout.c_str(),
                    c10::str(logits.sizes()).c_str());
      }
    }
    fsdp::dist::destroy_distributed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_logits: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
