#include "options.h"

#include "data.h"
#include "profile.h"
#include "spec.h"

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>

namespace train_gpt {

namespace {

// A number in [min, max] with a readable message ("--steps: must be a number >= 1, not '0'",
// "--layers: must be at most 10000, not '99999999999'", "--lr: must be a finite number in (0, 100],
// not 'nan'"). `integer`: whole numbers only; `open_min`: min itself is refused (--lr > 0).
// Checked on the text, before CLI11 converts it, so NaN, infinities and values beyond int64 never
// reach the trainer.
CLI::Validator bounded(double min, double max, bool integer, bool open_min = false) {
  auto num = [](double v) {
    char b[32];
    if (v >= 18446744073709551615.0) return std::string("2^64-1");  // --seed
    if (std::fabs(v) >= 1e4 && v == std::floor(v) && std::fabs(v) < 1e18) {
      std::snprintf(b, sizeof b, "%lld", static_cast<long long>(v));
    } else {
      std::snprintf(b, sizeof b, "%g", v);
    }
    return std::string(b);
  };
  const std::string range = (open_min ? "(" : "[") + num(min) + ", " + num(max) + "]";
  return CLI::Validator(
      [=](std::string& value) -> std::string {
        const std::string kind = integer ? "a whole number" : "a finite number";
        char* end = nullptr;
        errno = 0;
        const double v = std::strtod(value.c_str(), &end);
        bool parsed = !value.empty() && end == value.c_str() + value.size();
        if (integer) {  // digits only: CLI11 converts "1e3" or "2.0" to no integer
          const size_t first = value.find_first_not_of("+-") == 1 ? 1 : 0;
          parsed = parsed && value.size() > first && value.find_first_not_of("0123456789", first) == std::string::npos;
        }
        if (!parsed || !std::isfinite(v)) {
          return "must be " + kind + " in " + range + ", not '" + value + "'";
        }
        if (open_min ? !(v > min) : !(v >= min)) {
          return std::string("must be a number ") + (open_min ? "> " : ">= ") + num(min) + ", not '" + value + "'";
        }
        if (v > max) return "must be at most " + num(max) + ", not '" + value + "'";
        return {};
      },
      range);
}

// The bounds of the size options (README: "Limits"). Far beyond any model this trainer is for,
// and small enough that no product of them overflows int64 before the memory estimate
// (preflight.h) refuses what does not fit.
constexpr double kMaxCount = 1e12;  // steps, cadences

}  // namespace

namespace {

// --help's description: the trainer as it is.
std::string description() {
  std::string models;
  for (const auto& spec : model_specs()) {
    std::string summary = spec.summary;
    for (size_t at = 0; (at = summary.find('\n', at)) != std::string::npos; at += 11)
      summary.replace(at, 1, "\n          ");
    models += "  " + spec.name + std::string(spec.name.size() < 8 ? 8 - spec.name.size() : 1, ' ') + summary + "\n";
  }
  return "train_gpt: the reference FSDP trainer, in torchtitan's shape. --model picks the architecture\n"
         "(tools/train_gpt/spec.h); --init-from DIR picks it from DIR/config.json's architectures:\n" +
         models +
         "\nThe model is built on the meta device, parallelised (tensor parallel with --tp-size, activation\n"
         "checkpointing, then fully_shard: blocks, then the root; or replicate), materialised\n"
         "shard-locally (seeded, or --init-from's weights), and trained with --optimizer (AdamW by\n"
         "default; Adam, SGD, Adagrad, RMSprop, fused AdamW/Adam/SGD) under --parallel fsdp, hsdp\n"
         "(shard within groups, replicate across), replicate or none.\n\n"
         "  fsdprun --nproc-per-node N -- train_gpt [options]     N ranks (FSDP)\n"
         "  train_gpt --parallel none [options]                   one process, no process group\n\n"
         "Rank 0 prints progress, writes the metrics file (JSON lines) and the checkpoints' index.\n\n"
         "Before any work: options out of their ranges, a --data that is not a regular file, and a\n"
         "model that cannot fit the memory (estimated per rank) are refused with one line (exit 2);\n"
         "once the ranks have joined, they check that they all got the same options.\n\n"
         "SIGINT/SIGTERM: until the first step has finished (parsing, data, building and initialising\n"
         "the model, loading a checkpoint) the process exits at once with status 128+signal, nothing\n"
         "to save. After it, the ranks stop at the next step boundary, validation batch or sampled\n"
         "token, save a checkpoint and exit 0: at most one step (or batch) plus one save from the\n"
         "signal. A second signal exits at once without saving.";
}

// The data: what is read, its vocabulary and how it is decoded.
void add_data_options(CLI::App& app, Options& o) {
  app.add_option("--data", o.data,
                 "Training text read as bytes (90% train, 10% validation), or 'synthetic' "
                 "(tokens drawn from the seed, for benchmarks), or tokens:PATTERN: llm.c token shards (a file "
                 "or a glob; memory-mapped; each epoch a seeded permutation of the windows; shards named "
                 "*_val_* are the validation data unless --val-data is given), or text:FILE: a text or JSON-lines "
                 "file encoded on the fly with --tokenizer (bytes without it; documents as fsdp-tokenize reads "
                 "them; held in memory: for small corpora; 90% train, 10% validation unless --val-data)");
  app.add_option("--val-data", o.val_data,
                 "Validation data, tokens:PATTERN or text:FILE (with --data tokens:... or text:...; default: "
                 "the *_val_* shards, or text:FILE's last 10%)");
  app.add_option("--vocab-size", o.vocab_size,
                 "The GPT's vocabulary (0: from the data: 256 for bytes; for token shards the vocabulary "
                 "fsdp-tokenize recorded in them, else their largest id + 1)")
      ->check(bounded(0, 1 << 24, true));
  app.add_option("--tokenizer", o.tokenizer,
                 "A SentencePiece tokenizer.model or a Hugging Face tokenizer.json: decodes the sample of "
                 "token data, and (tokenizer.model) encodes --data text:FILE (without it, ids "
                 "are shown as <N>, or as bytes for byte-level shards)");
}

// "LlamaForCausalLM, MistralForCausalLM, ...": the config.json architectures the registry reads.
std::string hf_architectures() {
  std::string out;
  for (const auto& spec : model_specs())
    for (const auto& a : spec.hf_architectures) out += (out.empty() ? "" : ", ") + a;
  return out;
}

// The model: its architecture (--model, the registry of spec.h), a Hugging Face folder, its sizes.
void add_model_options(CLI::App& app, Options& o) {
  std::vector<std::string> names;
  for (const auto& spec : model_specs()) names.push_back(spec.name);
  std::string list;
  for (const auto& name : names) list += (list.empty() ? "" : "|") + name;
  app.add_option("--model", o.model,
                 "The architecture (described above); with --init-from, the one of its config.json's architectures")
      ->check(CLI::IsMember(names))
      ->type_name("{" + list + "}");
  app.add_option("--init-from", o.init_from,
                 "A Hugging Face folder (config.json + model.safetensors or its index; " + hf_architectures() +
                     "): architecture, size and weights from it, each rank reading "
                     "its own rows; the sizing options are then refused. With --resume and a checkpoint present, the "
                     "checkpoint wins");
  app.add_option("--layers", o.layers, "Transformer blocks")->check(bounded(1, kMaxLayers, true));
  app.add_option("--dim", o.dim, "Embedding width")->check(bounded(1, kMaxDim, true));
  app.add_option("--heads", o.heads, "Attention heads (must divide --dim)")->check(bounded(1, kMaxHeads, true));
  app.add_option("--kv-heads", o.kv_heads,
                 "--model llama, moe: key/value heads, grouped-query attention (must divide --heads; 0: --heads)")
      ->check(bounded(0, kMaxHeads, true));
  app.add_option(
         "--ffn-dim", o.ffn_dim,
         "--model llama, moe: SwiGLU width, each expert's for moe (0: 8/3 x --dim rounded up to a multiple of 8)")
      ->check(bounded(0, kMaxDim * 16, true));
  app.add_option("--experts", o.experts, "--model moe: experts per layer (default 8)")->check(bounded(1, 4096, true));
  app.add_option("--top-k", o.top_k, "--model moe: experts each token goes to (default 2)")
      ->check(bounded(1, 4096, true));
  app.add_option("--seq-len", o.seq_len, "Tokens per sequence (the model's context)")
      ->check(bounded(1, kMaxSeqLen, true));
}

// The optimisation: batch, steps, schedule, optimizer.
void add_optimization_options(CLI::App& app, Options& o) {
  app.add_option("--batch-size", o.batch_size,
                 "Global sequences per optimizer step (world size x grad-accum must divide it)")
      ->check(bounded(1, kMaxBatch, true));
  app.add_option("--grad-accum", o.grad_accum, "Micro-batches per optimizer step")->check(bounded(1, kMaxBatch, true));
  app.add_option("--steps", o.steps, "Optimizer steps in total")->check(bounded(1, kMaxCount, true));
  app.add_option("--lr", o.lr, "Peak learning rate (linear warmup, then cosine decay to lr/10)")
      ->check(bounded(0, 100, false, /*open_min=*/true));
  app.add_option("--warmup", o.warmup, "Warmup steps")->check(bounded(0, kMaxCount, true));
  app.add_option("--weight-decay", o.weight_decay, "AdamW weight decay")->check(bounded(0, 100, false));
  app.add_option("--optimizer", o.optimizer,
                 "adamw | adam | sgd (momentum 0.9) | adagrad | rmsprop, at --lr; checkpoints keep its state and "
                 "hyperparameters, so resume with the same one; fused-adamw | fused-adam | fused-sgd: the same "
                 "update in one multi-threaded pass over memory per parameter (CPU fp32 parameters; "
                 "fsdp/optim/fused.h), resuming its LibTorch twin's checkpoints and the reverse")
      ->check(CLI::IsMember({"adamw", "adam", "sgd", "adagrad", "rmsprop", "fused-adamw", "fused-adam", "fused-sgd"}));
  app.add_option("--clip", o.clip, "Clip the global gradient norm to this (0: off)")->check(bounded(0, 1e9, false));
  app.add_option("--seed", o.seed, "Seed of the initialisation, the data order and the sample")
      ->check(bounded(0, 18446744073709551615.0, true));
}

// The parallelism and the device: FSDP, HSDP, replicate, TP; precision, resharding, recomputation.
void add_parallel_options(CLI::App& app, Options& o) {
  app.add_option("--parallel", o.parallel, "fsdp | hsdp | replicate | none (one process, no process group)")
      ->check(CLI::IsMember({"fsdp", "hsdp", "replicate", "none"}));
  app.add_option("--shard-size", o.shard_size, "HSDP: ranks per shard group (0: the ranks per node)")
      ->check(bounded(0, 1e6, true));
  app.add_option("--tp-size", o.tp_size,
                 "Tensor parallel: split each block's attention heads and MLP over this many ranks (mesh "
                 "{dp = world / T, tp = T}; fully_shard over dp); must divide the world size, --heads and --dim "
                 "(--model llama: torchtitan's plan, sequence parallel and loss_parallel; must divide the heads, "
                 "KV heads, FFN width, vocabulary and --seq-len)")
      ->check(bounded(1, kMaxHeads, true));
  app.add_option("--ep-size", o.ep_size,
                 "Expert parallel over N ranks (--model moe, or --init-from a MoE folder): each rank holds 1/N of "
                 "every MoE layer's experts and tokens travel to their experts' ranks by all-to-all (mesh {dp = "
                 "world / N, ep = N}; each expert fully_shard over dp, the rest over all ranks; every rank still "
                 "trains its own slice of the batch); N must divide the world size and the experts; --parallel "
                 "fsdp, --tp-size 1 (docs/moe.md)")
      ->check(bounded(1, 4096, true));
  app.add_option("--device", o.device,
                 "cpu | cuda | auto (cuda when LibTorch has CUDA and a GPU is visible); one GPU per rank by LOCAL_RANK")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}));
  app.add_flag("--share-gpu", o.share_gpu, "Allow more ranks than GPUs on a node (collectives over Gloo)");
  app.add_option("--mixed-precision", o.mixed_precision,
                 "fp32, or bf16 (bf16 parameters and compute, fp32 gradient reduction and optimizer)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--cpu-offload", o.cpu_offload,
               "fully_shard every unit with CPUOffloadPolicy: the sharded fp32 parameters, their gradients and the "
               "optimizer state live in host memory (pinned, with --device cuda), each unit's shards copied to the "
               "device for its forward and backward, and the optimizer steps the host shards; pair it with "
               "--optimizer fused-adamw (one multi-threaded pass over memory per parameter: the fast pairing). "
               "--parallel fsdp or hsdp; on --device cpu nothing moves (the same losses as without it)");
  app.add_option("--reshard-after-forward", o.reshard_after_forward, "default (every unit but the root) | true | false")
      ->check(CLI::IsMember({"default", "true", "false"}));
  app.add_option("--activation-checkpointing", o.activation_checkpointing,
                 "none | full (recompute every block's activations in backward: less memory, one more "
                 "forward) | every:K (every K-th block)");
  app.add_option(
         "--malloc", o.malloc_policy,
         "warm (the default: fsdp::raise_malloc_thresholds, glibc's thresholds where a Python process has them: "
         "fewer pages faulted in each step for about the same peak RSS) | glibc (malloc as it starts; also: default) | "
         "tuned (fsdp::tune_malloc: freed tensors of 1 MiB+ go back to the kernel, so peak RSS follows what is "
         "alive; about 20% lower peak, 13-42% slower steps on the CPU); docs/benchmarks.md, \"The malloc policy\"")
      ->check(CLI::IsMember({"warm", "glibc", "default", "tuned"}));
}

