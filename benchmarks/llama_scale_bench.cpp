// A Llama at scale on CPU: loading a Hugging Face folder into FSDP (peak RSS per rank against the
// bound a rank should meet) and training a Llama (step time, losses, peak RSS), one process or FSDP.
// Run by hand (never in CI); docs/benchmarks.md, "Llama at scale", has the figures and commands.
//
//   # the folder: scripts/make-tinyllama-shards.py /var/tmp/tinyllama-1.1b (random bf16, 1.1B)
//   fsdprun --nproc-per-node 2 -- llama_scale_bench --role load --hf /var/tmp/tinyllama-1.1b
//   fsdprun --nproc-per-node 2 -- llama_scale_bench --role train --hf /var/tmp/tinyllama-1.1b \
//       --seq 512 --batch 1 --steps 4 --warmup 0 --ac --fixed-batch --lr 1e-4
//   llama_scale_bench --role train --plain --layers 12 --hidden 768 ... --result FILE   # one process
//   # the lowest peak per rank (memory options below; the reduce-scatter finished before the next
//   # unit's backward), with each rank's memory timeline; a TinyLlama-width proxy: --layers 2
//   # --hidden 2048 --heads 32 --kv-heads 4 --ffn 5632 --vocab 32000 instead of --hf
//   FSDP_REDUCE_SCATTER_OVERLAP=0 fsdprun --nproc-per-node 2 -- llama_scale_bench --role train \
//       --hf /var/tmp/tinyllama-1.1b --seq 512 --batch 1 --steps 4 --warmup 0 --ac --fixed-batch --lr 1e-4 \
//       --malloc tuned --trim-after-backward --wrap split --memory
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
// benchmarks/fsdp2_bench.py; --fixed-batch: the first batch every step, so that the loss
// falls visibly). Rank 0 prints every step and appends "median_step_s S first_loss L last_loss L
// params P world N peak_rss_bytes B forward_s F backward_s B optimizer_s O" (the step's parts,
// medians) to --result; every rank prints its peak RSS and the parts, and with FSDP_PHASE_TIMERS=1
// its table of FSDP's phases over the measured steps.
//
// --model moe (--role train; docs/benchmarks.md, "Mixture of experts at scale"): a Mixtral
// (models/moe, MoEConfig) of the shape options with --experts experts of width --moe-ffn, top
// --top-k, random init, built on the meta device, fully_shard per decoder layer then the root;
// --ep N (dividing the world): expert parallelism over the "ep" dimension of a {dp, ep} mesh, each
// rank's experts fully_shard over mesh["dp"] with their gradients divided by the world size
// (tests/models/test_moe_ep.cpp's layout). The loss is the model's (cross-entropy plus
// router_aux_loss_coef x the load-balancing loss). Besides the step it prints the parameters in all
// and per token, and per rank the time inside the all-to-alls of fsdp::ep's dispatch and combine
// (forward and backward; the ranges "fsdp::ep_collective (all_to_all)" timed by a RecordFunction
// callback; the counts exchange of each dispatch is outside them), its share of the step and the
// bytes the ep group's all-to-alls sent (its Comm's stats); --result gains "a2a_s S a2a_bytes B".
//
//   fsdprun --nproc-per-node 2 -- llama_scale_bench --role train --model moe --layers 8 --hidden 1024 \
//       --heads 16 --kv-heads 8 --vocab 32000 --experts 16 --top-k 2 --moe-ffn 2048 --ep 2 --seq 256 --batch 1
//
// Memory (--role train; all off by default, so that step times compare with earlier runs):
//   --memory              each rank prints its memory timeline: for every step and phase (forward,
//                         backward, trim, optimizer) the exact peak RSS of that phase (the kernel's
//                         VmHWM, reset at the phase's start through /proc/self/clear_refs), the
//                         largest sample of a 2 ms sampler with what it held, and what is held as the
//                         phase ends: the training state (shards + gradients + AdamW), FSDP's pool
//                         (live, cached and resident), autograd's unsharded gradients FSDP holds,
//                         glibc's free heap, and the rest (activations, temporaries, LibTorch).
//   --timeline FILE       also every sample that moved the RSS by 1 MB, to FILE.<rank>
//   --malloc tuned        fsdp::tune_malloc() first (train_gpt's policy: blocks of 1 MiB+ mapped and
//                         given back when freed); default|glibc, tuned, speed (bench_support.h)
//   --trim-after-backward BufferPoolOptions::trim_after_backward: the root's end of backward trims the
//                         pool's cache (the root's unsharded parameters, reduce-scatter buffers), which
//                         is otherwise resident while AdamW allocates its state in step 0
//   --wrap split          the embedding and [norm, lm_head] are units of their own (torchtitan's
//                         wrapping; the head's unit keeps its parameters from forward to backward),
//                         instead of staying in the root's unit (--wrap layers, the default): their
//                         unsharded parameters and gradients are then never alive together.
#include <malloc.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "bench_support.h"
#include "models/llama/hf.h"
#include "models/moe/moe.h"

