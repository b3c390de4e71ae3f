// memory_bench: where a rank's memory goes under fully_shard, against one process; --mode
// activation: what activation checkpointing buys and costs.
//
//   build/bin/memory_bench                       # GPT 12 x 768, 12 heads, seq 256 (85.6M), 1 vs 2 and 4 ranks
//   build/bin/memory_bench --small               # GPT 4 x 256, 4 heads, seq 128 (3.2M)
//   build/bin/memory_bench --ranks 2 --steps 3 --batch 2 --layers 12 --dim 768 --heads 12 --seq 256
//     [--malloc default|tuned|speed|warm] [--pool on|off] [--pool-trim on|off] [--threads 1]
//     [--gloo-fallback p2p|collective]
//   fsdprun --nproc-per-node 2 -- memory_bench --role fsdp --result R --timeline T --steps 3 --malloc tuned
//                                                # one configuration; T.<rank>: the RSS over time, by phase
//
// Every configuration runs in a fresh process (under fsdprun for FSDP), with the same per-rank
// batch (--batch sequences), one intra-op thread per rank, AdamW, float32, synthetic tokens. The
// model is built on the meta device and only this rank's shards are allocated (train_gpt's recipe).
// Each worker samples, every millisecond, its resident set (/proc/self/statm), glibc's heap
// (mallinfo2) and FSDP's own buffers by owner (fsdp/debug/buffer_pool.h); the breakdown printed
// is the sample with the largest RSS; "peak RSS" is the kernel's high-water mark (VmHWM). The table
// "Where each run peaked" gives each step's largest sample with its phase (forward, backward,
// optimizer) and the collectives issued so far (which unit was running); --timeline writes every
// sample that moved the RSS by 1 MB. --pool-trim off keeps the pool's cache resident through
// backward (BufferPoolOptions::trim_after_forward = false; for comparison).
//
// The saving: the training state (parameters + gradients + AdamW state) of one process is S, so
// N ranks should save S x (N-1)/N per rank; "realized" is (peak RSS of one process - peak RSS of
// a rank) divided by that.
//
// --malloc tuned: the workers fix glibc's mmap threshold at 1 MiB (fsdp::tune_malloc, what train_gpt
// does): large freed blocks go back to the kernel instead of staying in the heap (speed: the
// opposite trade, fsdp::tune_malloc_for_speed; bench_support.h's MallocPolicy). --pool off: FSDP's
// buffers come from LibTorch's allocator instead of FSDP's caching pool. --gloo-fallback: how Comm
// builds Gloo's reduce-scatter (and 1.13's all-gather): p2p (send/recv, 1/N scratch; the default)
// or collective (all_to_all, a scratch as large as the input). "step" is the median step time
// after the first step (noisy under load: say the load with it).
//
//   build/bin/memory_bench --mode activation [--steps 3] [--warmup 1] [--rounds 1] [--layers 8] [--dim 256]
//       [--heads 4] [--seq 512] [--batch 8]             memory rows: none / full / every:2
//   build/bin/memory_bench --mode activation --fit [--budget-mb 1536]    fit table, ~100M parameters
//       [--glibc-default-malloc]: workers keep glibc's dynamic mmap threshold (see its run_worker)
//
// --mode activation: every configuration runs in a fresh process (fsdprun for several ranks), so
// its peak resident memory (getrusage ru_maxrss) belongs to that configuration alone. Rows: peak
// RSS per rank, the part of it that training added on top of the process after model and
// optimizer construction, the bytes of parameters / gradients / optimizer state per rank, and the
// median step time, wall clock and CPU time (user + system of the process: the work done, less
// sensitive to other load on a shared machine). Memory rows: GPT --layers x --dim, --seq tokens,
// --batch sequences per rank, fully_shard in a world of one (every fsdp::call hook, no network);
// checkpointing full (every block) and every:2. Fit: GPT 14 x 768 (99M parameters), seq 512, 1
// sequence per rank, for one process (plain LibTorch), FSDP 2 ranks, FSDP 2 ranks + full, FSDP 4
// ranks + full; each peak is set against a stated per-process budget (--budget-mb).
#include <malloc.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_support.h"