// Checkpoints: where, how often, which to resume, how many to keep.
void add_checkpoint_options(CLI::App& app, Options& o) {
  app.add_option("--checkpoint-dir", o.checkpoint_dir,
                 "Checkpoints go to DIR/step_NNNNNN ('' : none); needs a filesystem every rank sees");
  app.add_option("--checkpoint-every", o.checkpoint_every,
                 "Save every N steps (0: only at the end and on SIGINT/SIGTERM)")
      ->check(bounded(0, kMaxCount, true));
  auto* resume = app.add_flag("--resume", o.resume,
                              "Continue from the latest committed checkpoint in --checkpoint-dir (any world size); "
                              "starts from scratch when there is none; a newer damaged one stops the run");
  app.add_option("--resume-from", o.resume_from,
                 "Continue from this checkpoint folder (e.g. DIR/step_000400, any world size), e.g. when a "
                 "newer one is damaged; excludes --resume, and fsdprun restarts resume from it again")
      ->excludes(resume);
  app.add_option("--keep-checkpoints", o.keep_checkpoints,
                 "After each save keep the newest K committed step_NNNNNN folders and delete older ones "
                 "(0: keep all); damaged, uncommitted and other folders are never deleted")
      ->check(bounded(0, kMaxCount, true));
}

// Evaluation and output: validation, the sample, metrics, the profiler, --eval-only, --export-hf.
void add_output_options(CLI::App& app, Options& o) {
  app.add_option("--eval-every", o.eval_every, "Validation loss every N steps and at the end (0: never)")
      ->check(bounded(0, kMaxCount, true));
  app.add_option("--eval-batches", o.eval_batches, "Global batches per validation")->check(bounded(1, 1e6, true));
  app.add_option("--sample-tokens", o.sample_tokens, "Bytes of text sampled at the end (0: none)")
      ->check(bounded(0, 1e6, true));
  app.add_option("--metrics", o.metrics, "Metrics file, JSON lines written by rank 0 ('' : none)");
  add_profile_options(app, o.profile_steps, o.profile_dir);
  app.add_flag("--eval-only", o.eval_only,
               "Validation loss of the model as built (--init-from, a checkpoint with --resume/--resume-from, or "
               "the seeded initialisation) on --eval-batches global batches, printed as 'val ...' and written to "
               "the metrics file as val_loss; no training, no checkpoint");
  app.add_option("--export-hf", o.export_hf,
                 "An architecture read from Hugging Face folders (--model llama, --init-from): at the end of "
                 "training write a Hugging Face folder (config.json, safetensors, "
                 "and --init-from's generation_config.json and tokenizer files) that transformers loads");
  app.add_option("--export-dtype", o.export_dtype, "fp32 | bf16: the dtype of --export-hf's files")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--allow-nonfinite-weights", o.allow_nonfinite_weights,
               "--init-from: load weights holding NaN or Inf as they are (by default refused, naming the first "
               "such tensor)");
}

}  // namespace