namespace {

using fsdp::models::Llama;
using fsdp::models::LlamaConfig;

struct Options {
  std::string role, hf, result;
  int64_t layers = 12, hidden = 768, heads = 12, kv_heads = 4, ffn = 2048, vocab = 32000;
  int64_t seq = 256, batch = 2, steps = 4, warmup = 1;
  std::string lr = "1e-3";
  bool plain = false, ac = false, fixed_batch = false;
  // Memory: the timeline, and the three changes measured with it (file comment).
  bool memory = false, trim_after_backward = false;
  std::string timeline, wrap = "layers";
  fsdp_bench::MallocPolicy malloc = fsdp_bench::MallocPolicy::Default;
  // --model moe: a Mixtral of the shape options with these experts (file comment).
  std::string model = "llama";
  int64_t experts = 16, top_k = 2, moe_ffn = 2048, ep = 1;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "llama_scale_bench",
      "usage: llama_scale_bench --role load|train [--hf DIR] [--plain] [--ac] [--fixed-batch] [--lr 1e-3]\n"
      "         [--layers 12 --hidden 768 --heads 12 --kv-heads 4 --ffn 2048 --vocab 32000]\n"
      "         [--seq 256 --batch 2 (per rank) --steps 4 --warmup 1] [--result FILE]\n"
      "         [--memory] [--timeline FILE] [--malloc default|tuned|speed|warm] [--trim-after-backward] [--wrap "
      "layers|split]\n"
      "         [--model llama|moe [--experts 16 --top-k 2 --moe-ffn 2048 --ep 1]]\n"
      "       (sharded roles under fsdprun; --role load needs --hf; --model moe: --role train, shape options)");
  args.option("--role", &o.role).option("--hf", &o.hf).option("--result", &o.result).option("--lr", &o.lr);
  args.option("--layers", &o.layers).option("--hidden", &o.hidden).option("--heads", &o.heads);
  args.option("--kv-heads", &o.kv_heads).option("--ffn", &o.ffn).option("--vocab", &o.vocab);
  args.option("--seq", &o.seq).option("--batch", &o.batch).option("--steps", &o.steps).option("--warmup", &o.warmup);
  args.flag("--plain", &o.plain).flag("--ac", &o.ac).flag("--fixed-batch", &o.fixed_batch);
  args.flag("--memory", &o.memory).flag("--trim-after-backward", &o.trim_after_backward);
  args.option("--timeline", &o.timeline).option("--wrap", &o.wrap);
  fsdp_bench::add_malloc_option(args, &o.malloc);
  args.option("--model", &o.model).option("--experts", &o.experts).option("--top-k", &o.top_k);
  args.option("--moe-ffn", &o.moe_ffn).option("--ep", &o.ep);
  args.parse(argc, argv);
  if (o.model != "llama" && o.model != "moe") args.fail("--model takes llama or moe, got '" + o.model + "'");
  if (o.model == "moe" && (o.role != "train" || !o.hf.empty() || o.ac || o.wrap != "layers"))
    args.fail("--model moe takes --role train with the shape options (no --hf, --ac or --wrap split)");
  if (o.experts < 1 || o.top_k < 1 || o.top_k > o.experts || o.moe_ffn < 1 || o.ep < 1 || (o.plain && o.ep > 1))
    args.fail("--experts, --moe-ffn, --ep >= 1, --top-k in 1..experts; --ep > 1 needs FSDP (drop --plain)");
  if (!o.timeline.empty()) o.memory = true;
  if (o.wrap != "layers" && o.wrap != "split") args.fail("--wrap takes layers or split, got '" + o.wrap + "'");
  if (o.role == "load" && (o.memory || o.trim_after_backward || o.wrap != "layers"))
    args.fail("--memory, --timeline, --trim-after-backward and --wrap are options of --role train");
  if (o.plain && (o.trim_after_backward || o.wrap != "layers"))
    args.fail("--trim-after-backward and --wrap split need FSDP (drop --plain)");
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

// The model on the meta device, (activation checkpointing,) fully_shard per decoder layer then the root
// unless plain (split: the embedding and [norm, lm_head] first, as units of their own). Returns the
// parameter count.
int64_t build(Llama& model, const LlamaConfig& config, bool plain, bool ac, bool split = false) {
  LlamaConfig c = config;
  c.device = torch::kMeta;
  model = Llama(c);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  if (ac)
    fsdp::activation::apply_activation_checkpointing(
        *model, fsdp::activation::every_kth<fsdp::models::LlamaDecoderLayerImpl>(1));
  if (!plain) {
    if (split) {
      if (!model->lm_head)
        throw std::invalid_argument(
            "--wrap split needs an untied lm_head (the head reads the embedding's weight in the root's forward); "
            "use --wrap layers with tie_word_embeddings");
      fsdp::fully_shard(model->model->embed_tokens);
    }
    for (auto& layer : model->layers()) fsdp::fully_shard(layer);
    if (split) {
      // Last in forward, first in backward: kept unsharded in between (torchtitan's choice).
      fsdp::FullyShardOptions head;
      head.reshard_after_forward = false;
      fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->model->norm.ptr(), model->lm_head.ptr()},
                        head);
    }
    fsdp::fully_shard(model);
  }
  return params;
}