namespace {

using fsdp_bench::bad_input;
using fsdp_bench::resident_bytes;

struct Options {
  fsdp_bench::GptShape shape{12, 768, 12, 256, 2};  // --batch: sequences per rank
  int steps = 3, threads = 1;
  std::vector<int> ranks = {2, 4};
  fsdp_bench::MallocPolicy malloc = fsdp_bench::MallocPolicy::Default;  // --malloc
  std::string pool = "on";
  std::string pool_trim = "on";  // BufferPoolOptions::trim_after_forward
  std::string gloo_fallback = "p2p";
  std::string role = "driver";  // driver | single | fsdp
  std::string result;
  std::string timeline;  // worker: one line per sample that moved the RSS by >= 1 MB or changed phase
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "memory_bench",
      "usage: memory_bench [--mode memory|activation] [--small] [--ranks 2,4] [--steps N] [--batch N] [--layers N] "
      "[--dim N] [--heads N] "
      "[--seq N] [--threads N] [--malloc default|tuned|speed|warm] [--pool on|off] [--pool-trim on|off] "
      "[--gloo-fallback p2p|collective] [--timeline FILE (with --role)]\n"
      "       memory_bench --mode activation --help: the options of activation checkpointing's table");
  o.shape.add_options(args);
  args.flag("--small", [&o] { o.shape = {4, 256, 4, 128, 4}; });
  args.option("--role", &o.role).option("--result", &o.result).option("--timeline", &o.timeline);
  fsdp_bench::add_malloc_option(args, &o.malloc);
  args.option("--pool", &o.pool).option("--pool-trim", &o.pool_trim);
  args.option("--gloo-fallback", &o.gloo_fallback).option("--steps", &o.steps).option("--threads", &o.threads);
  args.option("--ranks", [&](const std::string& v) { o.ranks = args.integers("--ranks", v); });
  args.parse(argc, argv);
  if (o.pool != "on" && o.pool != "off") bad_input("--pool takes on or off");
  if (o.pool_trim != "on" && o.pool_trim != "off") bad_input("--pool-trim takes on or off");
  if (o.gloo_fallback != "p2p" && o.gloo_fallback != "collective") {
    bad_input("--gloo-fallback takes p2p or collective");
  }
  if (o.steps < 1 || o.shape.batch < 1 || o.threads < 1) bad_input("--steps, --batch and --threads must be positive");
  for (int r : o.ranks) {
    if (r < 2) bad_input("--ranks lists world sizes of at least 2 (one process always runs)");
  }
  if (o.role != "driver" && o.role != "single" && o.role != "fsdp") bad_input("--role takes driver, single or fsdp");
  return o;
}

// One sample: RSS, glibc's view, FSDP's buffers.
// Where the training loop is (set by the main thread, read by the sampler): the step, the phase,
// and how many all-gathers and reduce-scatters this process has issued (which unit is running).
enum Phase : int { kSetup = 0, kForward, kBackward, kOptimizer, kBetween };
const char* phase_name(int p) {
  static const char* names[] = {"setup", "forward", "backward", "optimizer", "between"};
  return names[p];
}
std::atomic<int> g_step{-1}, g_phase{kSetup};

struct Sample {
  double t = 0, rss = 0, heap_in_use = 0, heap_free = 0, mmapped = 0;
  int step = -1, phase = kSetup;
  uint64_t all_gathers = 0, reduce_scatters = 0;
  fsdp::BufferMemoryStats fsdp;
};

Sample take_sample() {
  Sample s;
  s.rss = resident_bytes();
  struct mallinfo2 mi = mallinfo2();
  s.heap_in_use = static_cast<double>(mi.uordblks);  // allocated from the heap (arenas)
  s.heap_free = static_cast<double>(mi.fordblks);    // free but kept in the heap
  s.mmapped = static_cast<double>(mi.hblkhd);        // allocated with mmap by malloc
  s.fsdp = fsdp::buffer_memory_stats();
  s.step = g_step.load();
  s.phase = g_phase.load();
  const auto comm = fsdp::comm::process_comm_stats().snapshot();
  s.all_gathers = comm[fsdp::comm::OpKind::AllGather].calls;
  s.reduce_scatters = comm[fsdp::comm::OpKind::ReduceScatter].calls;
  return s;
}

void write_sample(std::ostream& out, const Sample& s) {
  out << s.t << " " << s.step << " " << phase_name(s.phase) << " " << s.all_gathers << " " << s.reduce_scatters << " "
      << s.rss / 1e6 << " " << s.fsdp.total / 1e6 << " " << s.fsdp.pool_live / 1e6 << " " << s.fsdp.pool_cached / 1e6
      << " " << s.fsdp.pool_cached_resident / 1e6 << " " << s.heap_in_use / 1e6 << " " << s.heap_free / 1e6 << " "
      << s.mmapped / 1e6 << "\n";
}

// A worker's process settings, before any tensor: --malloc, --gloo-fallback, --pool, --pool-trim
// and the intra-op threads.
void set_up_worker_process(const Options& o) {
  fsdp_bench::apply_malloc_policy(o.malloc);
  fsdp::comm::set_gloo_fallback(o.gloo_fallback == "p2p" ? fsdp::comm::GlooFallback::PointToPoint
                                                         : fsdp::comm::GlooFallback::Collective);
  fsdp::BufferPoolOptions pool;
  pool.enabled = o.pool == "on";
  pool.trim_after_forward = o.pool_trim == "on";
  fsdp::set_buffer_pool_options(pool);
  at::set_num_threads(o.threads);
}

