#include "options.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

namespace train_gpt {

namespace {

// ">= min" with a readable message ("--steps: must be at least 1, not 0").
CLI::Validator at_least(double min) {
  char desc[32];
  std::snprintf(desc, sizeof desc, ">=%g", min);
  return CLI::Validator(
      [min](std::string& value) -> std::string {
        try {
          size_t used = 0;
          const double v = std::stod(value, &used);
          if (used == value.size() && v >= min) return {};
        } catch (const std::exception&) {
        }
        char msg[96];
        std::snprintf(msg, sizeof msg, "must be a number >= %g, not '%s'", min, value.c_str());
        return msg;
      },
      desc);
}

}  // namespace

std::optional<Options> parse_options(int argc, char** argv, int& exit_code) {
  Options o;
  CLI::App app{
      "train_gpt: the reference FSDP trainer. A byte-level GPT built on the meta device, sharded with\n"
      "fully_shard (blocks, then the root), materialised shard-locally, trained with AdamW.\n\n"
      "  fsdprun --nproc-per-node N -- train_gpt [options]     N ranks (FSDP)\n"
      "  train_gpt --parallel none [options]                   one process, no process group\n\n"
      "Rank 0 prints progress, writes the metrics file (JSON lines) and the checkpoints' index;\n"
      "SIGINT/SIGTERM save a checkpoint at the next step boundary and exit 0.",
      "train_gpt"};
  app.get_formatter()->column_width(34);
  app.option_defaults()->always_capture_default();

  app.add_option("--data", o.data, "Training text read as bytes (90% train, 10% validation), or 'synthetic' "
                                   "(tokens drawn from the seed, for benchmarks)");
  app.add_option("--layers", o.layers, "Transformer blocks")->check(at_least(1));
  app.add_option("--dim", o.dim, "Embedding width")->check(at_least(1));
  app.add_option("--heads", o.heads, "Attention heads (must divide --dim)")->check(at_least(1));
  app.add_option("--seq-len", o.seq_len, "Tokens per sequence (the model's context)")->check(at_least(1));
  app.add_option("--batch-size", o.batch_size,
                 "Global sequences per optimizer step (world size x grad-accum must divide it)")
      ->check(at_least(1));
  app.add_option("--grad-accum", o.grad_accum, "Micro-batches per optimizer step")->check(at_least(1));
  app.add_option("--steps", o.steps, "Optimizer steps in total")->check(at_least(1));
  app.add_option("--lr", o.lr, "Peak learning rate (linear warmup, then cosine decay to lr/10)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "Warmup steps")->check(at_least(0));
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->check(at_least(0));
  app.add_option("--clip", o.clip, "Clip the global gradient norm to this (0: off)")->check(at_least(0));
  app.add_option("--seed", o.seed, "Seed of the initialisation, the data order and the sample");
  app.add_option("--parallel", o.parallel, "fsdp | hsdp | replicate | none (one process, no process group)")
      ->check(CLI::IsMember({"fsdp", "hsdp", "replicate", "none"}));
  app.add_option("--shard-size", o.shard_size, "HSDP: ranks per shard group (0: the ranks per node)")
      ->check(at_least(0));
  app.add_option("--device", o.device,
                 "cpu | cuda | auto (cuda when LibTorch has CUDA and a GPU is visible); one GPU per rank by LOCAL_RANK")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_flag("--share-gpu", o.share_gpu, "Allow more ranks than GPUs on a node (collectives over Gloo)");
  app.add_option("--mixed-precision", o.mixed_precision,
                 "fp32, or bf16 (bf16 parameters and compute, fp32 gradient reduction and optimizer)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--reshard-after-forward", o.reshard_after_forward,
                 "default (every unit but the root) | true | false")
      ->check(CLI::IsMember({"default", "true", "false"}));
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "Checkpoints go to DIR/step_NNNNNN ('' : none); needs a filesystem every rank sees");
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "Save every N steps (0: only at the end and on SIGINT/SIGTERM)")
      ->check(at_least(0));
  app.add_flag("--resume", o.resume,
               "Continue from the latest committed checkpoint in --checkpoint-dir (any world size); "
               "starts from scratch when there is none");
  app.add_option("--eval-every", o.eval_every, "Validation loss every N steps and at the end (0: never)")
      ->check(at_least(0));
  app.add_option("--eval-batches", o.eval_batches, "Global batches per validation")->check(at_least(1));
  app.add_option("--sample-tokens", o.sample_tokens, "Bytes of text sampled at the end (0: none)")
      ->check(at_least(0));
  app.add_option("--metrics", o.metrics, "Metrics file, JSON lines written by rank 0 ('' : none)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    exit_code = app.exit(e);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    // One line, like every other error of the trainer.
    std::string msg = e.what();
    for (auto& c : msg) {
      if (c == '\n') c = ' ';
    }
    std::fprintf(stderr, "train_gpt: error: %s (see --help)\n", msg.c_str());
    exit_code = 2;
    return std::nullopt;
  }
  exit_code = 0;
  return o;
}

void validate(const Options& o) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  if (o.dim % o.heads != 0) {
    fail("--heads " + std::to_string(o.heads) + " does not divide --dim " + std::to_string(o.dim));
  }
  if (o.batch_size % o.grad_accum != 0) {
    fail("--grad-accum " + std::to_string(o.grad_accum) + " does not divide --batch-size " +
         std::to_string(o.batch_size));
  }
  if (o.resume && o.checkpoint_dir.empty()) fail("--resume needs a --checkpoint-dir");
  if (!o.synthetic()) {
    std::ifstream f(o.data, std::ios::binary);
    if (!f) {
      fail("cannot read data file '" + o.data + "'" +
           (o.data == kDefaultCorpus ? " (the default corpus: run scripts/setup.sh, or apt-get install fortunes)"
                                     : " (give a readable text file, or --data synthetic)"));
    }
  }
}

void validate_for_world(const Options& o, int world_size) {
  const int64_t parts = static_cast<int64_t>(world_size) * o.grad_accum;
  if (o.batch_size % parts != 0) {
    throw std::invalid_argument("--batch-size " + std::to_string(o.batch_size) + " is not divisible by world size " +
                                std::to_string(world_size) + " x --grad-accum " + std::to_string(o.grad_accum) +
                                " = " + std::to_string(parts));
  }
}

}  // namespace train_gpt