// ---- The memory timeline (--memory) ---------------------------------------------------------------

enum Phase : int { kSetup = 0, kForward, kBackward, kOptimizer, kBetween };
const char* phase_name(int p) {
  static const char* names[] = {"setup", "forward", "backward", "optimizer", "between"};
  return names[p];
}

double mb(double bytes) { return bytes / 1e6; }

struct MemSample {
  double t = 0, rss = 0, heap_in_use = 0, heap_free = 0, mmapped = 0;
  fsdp::BufferMemoryStats fsdp;
  double unsharded_grads() const { return double(fsdp.current[static_cast<int>(fsdp::BufferOwner::UnshardedGrads)]); }
  // FSDP's pool: blocks handed out plus cached blocks whose pages are resident.
  double pool_resident() const { return double(fsdp.pool_live + fsdp.pool_cached_resident); }
};

MemSample sample_memory() {
  MemSample s;
  s.rss = fsdp_bench::resident_bytes();
  const struct mallinfo2 mi = mallinfo2();  // every arena
  s.heap_in_use = double(mi.uordblks);
  s.heap_free = double(mi.fordblks);
  s.mmapped = double(mi.hblkhd);
  s.fsdp = fsdp::buffer_memory_stats();
  return s;
}

// One rank's timeline: the training loop calls begin(step, phase) as a phase starts and end() as
// it ends (with the training state's bytes then); a sampler thread keeps the largest sample of the
// phase. A phase's exact peak is the kernel's VmHWM, reset at begin() (/proc/self/clear_refs "5";
// the process's overall peak is kept here, as the maximum over the phases).
class MemoryTimeline {
 public:
  struct Row {
    int step = -1, phase = kSetup;
    double hwm = 0;          // VmHWM during the phase
    MemSample largest, end;  // the largest sample of the phase; the sample at its end
    double state = 0;        // params + grads + AdamW state at its end
    fsdp_bench::StateBytes parts;
  };

  MemoryTimeline(bool on, const std::string& file, int rank) : on_(on) {
    if (!on_) return;
    if (!file.empty()) {
      out_ = std::make_unique<std::ofstream>(file + "." + std::to_string(rank));
      *out_ << "# t_s step phase rss_MB pool_live_MB pool_cached_resident_MB unsharded_grads_MB heap_in_use_MB "
               "heap_free_MB glibc_mmapped_MB\n";
    }
    t0_ = std::chrono::steady_clock::now();
    sampler_ = std::thread([this] { run(); });
  }
  ~MemoryTimeline() {
    stop_ = true;
    if (sampler_.joinable()) sampler_.join();
  }
  bool on() const { return on_; }