// A thread that samples the process every millisecond until destroyed: the largest RSS sample
// overall and of each step; with --timeline, every sample that moved the RSS by 1 MB or changed
// phase or step, to TIMELINE.<rank>.
class Sampler {
 public:
  Sampler(const Options& o, int rank) : step_peaks_(static_cast<size_t>(o.steps)) {
    if (!o.timeline.empty()) {
      timeline_ = std::make_unique<std::ofstream>(o.timeline + "." + std::to_string(rank));
      *timeline_ << "# t_s step phase all_gathers reduce_scatters rss_MB fsdp_alive_MB pool_live_MB pool_cached_MB "
                    "pool_cached_resident_MB heap_in_use_MB heap_free_MB glibc_mmapped_MB\n";
    }
    thread_ = std::thread([this] { loop(); });
  }
  // An exception in training must not leave a joinable thread behind.
  ~Sampler() { stop(); }
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  // After stop().
  const Sample& peak() const { return peak_; }
  const std::vector<Sample>& step_peaks() const { return step_peaks_; }

 private:
  void loop() {
    const auto t_start = std::chrono::steady_clock::now();
    Sample last;
    while (!stop_.load()) {
      Sample s = take_sample();
      s.t = fsdp_bench::seconds_since(t_start);
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (s.rss > peak_.rss) peak_ = s;
        if (s.step >= 0 && s.step < static_cast<int>(step_peaks_.size()) &&
            s.rss > step_peaks_[static_cast<size_t>(s.step)].rss) {
          step_peaks_[static_cast<size_t>(s.step)] = s;
        }
      }
      if (timeline_ && (std::abs(s.rss - last.rss) >= 1e6 || s.phase != last.phase || s.step != last.step)) {
        write_sample(*timeline_, s);
        last = s;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  std::atomic<bool> stop_{false};
  std::mutex mu_;
  Sample peak_;
  std::vector<Sample> step_peaks_;  // the largest RSS sample of each step
  std::unique_ptr<std::ofstream> timeline_;
  std::thread thread_;
};

// --steps training steps, each phase marked for the sampler; the last step's loss, and the step
// times after the first in `step_s`.
double train_steps(const Options& o, fsdp::models::GPT& model, torch::optim::AdamW& opt, int rank, bool sharded,
                   std::vector<double>& step_s) {
  auto gen = fsdp_bench::token_stream(rank);
  double loss_value = 0;
  for (int s = 0; s < o.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    g_step = s;
    g_phase = kBetween;
    auto data = fsdp_bench::random_tokens(gen, o.shape.batch, o.shape.seq);
    opt.zero_grad();
    auto input = data.narrow(1, 0, o.shape.seq);
    g_phase = kForward;
    auto logits = sharded ? fsdp::call(model, input) : model->forward(input);
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, o.shape.seq));
    g_phase = kBackward;
    loss.backward();
    g_phase = kOptimizer;
    opt.step();
    g_phase = kBetween;
    loss_value = loss.item<double>();
    if (s > 0) step_s.push_back(fsdp_bench::seconds_since(t0));
  }
  return loss_value;
}

// What a worker measured, for its result line.
struct WorkerResult {
  int rank = 0, world = 1;
  double step_s = 0, rss_setup = 0, block_param_bytes = 0, total_param_bytes = 0, loss = 0;
  fsdp_bench::StateBytes state;
};