std::optional<Options> parse_options(int argc, char** argv, int& exit_code) {
  Options o;
  CLI::App app{description(), "train_gpt"};
  app.get_formatter()->column_width(34);
  app.option_defaults()->always_capture_default();
  add_data_options(app, o);
  add_model_options(app, o);
  add_optimization_options(app, o);
  add_parallel_options(app, o);
  add_checkpoint_options(app, o);
  add_output_options(app, o);
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
  for (const char* name :
       {"--layers", "--dim", "--heads", "--kv-heads", "--ffn-dim", "--vocab-size", "--experts", "--top-k"})
    if (app.count(name) > 0) o.sizing_given.push_back(name);
  o.model_given = app.count("--model") > 0;
  exit_code = 0;
  return o;
}

void validate(const Options& o) {
  auto fail = [](const std::string& msg) { throw std::invalid_argument(msg); };
  check_profile_steps(o.profile_steps, o.steps);
  if (o.dim % o.heads != 0) {
    fail("--heads " + std::to_string(o.heads) + " does not divide --dim " + std::to_string(o.dim));
  }
  if (o.batch_size % o.grad_accum != 0) {
    fail("--grad-accum " + std::to_string(o.grad_accum) + " does not divide --batch-size " +
         std::to_string(o.batch_size));
  }
  if (o.resume && o.checkpoint_dir.empty()) fail("--resume needs a --checkpoint-dir");
  if (o.mixed_precision == "bf16" && (o.parallel == "none" || o.parallel == "replicate")) {
    fail(
        "--mixed-precision bf16 needs fully_shard's MixedPrecisionPolicy: use --parallel fsdp or hsdp (under "
        "fsdprun, any number of ranks)");
  }
  if (o.cpu_offload && (o.parallel == "none" || o.parallel == "replicate")) {
    fail("--cpu-offload needs fully_shard's CPUOffloadPolicy: --parallel " + o.parallel +
         " keeps whole parameters on the device (use --parallel fsdp or hsdp, or drop --cpu-offload)");
  }
  if (o.reshard_after_forward != "default" && (o.parallel == "none" || o.parallel == "replicate")) {
    fail("--reshard-after-forward " + o.reshard_after_forward + " needs fully_shard: --parallel " + o.parallel +
         " keeps whole parameters on every rank (drop the option, or use --parallel fsdp or hsdp)");
  }
  if (o.ep_size > 1) {
    const std::string ep = "--ep-size " + std::to_string(o.ep_size);
    if (o.tp_size > 1)
      fail(ep + " with --tp-size " + std::to_string(o.tp_size) +
           ": expert and tensor parallelism do not compose yet; drop one");
    if (o.init_from.empty() && o.experts % o.ep_size != 0)
      fail(ep + " does not divide --experts " + std::to_string(o.experts) +
           " (each rank holds experts / ep of every layer); choose an ep size that divides the experts");
    if (o.parallel != "fsdp")
      fail(ep +
           " needs --parallel fsdp (experts sharded over the data-parallel ranks of their expert group), not "
           "--parallel " +
           o.parallel);
  }
  if (o.tp_size > 1) {
    if (o.parallel == "none")
      fail("--tp-size " + std::to_string(o.tp_size) +
           " needs ranks: run under fsdprun with --parallel fsdp (or --tp-size 1)");
    if (o.parallel != "fsdp")
      fail("--tp-size > 1 with --parallel " + o.parallel +
           " is not supported yet; use --parallel fsdp (FSDP over dp, TP over tp)");
    if (o.heads % o.tp_size != 0 && o.init_from.empty())
      fail("--tp-size " + std::to_string(o.tp_size) + " does not divide --heads " + std::to_string(o.heads) +
           " (each tp rank takes whole heads); choose a tp size that divides the head count");
    if (o.dim % o.tp_size != 0 && o.init_from.empty())
      fail("--tp-size " + std::to_string(o.tp_size) + " does not divide --dim " + std::to_string(o.dim));
  }
  if (!o.init_from.empty() && !o.sizing_given.empty()) {
    std::string given;
    for (const auto& name : o.sizing_given) given += (given.empty() ? "" : ", ") + name;
    fail("--init-from takes the model's size from " + o.init_from + "/config.json: drop " + given);
  }
  for (const auto& name : o.sizing_given)
    if ((name == "--experts" || name == "--top-k") && o.init_from.empty() && o.model != "moe")
      fail(name + " sizes --model moe only (--model " + o.model + " has no experts): add --model moe or drop " + name);
  if (!o.export_hf.empty() && o.eval_only)
    fail("--export-hf writes the trained model at the end of training: drop it with --eval-only");
  o.checkpoint_every_kth_block();                              // throws on a bad --activation-checkpointing
  if (!o.synthetic() && !o.tokens()) check_data_file(o.data);  // stat only: a FIFO or device is refused unopened
}