  // The setup (load) ends: its row, then the first phase.
  void begin(int step, Phase phase) {
    if (!on_) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_ = Row{};
      current_.step = step;
      current_.phase = phase;
      ++generation_;
    }
    overall_hwm_ = std::max(overall_hwm_, fsdp_bench::vm_hwm_bytes());
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";  // VmHWM := VmRSS
    reset.flush();
    if (!reset) hwm_reset_ = false;
  }
  void end(const fsdp_bench::StateBytes& state) {
    if (!on_) return;
    Row row;
    {
      std::lock_guard<std::mutex> lock(mu_);
      row = current_;
    }
    row.hwm = fsdp_bench::vm_hwm_bytes();
    overall_hwm_ = std::max(overall_hwm_, row.hwm);
    row.end = sample_memory();
    if (row.end.rss > row.largest.rss) row.largest = row.end;
    row.parts = state;
    row.state = double(state.params + state.grads + state.optim);
    rows_.push_back(row);
    std::lock_guard<std::mutex> lock(mu_);
    current_.phase = kBetween;
    current_.largest = MemSample{};
    ++generation_;
  }
  // The process's peak RSS so far (VmHWM is reset per phase).
  double peak() const { return std::max(overall_hwm_, fsdp_bench::vm_hwm_bytes()); }

  void print(int rank) const {
    if (!on_) return;
    std::printf(
        "rank %d memory timeline (MB; state = this rank's shards + sharded gradients + AdamW state; pool = FSDP's "
        "buffer pool, blocks live + cached blocks still resident; ugrads = autograd's unsharded gradients FSDP "
        "holds until reduced; other = RSS - state - pool - ugrads - glibc free heap: activations, temporaries, "
        "LibTorch)\n",
        rank);
    std::printf(
        "| step | phase | peak RSS (VmHWM) | largest sample: RSS, pool, ugrads, heap free, other | at its end: RSS | "
        "state (params + grads + AdamW) | pool live + cached resident | ugrads | glibc heap in use / free | glibc "
        "mmapped | other |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : rows_) {
      auto other = [&](const MemSample& s) {
        return s.rss - r.state - s.pool_resident() - s.unsharded_grads() - s.heap_free;
      };
      const MemSample& l = r.largest;
      const MemSample& e = r.end;
      std::printf(
          "| %d | %s | %.0f | %.0f, %.0f, %.0f, %.0f, %.0f | %.0f | %.0f (%.0f + %.0f + %.0f) | %.0f + %.0f | %.0f | "
          "%.0f / %.0f | %.0f | %.0f |\n",
          r.step, phase_name(r.phase), mb(r.hwm), mb(l.rss), mb(l.pool_resident()), mb(l.unsharded_grads()),
          mb(l.heap_free), mb(other(l)), mb(e.rss), mb(r.state), mb(double(r.parts.params)), mb(double(r.parts.grads)),
          mb(double(r.parts.optim)), mb(double(e.fsdp.pool_live)), mb(double(e.fsdp.pool_cached_resident)),
          mb(e.unsharded_grads()), mb(e.heap_in_use), mb(e.heap_free), mb(e.mmapped), mb(other(e)));
    }
    if (!hwm_reset_)
      std::printf(
          "rank %d: /proc/self/clear_refs could not be written: each phase's VmHWM is the process's peak so far\n",
          rank);
    std::printf("rank %d: FSDP's buffers alive at each phase's largest sample, by owner (MB):\n", rank);
    for (const Row& r : rows_) {
      std::printf("  step %d %s:", r.step, phase_name(r.phase));
      for (int k = 0; k < fsdp::kBufferOwners; ++k)
        if (r.largest.fsdp.current[k] > 0)
          std::printf(" %s %.0f", fsdp::buffer_owner_name(static_cast<fsdp::BufferOwner>(k)),
                      mb(double(r.largest.fsdp.current[k])));
      std::printf("; pool live %.0f, cached %.0f (resident %.0f)\n", mb(double(r.largest.fsdp.pool_live)),
                  mb(double(r.largest.fsdp.pool_cached)), mb(double(r.largest.fsdp.pool_cached_resident)));
    }
    std::fflush(stdout);
  }

 private:
  void run() {
    MemSample last;
    int last_phase = -1;
    while (!stop_) {
      uint64_t generation;
      {
        std::lock_guard<std::mutex> lock(mu_);
        generation = generation_;
      }
      MemSample s = sample_memory();
      s.t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
      int step, phase;
      {
        std::lock_guard<std::mutex> lock(mu_);
        // A sample that straddled a phase change belongs to neither phase.
        if (generation == generation_ && s.rss > current_.largest.rss) current_.largest = s;
        step = current_.step;
        phase = current_.phase;
      }
      if (out_ && (std::abs(s.rss - last.rss) >= 1e6 || phase != last_phase)) {
        *out_ << s.t << " " << step << " " << phase_name(phase) << " " << mb(s.rss) << " "
              << mb(double(s.fsdp.pool_live)) << " " << mb(double(s.fsdp.pool_cached_resident)) << " "
              << mb(s.unsharded_grads()) << " " << mb(s.heap_in_use) << " " << mb(s.heap_free) << " " << mb(s.mmapped)
              << "\n";
        last = s;
        last_phase = phase;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }

  bool on_;
  std::unique_ptr<std::ofstream> out_;
  std::chrono::steady_clock::time_point t0_;
  std::atomic<bool> stop_{false};
  std::thread sampler_;
  mutable std::mutex mu_;
  Row current_;
  std::vector<Row> rows_;
  uint64_t generation_ = 0;  // a new phase (under mu_)
  bool hwm_reset_ = true;    // false: /proc/self/clear_refs refused, phase peaks are the process's so far
  double overall_hwm_ = 0;
};

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

// The training run's process settings, before any tensor: --malloc, --trim-after-backward.
void set_up_train_process(const Options& o) {
  fsdp_bench::apply_malloc_policy(o.malloc);
  if (o.trim_after_backward) {
    auto pool = fsdp::buffer_pool_options();
    pool.trim_after_backward = true;
    fsdp::set_buffer_pool_options(pool);
  }
}

// Time inside expert parallelism's row all-to-alls (fsdp::ep's dispatch and combine, forward and
// backward: the ranges "fsdp::ep_collective (all_to_all)" its exchanges open), on every thread, from
// a RecordFunction callback on USER_SCOPE; it does not count the counts exchange (E int64 a
// dispatch) that precedes the rows.
class AllToAllTimer {
 public:
  AllToAllTimer() {
    handle_ = at::addGlobalCallback(
        at::RecordFunctionCallback(&on_start, &on_end).needsInputs(false).scopes({at::RecordScope::USER_SCOPE}));
  }
  ~AllToAllTimer() { at::removeCallback(handle_); }
  AllToAllTimer(const AllToAllTimer&) = delete;
  AllToAllTimer& operator=(const AllToAllTimer&) = delete;
  static double seconds() { return double(ns_.load()) / 1e9; }

 private:
  struct Start : at::ObserverContext {
    std::chrono::steady_clock::time_point t;
  };
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (std::strcmp(fn.name(), "fsdp::ep_collective (all_to_all)") != 0) return nullptr;
    auto start = std::make_unique<Start>();
    start->t = std::chrono::steady_clock::now();
    return start;
  }
  static void on_end(const at::RecordFunction&, at::ObserverContext* ctx) {
    if (ctx == nullptr) return;
    const auto d = std::chrono::steady_clock::now() - static_cast<Start*>(ctx)->t;
    ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(d).count();
  }
  static inline std::atomic<int64_t> ns_{0};
  at::CallbackHandle handle_;
};