// The worker's result line: its readings, the largest sample (where it was: the step, the phase,
// the collectives issued so far) and each step's largest sample.
std::string result_line(const WorkerResult& w, const Sampler& sampler, int steps) {
  const Sample& peak = sampler.peak();
  const auto fsdp_stats = fsdp::buffer_memory_stats();
  std::ostringstream line;
  line << "rank " << w.rank << " world " << w.world << " step_s " << w.step_s << " hwm " << fsdp_bench::vm_hwm_bytes()
       << " rss_setup " << w.rss_setup << " params " << w.state.params << " grads " << w.state.grads << " optim "
       << w.state.optim << " block_param_bytes " << w.block_param_bytes << " total_param_bytes " << w.total_param_bytes
       << " loss " << w.loss << " s_rss " << peak.rss << " s_heap_in_use " << peak.heap_in_use << " s_heap_free "
       << peak.heap_free << " s_mmapped " << peak.mmapped << " s_fsdp " << peak.fsdp.total << " s_pool_cached "
       << peak.fsdp.pool_cached << " s_pool_live " << peak.fsdp.pool_live << " s_pool_cached_resident "
       << peak.fsdp.pool_cached_resident << " fsdp_peak " << fsdp_stats.peak << " pool_peak_mapped "
       << fsdp_stats.pool_peak_mapped << " pool_hits " << fsdp_stats.pool_hits << " pool_misses "
       << fsdp_stats.pool_misses;
  for (int k = 0; k < fsdp::kBufferOwners; ++k) line << " at_peak_" << k << " " << fsdp_stats.at_peak[k];
  for (int k = 0; k < fsdp::kBufferOwners; ++k) line << " s_owner_" << k << " " << peak.fsdp.current[k];
  line << " s_step " << peak.step << " s_phase " << peak.phase << " s_all_gathers " << peak.all_gathers
       << " s_reduce_scatters " << peak.reduce_scatters;
  for (int s = 0; s < steps; ++s) {
    const auto& sp = sampler.step_peaks()[static_cast<size_t>(s)];
    line << " step_rss_" << s << " " << sp.rss << " step_phase_" << s << " " << sp.phase << " step_rs_" << s << " "
         << sp.reduce_scatters << " step_ag_" << s << " " << sp.all_gathers << " step_pool_cached_" << s << " "
         << sp.fsdp.pool_cached_resident << " step_fsdp_" << s << " " << sp.fsdp.total << " step_heap_free_" << s << " "
         << sp.heap_free << " step_heap_in_use_" << s << " " << sp.heap_in_use;
  }
  return line.str();
}

int run_worker(const Options& o, bool sharded) {
  set_up_worker_process(o);
  WorkerResult w;
  const auto place = fsdp_bench::join_world(sharded);
  w.rank = place.rank;
  w.world = place.world;
  fsdp::models::GPT model(o.shape.config(torch::kMeta));
  for (const auto& p : model->blocks.front()->parameters()) w.block_param_bytes += p.numel() * 4.0;
  for (const auto& p : model->parameters()) w.total_param_bytes += p.numel() * 4.0;
  if (sharded) fsdp_bench::shard_gpt(model);
  fsdp_bench::materialize(model);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
  w.rss_setup = resident_bytes();
  Sampler sampler(o, w.rank);
  std::vector<double> step_s;
  w.loss = train_steps(o, model, opt, w.rank, sharded, step_s);
  sampler.stop();
  w.step_s = fsdp_bench::median(step_s);
  w.state = fsdp_bench::state_bytes(*model, opt);
  {
    std::ofstream out(o.result + "." + std::to_string(w.rank));
    out << result_line(w, sampler, o.steps) << "\n";
  }
  if (sharded) fsdp::dist::destroy_distributed();
  return 0;
}

double mb(double bytes) { return bytes / 1e6; }

// One configuration's result: the rank with the largest peak.
struct Run {
  std::string name;
  int world;
  std::map<std::string, double> r;
};

// Each configuration in fresh processes: one process, then FSDP on 1 and on each --ranks.
std::vector<Run> run_configurations(const Options& o) {
  fsdp_bench::WorkerLauncher launcher("memory_bench");
  std::vector<std::string> common = o.shape.worker_args();
  common.insert(common.end(), {"--steps", std::to_string(o.steps), "--threads", std::to_string(o.threads), "--malloc",
                               fsdp_bench::malloc_policy_name(o.malloc), "--pool", o.pool, "--pool-trim", o.pool_trim,
                               "--gloo-fallback", o.gloo_fallback});
  std::vector<Run> runs;
  auto launch = [&](const std::string& name, int world, const std::string& role) {
    const std::string out = launcher.result_path(role + std::to_string(world) + "r");
    std::vector<std::string> args = {"--role", role, "--result", out};
    args.insert(args.end(), common.begin(), common.end());
    const int rc = role == "single" ? launcher.run(0, args, {"OMP_NUM_THREADS=" + std::to_string(o.threads)})
                                    : launcher.run(world, args);
    if (rc != 0)
      launcher.fail("the run '" + name + "' on " + std::to_string(world) + " rank(s) failed (exit " +
                    std::to_string(rc) + ")");
    Run result{name, world, {}};
    for (int r = 0; r < world; ++r) {
      auto kv = fsdp_bench::read_results(out + "." + std::to_string(r));
      if (result.r.empty() || kv["hwm"] > result.r["hwm"]) result.r = kv;
    }
    runs.push_back(result);
  };
  launch("one process (plain LibTorch)", 1, "single");
  launch("fully_shard, world of one", 1, "fsdp");
  for (int w : o.ranks) launch("FSDP", w, "fsdp");
  return runs;
}

