#pragma once
// train_gpt's command line (CLI11). Names are a contract: scripts, tests and the README use them.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace train_gpt {

// The default corpus: plain English text from Debian's `fortunes` package (scripts/setup.sh
// installs it), so the README's first command works offline on a fresh machine.
inline constexpr const char* kDefaultCorpus = "/usr/share/games/fortunes/cookie";

// Bounds of the size options (--help shows them; the memory estimate of preflight.h refuses what
// does not fit well before them). Far beyond the models this trainer is for, and small enough
// that no product of them overflows int64.
inline constexpr int64_t kMaxLayers = 10000;
inline constexpr int64_t kMaxDim = 65536;
inline constexpr int64_t kMaxHeads = 4096;
inline constexpr int64_t kMaxSeqLen = 1 << 20;
inline constexpr int64_t kMaxBatch = 1 << 20;  // --batch-size, --grad-accum

// Options, e.g. `train_gpt --layers 6 --dim 256 --heads 8 --batch-size 32 --steps 2000`.
// Example: Options o; o.layers = 6; o.dim = 256; validate(o);
struct Options {
  // data and model
  std::string data = kDefaultCorpus;  // a file read as bytes, "synthetic", or "tokens:PATTERN" (llm.c shards)
  std::string val_data;               // tokens:PATTERN ("": the shards of --data named *_val_*)
  int64_t vocab_size = 0;             // 0: from the data (256 for bytes; main() resolves it, data.h)
  std::string tokenizer;              // SentencePiece tokenizer.model: decodes the sample of token shards
  std::string model = "gpt";          // --model: an architecture of spec.h's registry (--init-from: its config.json's)
  int64_t layers = 4;
  int64_t dim = 128;
  int64_t heads = 4;
  int64_t kv_heads = 0;  // llama: key/value heads (grouped-query attention); 0: --heads
  int64_t ffn_dim = 0;   // llama: the SwiGLU width; 0: 8/3 x --dim rounded up to a multiple of 8
  int64_t experts = 8;   // moe: experts per sparse layer
  int64_t top_k = 2;     // moe: experts each token goes to
  int64_t seq_len = 128;
  // A Hugging Face folder (config.json + safetensors): the architecture, size and weights come
  // from it (main() fills layers, dim, heads, kv_heads, ffn_dim and vocab_size from config.json).
  std::string init_from;
  // The sizing options given on the command line (--layers, --dim, ...): --init-from refuses them.
  std::vector<std::string> sizing_given;
  bool model_given = false;  // --model on the command line
  // optimisation
  int64_t batch_size = 16;  // global sequences per optimizer step
  int64_t grad_accum = 1;
  int64_t steps = 600;
  double lr = 3e-3;
  int64_t warmup = 20;
  double weight_decay = 0.1;
  std::string optimizer = "adamw";  // adamw | adam | sgd | adagrad | rmsprop | fused-adamw | fused-adam | fused-sgd
  double clip = 1.0;                // 0: no clipping
  uint64_t seed = 0;
  // parallelism
  std::string parallel = "fsdp";         // fsdp | hsdp | replicate | none
  int64_t shard_size = 0;                // HSDP: ranks per shard group (0: the ranks per node)
  int64_t tp_size = 1;                   // tensor parallel ranks per dp group (mesh {"dp", "tp"}; README)
  int64_t ep_size = 1;                   // expert parallel ranks (mesh {"dp", "ep"}; --model moe; docs/moe.md)
  std::string device = "auto";           // cpu | cuda | auto (cuda when a GPU is visible)
  bool share_gpu = false;                // more ranks than GPUs: share them (Gloo on CUDA tensors)
  std::string mixed_precision = "fp32";  // fp32 | bf16
  bool cpu_offload = false;  // fully_shard with CPUOffloadPolicy: shards, gradients, optimizer state on the host
  std::string reshard_after_forward = "default";  // default | true | false
  std::string activation_checkpointing = "none";  // none | full | every:K (every K-th block)
  std::string malloc_policy = "warm";  // warm (raise_malloc_thresholds) | glibc (or default) | tuned (tune_malloc)
  // checkpoints, evaluation, output
  std::string checkpoint_dir = "runs/train_gpt/checkpoints";  // "": no checkpoints
  int64_t checkpoint_every = 100;                             // 0: only at the end and on SIGINT/SIGTERM
  bool resume = false;
  std::string resume_from;       // a checkpoint folder to continue from ("": --resume decides)
  int64_t keep_checkpoints = 0;  // keep the newest K committed step_* folders (0: all)
  int64_t eval_every = 50;       // 0: never
  int64_t eval_batches = 4;
  int64_t sample_tokens = 300;
  std::string metrics = "runs/train_gpt/metrics.jsonl";  // "": none
  std::string profile_steps;                             // --profile-steps A:B ("": off; profile.h)
  std::string profile_dir;                               // --profile-dir ("": the metrics file's folder)
  bool eval_only = false;  // validation loss on --eval-batches global batches; no training, no checkpoint
  // Written at the end of training: a Hugging Face folder (config.json, safetensors, and the
  // --init-from folder's generation_config.json and tokenizer files). Architectures with a
  // Hugging Face form only (spec.h).
  std::string export_hf;
  std::string export_dtype = "fp32";     // fp32 | bf16: the exported files' dtype
  bool allow_nonfinite_weights = false;  // --init-from: load NaN/Inf weights as they are (refused by default)

  bool synthetic() const { return data == "synthetic"; }
  // Token data: shards (tokens:PATTERN) or a text file encoded on the fly (text:FILE).
  bool tokens() const { return data.rfind("tokens:", 0) == 0 || data.rfind("text:", 0) == 0; }
  int64_t resolved_kv_heads() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t resolved_ffn_dim() const { return ffn_dim > 0 ? ffn_dim : (8 * dim / 3 + 7) / 8 * 8; }
  // --activation-checkpointing as "checkpoint every K-th block": 0 for none, 1 for full.
  int64_t checkpoint_every_kth_block() const;
};

// Parses argv. Prints --help / errors itself and returns the exit code in `exit_code` when the
// program should stop (0 after --help, 2 after a bad command line).
std::optional<Options> parse_options(int argc, char** argv, int& exit_code);

// Checks that need no process group (ranges, heads | dim, the data file). Throws
// std::invalid_argument with a one-line message.
void validate(const Options& o);
// Checks that need the world size (the global batch splits into ranks x micro-batches).
void validate_for_world(const Options& o, int world_size);

}  // namespace train_gpt