// What the measured steps took on this rank: the step and its parts (forward + loss, backward,
// optimizer step; the rest: zero_grad, the trim, loss.item()), the losses, and (--model moe with
// --ep > 1) the time inside the all-to-alls and the ep group's all-to-all bytes per step.
struct TrainTimes {
  std::vector<double> times, forward_s, backward_s, optimizer_s, a2a_s, a2a_bytes;
  double first_loss = NAN, last_loss = NAN;
};

// One step's forward and loss: {loss, logits} (the logits are dropped after backward).
using ForwardLoss =
    std::function<std::pair<at::Tensor, at::Tensor>(const at::Tensor& input, const at::Tensor& targets)>;

// --warmup + --steps steps on `next()`'s batches (or the first one, --fixed-batch), each part timed
// and its memory phase marked; rank 0 prints each step's loss, time and peak RSS. `ep`: the expert
// parallel group whose all-to-all bytes are counted (null: none).
TrainTimes train_loop(const Options& o, torch::nn::Module& model, const ForwardLoss& forward_loss,
                      torch::optim::AdamW& opt, MemoryTimeline& mem, int rank, const std::function<at::Tensor()>& next,
                      fsdp::comm::Comm* ep = nullptr) {
  auto state = [&] { return fsdp_bench::state_bytes(model, opt); };
  const at::Tensor fixed = next();
  TrainTimes t;
  for (int64_t s = 0; s < o.warmup + o.steps; ++s) {
    const at::Tensor data = o.fixed_batch ? fixed : next();
    if (s == o.warmup) fsdp::reset_phase_timers();  // FSDP_PHASE_TIMERS=1: the measured steps only
    const double a2a_before = AllToAllTimer::seconds();
    const auto bytes_before = ep ? ep->stats().snapshot()[fsdp::comm::OpKind::AllToAll].bytes_sent : 0;
    fsdp_bench::Stopwatch step;
    opt.zero_grad();
    const int k = static_cast<int>(s);
    mem.begin(k, kForward);
    fsdp_bench::Stopwatch forward;
    auto [loss, logits] = forward_loss(data.narrow(1, 0, o.seq), data.narrow(1, 1, o.seq));
    const double forward_wall = forward.wall();
    mem.end(state());
    mem.begin(k, kBackward);
    fsdp_bench::Stopwatch backward;
    loss.backward();
    logits = at::Tensor();  // as a loop whose logits go out of scope with the step would have it
    const double backward_wall = backward.wall();
    mem.end(state());
    mem.begin(k, kOptimizer);
    fsdp_bench::Stopwatch optimizer;
    opt.step();
    const double optimizer_wall = optimizer.wall();
    mem.end(state());
    const double value = loss.item<double>();
    const double wall = step.wall();
    if (std::isnan(t.first_loss)) t.first_loss = value;
    t.last_loss = value;
    if (s >= o.warmup) {
      t.times.push_back(wall);
      t.forward_s.push_back(forward_wall);
      t.backward_s.push_back(backward_wall);
      t.optimizer_s.push_back(optimizer_wall);
      t.a2a_s.push_back(AllToAllTimer::seconds() - a2a_before);
      t.a2a_bytes.push_back(ep ? double(ep->stats().snapshot()[fsdp::comm::OpKind::AllToAll].bytes_sent - bytes_before)
                               : 0.0);
    }
    if (rank == 0) {
      std::printf("step %lld%s: loss %.4f, %.2f s, peak RSS %.2f GiB\n", (long long)s, s < o.warmup ? " (warm-up)" : "",
                  value, wall, gib(mem.on() ? mem.peak() : fsdp_bench::vm_hwm_bytes()));
      std::fflush(stdout);
    }
  }
  return t;
}