// State and peak RSS per rank, the saving against one process (theoretical and realized), FSDP's
// buffers at their peak against the target, the step time.
void print_saving(const std::vector<Run>& runs) {
  const auto& one = runs.front().r;
  const double state1 = one.at("params") + one.at("grads") + one.at("optim");
  const double unit = one.at("block_param_bytes");
  std::printf(
      "\none transformer block (a unit): %.1f MB of fp32 parameters; target for FSDP's buffers at peak: "
      "2 units' parameters + gradients + one prefetched unit = %.1f MB\n",
      mb(unit), mb(5 * unit));
  std::printf(
      "\n| run | ranks | state / rank (params + grads + AdamW) | peak RSS / rank | saved vs one process | "
      "theoretical saving S(N-1)/N | realized | FSDP buffers at their peak | vs target | median step |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& run : runs) {
    const auto& r = run.r;
    const double state = r.at("params") + r.at("grads") + r.at("optim");
    const double saved = one.at("hwm") - r.at("hwm");
    const double theory = state1 * (run.world - 1) / run.world;
    const bool fsdp = run.name != runs.front().name;
    std::printf("| %s | %d | %.0f MB (%.0f + %.0f + %.0f) | %.0f MB | %.0f MB | %.0f MB | %s | %s | %s | %.2f s |\n",
                run.name.c_str(), run.world, mb(state), mb(r.at("params")), mb(r.at("grads")), mb(r.at("optim")),
                mb(r.at("hwm")), mb(saved), mb(theory),
                run.world > 1 ? (std::to_string(static_cast<int>(100 * saved / theory + 0.5)) + "%").c_str() : "-",
                fsdp ? (std::to_string(static_cast<int>(mb(r.at("fsdp_peak")) + 0.5)) + " MB").c_str() : "-",
                fsdp ? (std::to_string(r.at("fsdp_peak") / (5 * unit)).substr(0, 4) + "x").c_str() : "-",
                r.at("step_s"));
  }
}

// What each run's largest sampled RSS is made of.
void print_rss_parts(const std::vector<Run>& runs) {
  std::printf("\nAt each run's largest sampled RSS (MB): what it is made of\n\n");
  std::printf(
      "| run | ranks | RSS | training state | FSDP buffers alive (pool cached, resident) | glibc heap in use | glibc "
      "heap free, kept "
      "| glibc mmapped | rest (LibTorch, code, activations outside glibc) |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& run : runs) {
    const auto& r = run.r;
    const double state = r.at("params") + r.at("grads") + r.at("optim");
    const double accounted = r.at("s_heap_in_use") + r.at("s_heap_free") + r.at("s_mmapped") + r.at("s_pool_live") +
                             r.at("s_pool_cached_resident");
    std::printf("| %s | %d | %.0f | %.0f | %.0f (%.0f) | %.0f | %.0f | %.0f | %.0f |\n", run.name.c_str(), run.world,
                mb(r.at("s_rss")), mb(state), mb(r.at("s_fsdp")), mb(r.at("s_pool_cached_resident")),
                mb(r.at("s_heap_in_use")), mb(r.at("s_heap_free")), mb(r.at("s_mmapped")),
                mb(r.at("s_rss") - accounted));
  }
}

// FSDP's buffers by owner at their own peak and at the largest sampled RSS; the pool's counts.
void print_owners(const std::vector<Run>& runs) {
  std::printf("\nFSDP's buffers by owner (MB) at their own peak [and at the largest sampled RSS]\n\n| run | ranks |");
  for (int k = 0; k < fsdp::kBufferOwners; ++k)
    std::printf(" %s |", fsdp::buffer_owner_name(static_cast<fsdp::BufferOwner>(k)));
  std::printf(" pool: peak mapped, hits / misses |\n|---|---|");
  for (int k = 0; k <= fsdp::kBufferOwners; ++k) std::printf("---|");
  std::printf("\n");
  for (size_t i = 1; i < runs.size(); ++i) {
    const auto& r = runs[i].r;
    std::printf("| %s | %d |", runs[i].name.c_str(), runs[i].world);
    for (int k = 0; k < fsdp::kBufferOwners; ++k) {
      std::printf(" %.1f [%.1f] |", mb(r.at("at_peak_" + std::to_string(k))), mb(r.at("s_owner_" + std::to_string(k))));
    }
    std::printf(" %.0f MB, %.0f / %.0f |\n", mb(r.at("pool_peak_mapped")), r.at("pool_hits"), r.at("pool_misses"));
  }
}