int64_t Options::checkpoint_every_kth_block() const {
  const std::string& a = activation_checkpointing;
  if (a == "none") return 0;
  if (a == "full") return 1;
  if (a.rfind("every:", 0) == 0 && a.size() > 6 && a.find_first_not_of("0123456789", 6) == std::string::npos &&
      a.size() < 16 && std::stoll(a.substr(6)) >= 1) {
    return std::stoll(a.substr(6));
  }
  throw std::invalid_argument("--activation-checkpointing '" + a +
                              "' is not none, full or every:K with K >= 1 (e.g. every:2 checkpoints blocks 2, 4, ...)");
}

void validate_for_world(const Options& o, int world_size) {
  if (world_size % o.ep_size != 0) {
    throw std::invalid_argument("--ep-size " + std::to_string(o.ep_size) + " does not divide the world size " +
                                std::to_string(world_size) + "; start a multiple of it (fsdprun --nproc-per-node)");
  }
  if (world_size % o.tp_size != 0) {
    throw std::invalid_argument("--tp-size " + std::to_string(o.tp_size) + " does not divide the world size " +
                                std::to_string(world_size) + "; start a multiple of it (fsdprun --nproc-per-node)");
  }
  // Under TP the tp ranks of one dp group train the same sequences: the batch splits over dp only.
  const int64_t dp = world_size / o.tp_size, parts = dp * o.grad_accum;
  if (o.batch_size % parts != 0) {
    throw std::invalid_argument("--batch-size " + std::to_string(o.batch_size) + " is not divisible by " +
                                (o.tp_size > 1 ? "the data-parallel size " : "world size ") + std::to_string(dp) +
                                " x --grad-accum " + std::to_string(o.grad_accum) + " = " + std::to_string(parts));
  }
}

}  // namespace train_gpt