// Each rank's summary in turn (median step and parts, losses, peak RSS, FSDP's phases, the memory
// timeline's table), then rank 0's result line (--result).
void report_train(const Options& o, const TrainTimes& t, MemoryTimeline& mem, fsdp_bench::Place place, int64_t params) {
  const double hwm = mem.on() ? mem.peak() : fsdp_bench::vm_hwm_bytes();
  if (!o.plain) barrier();
  for (int r = 0; r < place.world; ++r) {
    if (r == place.rank) {
      std::printf("rank %d: median step %.3f s, first loss %.4f, last loss %.4f, peak RSS (VmHWM) %.3f GiB\n", r,
                  fsdp_bench::median(t.times), t.first_loss, t.last_loss, gib(hwm));
      std::printf("rank %d: median forward + loss %.3f s, backward %.3f s, optimizer step %.3f s\n", r,
                  fsdp_bench::median(t.forward_s), fsdp_bench::median(t.backward_s), fsdp_bench::median(t.optimizer_s));
      if (o.model == "moe")
        std::printf("rank %d: median all-to-all %.3f s per step (%.1f%% of the step), %.3f MB sent per step\n", r,
                    fsdp_bench::median(t.a2a_s), 100.0 * fsdp_bench::median(t.a2a_s) / fsdp_bench::median(t.times),
                    fsdp_bench::median(t.a2a_bytes) / 1e6);
      if (!o.plain && fsdp::phase_timers_enabled())
        std::printf("rank %d: FSDP's phases over the measured steps:\n%s", r,
                    fsdp::phase_times().table(static_cast<int>(o.steps)).c_str());
      mem.print(r);
      std::fflush(stdout);
    }
    if (!o.plain) barrier();
  }
  if (place.rank != 0 || o.result.empty()) return;
  std::ofstream out(o.result, std::ios::app);
  char line[512];
  std::snprintf(line, sizeof(line),
                "median_step_s %.6f first_loss %.6f last_loss %.6f params %lld world %d peak_rss_bytes %.0f "
                "forward_s %.6f backward_s %.6f optimizer_s %.6f",
                fsdp_bench::median(t.times), t.first_loss, t.last_loss, (long long)params, place.world, hwm,
                fsdp_bench::median(t.forward_s), fsdp_bench::median(t.backward_s), fsdp_bench::median(t.optimizer_s));
  out << line;
  if (o.model == "moe") {
    std::snprintf(line, sizeof(line), " a2a_s %.6f a2a_bytes %.0f", fsdp_bench::median(t.a2a_s),
                  fsdp_bench::median(t.a2a_bytes));
    out << line;
  }
  out << "\n";
}