// Each step's largest sample per run: where each run peaked.
void print_step_peaks(const std::vector<Run>& runs, int steps) {
  std::printf(
      "\nWhere each run peaked (the largest RSS sample of each step, MB: RSS, phase, FSDP buffers alive / pool "
      "cached and resident, glibc heap free kept; collectives issued so far: all-gathers / reduce-scatters)\n\n| run | "
      "ranks |");
  for (int s = 0; s < steps; ++s) std::printf(" step %d |", s + 1);
  std::printf("\n|---|---|");
  for (int s = 0; s < steps; ++s) std::printf("---|");
  std::printf("\n");
  for (const auto& run : runs) {
    const auto& r = run.r;
    std::printf("| %s | %d |", run.name.c_str(), run.world);
    for (int s = 0; s < steps; ++s) {
      const std::string k = std::to_string(s);
      std::printf(" %.0f, %s, %.0f / %.0f, %.0f; %.0f / %.0f |", mb(r.at("step_rss_" + k)),
                  phase_name(static_cast<int>(r.at("step_phase_" + k))), mb(r.at("step_fsdp_" + k)),
                  mb(r.at("step_pool_cached_" + k)), mb(r.at("step_heap_free_" + k)), r.at("step_ag_" + k),
                  r.at("step_rs_" + k));
    }
    std::printf("\n");
  }
}

int run_driver(const Options& o) {
  std::printf(
      "memory_bench: %s; %lld sequences per rank, %d steps, fp32, AdamW, %d thread(s) per rank; malloc %s, FSDP "
      "pool %s (trim after forward %s), Gloo fallback %s\n",
      o.shape.describe().c_str(), static_cast<long long>(o.shape.batch), o.steps, o.threads,
      fsdp_bench::malloc_policy_name(o.malloc), o.pool.c_str(), o.pool_trim.c_str(), o.gloo_fallback.c_str());
  std::fflush(stdout);
  const std::vector<Run> runs = run_configurations(o);
  print_saving(runs);
  print_rss_parts(runs);
  print_owners(runs);
  print_step_peaks(runs, o.steps);
  std::printf("\nlosses of the last step:");
  for (const auto& run : runs) std::printf(" %.5f", run.r.at("loss"));
  std::printf("\n");
  return 0;
}

}  // namespace

// ---- --mode activation: activation checkpointing's memory and time ------------------------------

namespace activation_mode {

using fsdp_bench::bad_input;
using fsdp_bench::median;

struct Options {
  int steps = 3, warmup = 1, rounds = 1;
  fsdp_bench::GptShape shape{8, 256, 4, 512, 8};  // --batch: sequences per rank
  bool fit = false;
  int64_t budget_mb = 1536;
  std::string role = "driver";    // driver | worker
  std::string ac = "none";        // none | full | every:K
  std::string parallel = "fsdp";  // fsdp | none (plain LibTorch)
  std::string result;
  bool glibc_default = false;  // keep glibc's dynamic mmap threshold (see run_worker)
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args("memory_bench --mode activation",
                        "usage: memory_bench --mode activation [--steps N] [--warmup N] [--layers N] [--dim N] "
                        "[--heads N] [--seq N] [--batch N] "
                        "[--rounds N] | --fit [--budget-mb N]; [--glibc-default-malloc]");
  o.shape.add_options(args);
  args.flag("--fit", &o.fit).flag("--glibc-default-malloc", &o.glibc_default);
  args.option("--budget-mb", &o.budget_mb).option("--role", &o.role).option("--ac", &o.ac);
  args.option("--parallel", &o.parallel).option("--result", &o.result).option("--steps", &o.steps);
  args.option("--warmup", &o.warmup).option("--rounds", &o.rounds);
  args.parse(argc, argv);
  if (o.steps < 1 || o.warmup < 0) bad_input("--steps must be positive, --warmup not negative");
  if (o.ac != "none" && o.ac != "full" && !(o.ac.rfind("every:", 0) == 0 && o.ac.size() > 6)) {
    bad_input("--ac must be none, full or every:K");
  }
  if (o.role != "driver" && o.role != "worker") bad_input("--role takes driver or worker");
  return o;
}

int run_worker(const Options& o) {
  // glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which
  // tensors below it come from the heap and stay resident when freed: the peak RSS then measures
  // the heap's high-water mark, not the tensors alive at once. A fixed 1 MiB threshold returns
  // every freed tensor to the system, so the peak follows what is alive (--glibc-default-malloc:
  // leave glibc as it is).
  if (!o.glibc_default) mallopt(M_MMAP_THRESHOLD, 1 << 20);
  const bool sharded = o.parallel == "fsdp";
  const auto [rank, world] = fsdp_bench::join_world(sharded);
  fsdp::models::GPT model(o.shape.config(torch::kMeta));  // a sharded rank never holds the whole model
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  if (o.ac == "full") {
    fsdp::activation::apply_activation_checkpointing(*model, fsdp::activation::every_kth<fsdp::models::BlockImpl>(1));
  } else if (o.ac.rfind("every:", 0) == 0) {
    fsdp::activation::apply_activation_checkpointing(
        *model, fsdp::activation::every_kth<fsdp::models::BlockImpl>(std::stoi(o.ac.substr(6))));
  }
  if (sharded) fsdp_bench::shard_gpt(model);
  fsdp_bench::materialize(model);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
  auto gen = fsdp_bench::token_stream(rank);
  const double rss_before = fsdp_bench::resident_bytes();
  fsdp_bench::Samples steps;
  double loss_value = 0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    auto data = fsdp_bench::random_tokens(gen, o.shape.batch, o.shape.seq);
    const fsdp_bench::Stopwatch step;
    loss_value = fsdp_bench::train_step(model, opt, data).item<double>();  // fsdp::call: the checkpoint wrappers
    if (s >= o.warmup) steps.add(step);
  }
  const auto state = fsdp_bench::state_bytes(*model, opt);
  // Every rank's peak: the table shows the largest.
  double peak = fsdp_bench::peak_rss_bytes(), base = rss_before;
  if (sharded && world > 1) {
    auto t = at::tensor({peak, base}, at::kDouble);
    fsdp::dist::world_comm()->all_reduce(t, fsdp::comm::ReduceOp::Max);
    peak = t[0].item<double>();
    base = t[1].item<double>();
  }
  if (rank == 0 && !o.result.empty()) {
    std::ofstream out(o.result, std::ios::app);
    out << "step_s " << steps.wall_median() << " cpu_s " << steps.cpu_median() << " peak " << peak << " base " << base
        << " params " << state.params << " grads " << state.grads << " optim " << state.optim << " n_params "
        << n_params << " world " << world << " loss " << loss_value << "\n";
  }
  if (sharded) fsdp::dist::destroy_distributed();
  return 0;
}

