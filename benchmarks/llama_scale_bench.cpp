// A Llama at scale on CPU: loading a Hugging Face folder into FSDP (peak RSS per rank against the
// bound a rank should meet) and training a Llama (step time, losses, peak RSS), one process or FSDP.
// Run by hand (never in CI); docs/benchmarks.md, "Llama at scale", has the figures and commands.
//
//   # the folder: scripts/make-tinyllama-shards.py /var/tmp/tinyllama-1.1b (random bf16, 1.1B)
//   fsdprun --nproc-per-node 2 -- llama_scale_bench --role load --hf /var/tmp/tinyllama-1.1b
//   fsdprun --nproc-per-node 2 -- llama_scale_bench --role train --hf /var/tmp/tinyllama-1.1b \
//       --seq 512 --batch 1 --steps 4 --warmup 0 --ac --fixed-batch --lr 1e-4
//   llama_scale_bench --role train --plain --layers 12 --hidden 768 ... --result FILE   # one process
//
// --role load: the model is built on the meta device, fully_shard per decoder layer then the root;
// the RSS is read (before), this rank's fp32 shards allocated (fsdp::to_empty) and
// load_hf_weights reads this rank's rows. Each rank prints its peak RSS (VmHWM) and the bound:
// (RSS before + its fp32 shard bytes + the read buffer) x 1.05, where the read buffer is the
// loader's one staging tensor: the largest shard of one tensor in the file's dtype.
//
// --role train: the Llama from --hf DIR (its config and weights) or from the shape options (random
// init, fsdp::init), fully_shard per decoder layer then the root (--plain: none, one process: the
// limit a rank's share of the work has), activation checkpointing on every decoder layer with
// --ac, AdamW (--lr, LibTorch's defaults otherwise), fp32. Per step (timed): zero_grad, forward,
// cross-entropy, backward, optimizer step, loss.item(), on --batch sequences of --seq random tokens
// per rank (a fresh batch every step from the rank's stream 1234 + rank, as bench and
// benchmarks/fsdp2_cpu_bench.py; --fixed-batch: the first batch every step, so that the loss
// falls visibly). Rank 0 prints every step and appends "median_step_s S first_loss L last_loss L
// params P world N peak_rss_bytes B" to --result; every rank prints its peak RSS.
#include <cmath>

#include "bench_support.h"
#include "models/llama/hf.h"

namespace {

using fsdp::models::Llama;
using fsdp::models::LlamaConfig;

struct Options {
  std::string role, hf, result;
  int64_t layers = 12, hidden = 768, heads = 12, kv_heads = 4, ffn = 2048, vocab = 32000;
  int64_t seq = 256, batch = 2, steps = 4, warmup = 1;
  std::string lr = "1e-3";
  bool plain = false, ac = false, fixed_batch = false;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "llama_scale_bench",
      "usage: llama_scale_bench --role load|train [--hf DIR] [--plain] [--ac] [--fixed-batch] [--lr 1e-3]\n"
      "         [--layers 12 --hidden 768 --heads 12 --kv-heads 4 --ffn 2048 --vocab 32000]\n"
      "         [--seq 256 --batch 2 (per rank) --steps 4 --warmup 1] [--result FILE]\n"
      "       (sharded roles under fsdprun; --role load needs --hf)");
  args.option("--role", &o.role).option("--hf", &o.hf).option("--result", &o.result).option("--lr", &o.lr);
  args.option("--layers", &o.layers).option("--hidden", &o.hidden).option("--heads", &o.heads);
  args.option("--kv-heads", &o.kv_heads).option("--ffn", &o.ffn).option("--vocab", &o.vocab);
  args.option("--seq", &o.seq).option("--batch", &o.batch).option("--steps", &o.steps).option("--warmup", &o.warmup);
  args.flag("--plain", &o.plain).flag("--ac", &o.ac).flag("--fixed-batch", &o.fixed_batch);
  args.parse(argc, argv);
  if (o.role != "load" && o.role != "train") args.fail("--role takes load or train, got '" + o.role + "'");
  if (o.role == "load" && (o.hf.empty() || o.plain)) args.fail("--role load needs --hf DIR and no --plain");
  if (o.steps < 1 || o.warmup < 0 || o.seq < 1 || o.batch < 1) args.fail("--steps, --seq, --batch must be >= 1");
  try {
    if (std::stod(o.lr) <= 0) throw std::invalid_argument("");
  } catch (const std::exception&) {
    args.fail("--lr takes a positive number, got '" + o.lr + "'");
  }
  return o;
}