int run_train(const Options& o) {
  set_up_train_process(o);
  const auto place = fsdp_bench::join_world(!o.plain);
  MemoryTimeline mem(o.memory, o.timeline, place.rank);
  mem.begin(-1, kSetup);
  const LlamaConfig config = config_of(o);
  Llama model{nullptr};
  fsdp_bench::Stopwatch setup;
  const int64_t params = build(model, config, o.plain, o.ac, o.wrap == "split");
  fsdp::to_empty(*model, torch::kCPU);
  if (o.hf.empty())
    model->reset_parameters();  // fsdp::init: the same values at any world size
  else
    fsdp::models::load_hf_weights(*model, o.hf);
  const double setup_s = setup.wall();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(std::stod(o.lr)));
  mem.end(fsdp_bench::state_bytes(*model, opt));
  auto gen = fsdp_bench::token_stream(place.rank);
  auto next = [&] { return at::randint(config.vocab_size, {o.batch, o.seq + 1}, gen, at::kLong); };
  if (place.rank == 0)
    std::printf(
        "llama_scale_bench train: %s; %s; seq %lld, batch %lld per rank, fp32, %s attention%s, AdamW lr %s; "
        "%s batch; setup %.1f s; malloc %s, wrap %s%s\n",
        describe(config, params).c_str(),
        o.plain ? "one process" : ("FSDP " + std::to_string(place.world) + " ranks").c_str(), (long long)o.seq,
        (long long)o.batch, model->layers()[0]->self_attn->fused ? "fused" : "written-out",
        o.ac ? ", activation checkpointing every layer" : "", o.lr.c_str(),
        o.fixed_batch ? "the same" : "a fresh random", setup_s, fsdp_bench::malloc_policy_name(o.malloc),
        o.wrap.c_str(), o.trim_after_backward ? ", pool trimmed after backward" : "");
  const ForwardLoss forward_loss = [&](const at::Tensor& input, const at::Tensor& targets) {
    auto logits = o.plain ? model->forward(input) : fsdp::call(model, input);
    return std::make_pair(fsdp::models::gpt_loss(logits, targets), logits);
  };
  const TrainTimes t = train_loop(o, *model, forward_loss, opt, mem, place.rank, next);
  report_train(o, t, mem, place, params);
  if (!o.plain) fsdp::dist::destroy_distributed();
  return 0;
}

// ---- --model moe: a Mixtral of the shape options ------------------------------------------------

fsdp::models::MoEConfig moe_config_of(const Options& o) {
  fsdp::models::MoEConfig c;
  c.base = config_of(o);
  c.base.architecture = "MixtralForCausalLM";
  c.base.intermediate_size = o.moe_ffn;  // Mixtral states its experts' width there
  c.num_experts = o.experts;
  c.num_experts_per_tok = o.top_k;
  c.moe_intermediate_size = o.moe_ffn;
  c.output_router_logits = true;
  c.validate();
  return c;
}

// Parameters in all, and those one token uses (its top k experts of every layer; the rest whole).
std::pair<int64_t, int64_t> moe_counts(const fsdp::models::MoEConfig& c) {
  const auto& b = c.base;
  const int64_t h = b.hidden_size, hd = b.resolved_head_dim();
  const int64_t attn = h * b.num_attention_heads * hd * 2 + h * b.num_key_value_heads * hd * 2;
  const int64_t expert = 3 * h * c.moe_intermediate_size;
  const int64_t shared =
      b.vocab_size * h * (b.tie_word_embeddings ? 1 : 2) + h + b.num_hidden_layers * (attn + 2 * h + c.num_experts * h);
  return {shared + b.num_hidden_layers * c.num_experts * expert,
          shared + b.num_hidden_layers * c.num_experts_per_tok * expert};
}