// One configuration in fresh processes (fsdprun for several ranks); returns its result, with the
// exit status in "rc" (the rest empty when it failed).
struct Driver {
  fsdp_bench::WorkerLauncher launcher{"memory_bench"};
  bool glibc_default = false;

  explicit Driver(bool glibc_default_malloc) : glibc_default(glibc_default_malloc) {}

  std::map<std::string, double> run(int nproc, std::vector<std::string> args) {
    const std::string out = launcher.result_path("r");
    std::vector<std::string> cmd = {"--mode", "activation", "--role", "worker", "--result", out};
    cmd.insert(cmd.end(), args.begin(), args.end());
    if (glibc_default) cmd.push_back("--glibc-default-malloc");
    const int threads = fsdp::dist::default_omp_threads(nproc);
    const int rc = launcher.run(nproc > 1 ? nproc : 0, cmd, {"OMP_NUM_THREADS=" + std::to_string(threads)});
    auto r = fsdp_bench::read_results(out);
    r["rc"] = rc;
    return r;
  }
};

int run_memory(const Options& o) {
  Driver d(o.glibc_default);
  std::printf(
      "memory_bench --mode activation: %s, batch %lld per rank, float32, fully_shard in a world of one; %d steps after "
      "%d "
      "warm-up, %d round(s); peak RSS of a fresh process per row\n",
      o.shape.describe().c_str(), static_cast<long long>(o.shape.batch), o.steps, o.warmup, o.rounds);
  std::fflush(stdout);
  std::vector<std::string> common = o.shape.worker_args();
  common.insert(common.end(), {"--steps", std::to_string(o.steps), "--warmup", std::to_string(o.warmup)});
  // Rounds alternate the configurations (the machine is shared and noisy): per configuration the
  // median over rounds of each run's median step time, and the largest peak.
  std::map<std::string, std::map<std::string, double>> rows;
  std::map<std::string, std::vector<double>> walls, cpus;
  for (int round = 0; round < o.rounds; ++round) {
    for (const std::string ac : {"none", "full", "every:2"}) {
      auto args = common;
      args.insert(args.end(), {"--ac", ac});
      auto r = d.run(1, args);
      if (r["rc"] != 0) d.launcher.fail("the " + ac + " run failed");
      walls[ac].push_back(r["step_s"]);
      cpus[ac].push_back(r["cpu_s"]);
      const double peak = std::max(rows[ac]["peak"], r["peak"]);
      rows[ac] = r;
      rows[ac]["peak"] = peak;
    }
  }
  for (auto& [ac, r] : rows) {
    r["step_s"] = median(walls[ac]);
    r["cpu_s"] = median(cpus[ac]);
  }
  const auto& none = rows["none"];
  std::printf(
      "\n| activation checkpointing | peak RSS | vs none | added by training | vs none | step time | vs none | CPU "
      "time / step | vs none | params / grads / optimizer |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string ac : {"none", "full", "every:2"}) {
    auto& r = rows[ac];
    std::printf(
        "| %s | %.0f MB | %.3fx | %.0f MB | %.3fx | %.2f s | %.3fx | %.2f s | %.3fx | %.1f / %.1f / %.1f MB |\n",
        ac.c_str(), r["peak"] / 1e6, r["peak"] / none.at("peak"), (r["peak"] - r["base"]) / 1e6,
        (r["peak"] - r["base"]) / (none.at("peak") - none.at("base")), r["step_s"], r["step_s"] / none.at("step_s"),
        r["cpu_s"], r["cpu_s"] / none.at("cpu_s"), r["params"] / 1e6, r["grads"] / 1e6, r["optim"] / 1e6);
  }
  const double mem = rows["full"]["peak"] / none.at("peak"), time = rows["full"]["step_s"] / none.at("step_s");
  const double added = (rows["full"]["peak"] - rows["full"]["base"]) / (none.at("peak") - none.at("base"));
  const double cpu = rows["full"]["cpu_s"] / none.at("cpu_s");
  std::printf(
      "\nfull vs none: peak RSS %.3fx (target <= 0.50: %s; memory added by training %.3fx), step time %.3fx "
      "(target <= 1.40: %s; CPU time per step %.3fx); losses %.4f / %.4f / %.4f\n",
      mem, mem <= 0.5 ? "met" : "NOT met", added, time, time <= 1.4 ? "met" : "NOT met", cpu, none.at("loss"),
      rows["full"]["loss"], rows["every:2"]["loss"]);
  return 0;
}

