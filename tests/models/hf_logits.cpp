// hf_logits: our Llama's logits for Hugging Face folders, for the checks against transformers in
// tests/python/ (the other side of the comparison runs in Python).
//
//   hf_logits OUT_DIR FOLDER...               one process: the model unsharded
//   fsdprun --nproc-per-node N -- hf_logits OUT_DIR FOLDER...
//                                             N ranks: fully_shard per decoder layer then the root,
//                                             built on meta, each rank loading only its rows
//
// Each FOLDER holds config.json, the weights and reference.safetensors (its "tokens", I64 [B, T],
// as scripts/make-hf-fixtures.py writes them); rank 0 writes OUT_DIR/<folder name>.safetensors
// holding "logits" (F32 [B, T, vocab]) and prints one line per folder. Exit 1 with one line on any
// error.
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>

#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/fsdp.h"
#include "models/llama/hf.h"

namespace fs = std::filesystem;

namespace {

at::Tensor logits_for(const std::string& dir, const at::Tensor& tokens, bool sharded) {
  auto config = fsdp::models::read_hf_config(dir);
  if (sharded) config.device = torch::kMeta;
  fsdp::models::Llama model(config);
  if (sharded) {
    for (auto& layer : model->layers()) fsdp::fully_shard(layer);
    fsdp::fully_shard(model);
    fsdp::to_empty(*model, torch::kCPU);
  }
  fsdp::models::load_hf_weights(*model, dir);
  model->eval();
  torch::NoGradGuard no_grad;
  return fsdp::call(model, tokens).to(at::kFloat).contiguous();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: hf_logits OUT_DIR FOLDER... (under fsdprun for FSDP ranks)\n");
    return 2;
  }
  try {
    fsdp::dist::init_distributed();
    const int world = fsdp::dist::world_size();
    const std::string out = argv[1];
    if (fsdp::dist::rank() == 0) fs::create_directories(out);
    for (int i = 2; i < argc; ++i) {
      const std::string dir = argv[i];
      const auto tokens = fsdp::safetensors::Reader(dir + "/reference.safetensors").read("tokens");
      const auto logits = logits_for(dir, tokens, world > 1);
      if (fsdp::dist::rank() == 0) {
        const std::string name = fs::path(dir).filename().string();
        fsdp::safetensors::write_file(out + "/" + name + ".safetensors", {{"logits", logits}});
        std::printf("hf_logits: %s at %d rank%s: logits %s\n", name.c_str(), world, world > 1 ? "s (FSDP)" : "",
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