std::string describe(const fsdp::models::MoEConfig& c) {
  const auto [total, active] = moe_counts(c);
  char buf[320];
  std::snprintf(buf, sizeof(buf),
                "Mixtral %lld layers, hidden %lld, %lld heads / %lld KV heads, %lld experts top %lld of width %lld, "
                "vocab %lld: %.3fB params, %.3fB active per token",
                (long long)c.base.num_hidden_layers, (long long)c.base.hidden_size,
                (long long)c.base.num_attention_heads, (long long)c.base.num_key_value_heads, (long long)c.num_experts,
                (long long)c.num_experts_per_tok, (long long)c.moe_intermediate_size, (long long)c.base.vocab_size,
                double(total) / 1e9, double(active) / 1e9);
  return buf;
}

// On the meta device, fully_shard per decoder layer then the root (unless plain); with --ep > 1 the
// experts over mesh["dp"] first, their gradients divided by the world (tests/models/test_moe_ep.cpp's
// layout), then allocated and initialised (fsdp::init).
fsdp::models::MoECausalLM build_moe(fsdp::models::MoEConfig c, const Options& o,
                                    const std::optional<fsdp::DeviceMesh>& mesh) {
  if (mesh && o.ep > 1) c.set_expert_parallel(*mesh);
  c.base.device = torch::kMeta;
  fsdp::models::MoECausalLM model(c);
  if (mesh) {
    for (auto& layer : model->layers()) {
      if (o.ep > 1 && layer->moe)
        for (auto& expert : layer->moe->experts->local)
          fsdp::fully_shard(expert, {.mesh = (*mesh)["dp"]})
              .set_gradient_divide_factor(static_cast<double>(mesh->size()));
      fsdp::fully_shard(layer);
    }
    fsdp::fully_shard(model);
  }
  fsdp::to_empty(*model, torch::kCPU);
  model->reset_parameters();
  return model;
}

int run_train_moe(const Options& o) {
  set_up_train_process(o);
  const auto place = fsdp_bench::join_world(!o.plain);
  if (!o.plain && place.world % o.ep != 0)
    throw std::invalid_argument("--ep " + std::to_string(o.ep) + " does not divide the world size " +
                                std::to_string(place.world));
  AllToAllTimer a2a;
  MemoryTimeline mem(o.memory, o.timeline, place.rank);
  mem.begin(-1, kSetup);
  const fsdp::models::MoEConfig config = moe_config_of(o);
  std::optional<fsdp::DeviceMesh> mesh;
  if (!o.plain) mesh = fsdp::init_device_mesh({place.world / o.ep, o.ep}, {"dp", "ep"});
  fsdp_bench::Stopwatch setup;
  auto model = build_moe(config, o, mesh);
  const double setup_s = setup.wall();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(std::stod(o.lr)));
  mem.end(fsdp_bench::state_bytes(*model, opt));
  auto gen = fsdp_bench::token_stream(place.rank);
  auto next = [&] { return at::randint(config.base.vocab_size, {o.batch, o.seq + 1}, gen, at::kLong); };
  if (place.rank == 0)
    std::printf(
        "llama_scale_bench train: %s; %s; seq %lld, batch %lld per rank, fp32, AdamW lr %s; %s batch; setup %.1f s; "
        "malloc %s\n",
        describe(config).c_str(),
        o.plain ? "one process"
                : ("FSDP " + std::to_string(place.world) + " ranks, EP " + std::to_string(o.ep)).c_str(),
        (long long)o.seq, (long long)o.batch, o.lr.c_str(), o.fixed_batch ? "the same" : "a fresh random", setup_s,
        fsdp_bench::malloc_policy_name(o.malloc));
  const ForwardLoss forward_loss = [&](const at::Tensor& input, const at::Tensor& targets) {
    auto logits = o.plain ? model->forward(input) : fsdp::call(model, input);
    return std::make_pair(model->loss(logits, targets), logits);
  };
  fsdp::comm::Comm* ep = mesh && o.ep > 1 ? mesh->comm("ep").get() : nullptr;
  const TrainTimes t = train_loop(o, *model, forward_loss, opt, mem, place.rank, next, ep);
  report_train(o, t, mem, place, moe_counts(config).first);
  if (!o.plain) fsdp::dist::destroy_distributed();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp_bench::run_main(argc, argv, parse, [](const Options& o) {
    if (o.model == "moe") return run_train_moe(o);
    return o.role == "load" ? run_load(o) : run_train(o);
  });
}