int run_fit(const Options& o) {
  Driver d(o.glibc_default);
  const fsdp_bench::GptShape fit{14, 768, 12, 512, 1};  // ~100M parameters, 1 sequence per rank
  std::printf(
      "memory_bench --mode activation --fit: %s, 1 sequence per rank, float32, AdamW; %d steps after %d warm-up; "
      "budget %lld MiB "
      "per process%s\n",
      fit.describe().c_str(), o.steps, o.warmup, static_cast<long long>(o.budget_mb), " (stated)");
  std::fflush(stdout);
  std::vector<std::string> common = fit.worker_args();
  common.insert(common.end(), {"--steps", std::to_string(o.steps), "--warmup", std::to_string(o.warmup)});
  struct Row {
    std::string name;
    int nproc;
    std::string parallel, ac;
  };
  const std::vector<Row> rows = {{"one process (plain LibTorch)", 1, "none", "none"},
                                 {"FSDP 2 ranks", 2, "fsdp", "none"},
                                 {"FSDP 2 ranks + full checkpointing", 2, "fsdp", "full"},
                                 {"FSDP 4 ranks + full checkpointing", 4, "fsdp", "full"}};
  std::printf(
      "\n| run | peak RSS / rank | budget %lld MiB | params / grads / optimizer per rank | step time (CPU time) |\n",
      static_cast<long long>(o.budget_mb));
  std::printf("|---|---|---|---|---|\n");
  const double budget = static_cast<double>(o.budget_mb) * 1048576.0;
  for (const auto& row : rows) {
    auto args = common;
    args.insert(args.end(), {"--parallel", row.parallel, "--ac", row.ac});
    auto r = d.run(row.nproc, args);
    if (r["rc"] != 0) {
      std::printf("| %s | - | exceeded: the run failed (exit %d) | - | - |\n", row.name.c_str(),
                  static_cast<int>(r["rc"]));
    } else {
      std::printf("| %s (%.1fM params) | %.0f MiB | %s | %.0f / %.0f / %.0f MiB | %.1f s (%.1f s) |\n",
                  row.name.c_str(), r["n_params"] / 1e6, r["peak"] / 1048576.0,
                  r["peak"] <= budget ? "fits" : "EXCEEDS", r["params"] / 1048576.0, r["grads"] / 1048576.0,
                  r["optim"] / 1048576.0, r["step_s"], r["cpu_s"]);
    }
    std::fflush(stdout);
  }
  return 0;
}

int run(const Options& o) {
  if (o.role == "worker") return run_worker(o);
  return o.fit ? run_fit(o) : run_memory(o);
}
}  // namespace activation_mode

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::vector<char*> args(argv, argv + argc + 1);  // argv[argc] is the null pointer
  const std::string mode = fsdp_bench::take_mode(argc, args.data(), "memory_bench", {"memory", "activation"});
  if (mode == "activation") {
    return fsdp_bench::run_main(argc, args.data(), activation_mode::parse, activation_mode::run);
  }
  return fsdp_bench::run_main(argc, args.data(), parse, [](const Options& o) {
    return o.role == "driver" ? run_driver(o) : run_worker(o, /*sharded=*/o.role == "fsdp");
  });
}