void barrier() { fsdp::dist::world_comm()->barrier(); }

double gib(double bytes) { return bytes / double(1 << 30); }

// The config: the folder's, or the shape options'.
LlamaConfig config_of(const Options& o) {
  if (!o.hf.empty()) return fsdp::models::read_hf_config(o.hf);
  LlamaConfig c;
  c.vocab_size = o.vocab;
  c.hidden_size = o.hidden;
  c.intermediate_size = o.ffn;
  c.num_hidden_layers = o.layers;
  c.num_attention_heads = o.heads;
  c.num_key_value_heads = o.kv_heads;
  c.max_position_embeddings = std::max<int64_t>(o.seq, 2048);
  c.rms_norm_eps = 1e-5;
  c.validate();
  return c;
}

std::string describe(const LlamaConfig& c, int64_t params) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "Llama %lld layers, hidden %lld, %lld heads / %lld KV heads, ffn %lld, vocab %lld: %.3fB params",
                (long long)c.num_hidden_layers, (long long)c.hidden_size, (long long)c.num_attention_heads,
                (long long)c.num_key_value_heads, (long long)c.intermediate_size, (long long)c.vocab_size,
                double(params) / 1e9);
  return buf;
}

// Bytes per element of the folder's weights (config.json's torch_dtype), for the read buffer.
int64_t file_element_size(const LlamaConfig& c) {
  return c.torch_dtype == "bfloat16" || c.torch_dtype == "float16" ? 2 : 4;
}

// The model on the meta device, (activation checkpointing,) fully_shard per layer then the root
// unless plain, then this rank's parameters allocated on the CPU. Returns the parameter count.
int64_t build(Llama& model, const LlamaConfig& config, bool plain, bool ac) {
  LlamaConfig c = config;
  c.device = torch::kMeta;
  model = Llama(c);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  if (ac)
    fsdp::activation::apply_activation_checkpointing(
        *model, fsdp::activation::every_kth<fsdp::models::LlamaDecoderLayerImpl>(1));
  if (!plain) {
    for (auto& layer : model->layers()) fsdp::fully_shard(layer);
    fsdp::fully_shard(model);
  }
  return params;
}

int run_load(const Options& o) {
  const auto place = fsdp_bench::join_world(true);
  const LlamaConfig config = config_of(o);
  Llama model{nullptr};
  const int64_t params = build(model, config, /*plain=*/false, /*ac=*/false);
  double shard_bytes = 0;
  int64_t largest = 0;
  for (const auto& p : model->parameters()) {  // meta shards: their sizes, no memory
    shard_bytes += double(p.numel()) * 4;
    largest = std::max<int64_t>(largest, p.numel());
  }
  const double buffer = double(largest * file_element_size(config));
  const double rss_before = fsdp_bench::resident_bytes();
  fsdp_bench::Stopwatch watch;
  fsdp::to_empty(*model, torch::kCPU);
  fsdp::models::load_hf_weights(*model, o.hf);
  const double seconds = watch.wall();
  const double hwm = fsdp_bench::vm_hwm_bytes(), bound = (rss_before + shard_bytes + buffer) * 1.05;
  barrier();
  if (place.rank == 0)
    std::printf("llama_scale_bench load: %s from %s at %d ranks (%s)\n", describe(config, params).c_str(), o.hf.c_str(),
                place.world, config.torch_dtype.c_str());
  barrier();
  for (int r = 0; r < place.world; ++r) {
    if (r == place.rank) {
      std::printf(
          "rank %d: load %.1f s; RSS before %.3f GiB + fp32 shard %.3f GiB + read buffer %.3f GiB (largest shard of "
          "one tensor, %s) = %.3f GiB, +5%% bound %.3f GiB; peak RSS (VmHWM) %.3f GiB (%.3f GiB over the RSS before): "
          "%s\n",
          place.rank, seconds, gib(rss_before), gib(shard_bytes), gib(buffer), config.torch_dtype.c_str(),
          gib(rss_before + shard_bytes + buffer), gib(bound), gib(hwm), gib(hwm - rss_before),
          hwm <= bound ? "met" : "NOT met");
      std::fflush(stdout);
    }
    barrier();
  }
  fsdp::dist::destroy_distributed();
  return hwm <= bound ? 0 : 3;
}

int run_train(const Options& o) {
  const auto place = fsdp_bench::join_world(!o.plain);
  const LlamaConfig config = config_of(o);
  Llama model{nullptr};
  fsdp_bench::Stopwatch setup;
  const int64_t params = build(model, config, o.plain, o.ac);
  fsdp::to_empty(*model, torch::kCPU);
  if (o.hf.empty())
    model->reset_parameters();  // fsdp::init: the same values at any world size
  else
    fsdp::models::load_hf_weights(*model, o.hf);
  const double setup_s = setup.wall();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(std::stod(o.lr)));
  auto gen = fsdp_bench::token_stream(place.rank);
  auto next = [&] { return at::randint(config.vocab_size, {o.batch, o.seq + 1}, gen, at::kLong); };
  const at::Tensor fixed = next();
  if (place.rank == 0)
    std::printf(
        "llama_scale_bench train: %s; %s; seq %lld, batch %lld per rank, fp32, %s attention%s, AdamW lr %s; "
        "%s batch; setup %.1f s\n",
        describe(config, params).c_str(),
        o.plain ? "one process" : ("FSDP " + std::to_string(place.world) + " ranks").c_str(), (long long)o.seq,
        (long long)o.batch, model->layers()[0]->self_attn->fused ? "fused" : "written-out",
        o.ac ? ", activation checkpointing every layer" : "", o.lr.c_str(),
        o.fixed_batch ? "the same" : "a fresh random", setup_s);
  std::vector<double> times;
  double first_loss = NAN, last_loss = NAN;
  for (int64_t s = 0; s < o.warmup + o.steps; ++s) {
    const at::Tensor data = o.fixed_batch ? fixed : next();
    fsdp_bench::Stopwatch step;
    opt.zero_grad();
    auto input = data.narrow(1, 0, o.seq);
    auto logits = o.plain ? model->forward(input) : fsdp::call(model, input);
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, o.seq));
    loss.backward();
    opt.step();
    const double value = loss.item<double>();
    const double wall = step.wall();
    if (std::isnan(first_loss)) first_loss = value;
    last_loss = value;
    if (s >= o.warmup) times.push_back(wall);
    if (place.rank == 0) {
      std::printf("step %lld%s: loss %.4f, %.2f s, peak RSS %.2f GiB\n", (long long)s, s < o.warmup ? " (warm-up)" : "",
                  value, wall, gib(fsdp_bench::vm_hwm_bytes()));
      std::fflush(stdout);
    }
  }
  const double hwm = fsdp_bench::vm_hwm_bytes();
  if (!o.plain) barrier();
  for (int r = 0; r < place.world; ++r) {
    if (r == place.rank) {
      std::printf("rank %d: median step %.3f s, first loss %.4f, last loss %.4f, peak RSS (VmHWM) %.3f GiB\n", r,
                  fsdp_bench::median(times), first_loss, last_loss, gib(hwm));
      std::fflush(stdout);
    }
    if (!o.plain) barrier();
  }
  if (place.rank == 0 && !o.result.empty()) {
    std::ofstream out(o.result, std::ios::app);
    char line[256];
    std::snprintf(line, sizeof(line),
                  "median_step_s %.6f first_loss %.6f last_loss %.6f params %lld world %d peak_rss_bytes %.0f\n",
                  fsdp_bench::median(times), first_loss, last_loss, (long long)params, place.world, hwm);
    out << line;
  }
  if (!o.plain) fsdp::dist::destroy_distributed();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp_bench::run_main(argc, argv, parse,
                              [](const Options& o) { return o.role == "load" ? run_load(o) : run_train(o); });
}
