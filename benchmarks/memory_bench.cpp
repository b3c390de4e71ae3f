// memory_bench: where a rank's memory goes under fully_shard, against one process.
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
#include <malloc.h>

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
      "usage: memory_bench [--small] [--ranks 2,4] [--steps N] [--batch N] [--layers N] [--dim N] [--heads N] "
      "[--seq N] [--threads N] [--malloc default|tuned|speed|warm] [--pool on|off] [--pool-trim on|off] "
      "[--gloo-fallback p2p|collective] [--timeline FILE (with --role)]");
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

int run_worker(const Options& o, bool sharded) {
  fsdp_bench::apply_malloc_policy(o.malloc);
  fsdp::comm::set_gloo_fallback(o.gloo_fallback == "p2p" ? fsdp::comm::GlooFallback::PointToPoint
                                                         : fsdp::comm::GlooFallback::Collective);
  {
    fsdp::BufferPoolOptions pool;
    pool.enabled = o.pool == "on";
    pool.trim_after_forward = o.pool_trim == "on";
    fsdp::set_buffer_pool_options(pool);
  }
  at::set_num_threads(o.threads);
  const auto [rank, world] = fsdp_bench::join_world(sharded);
  fsdp::models::GPT model(o.shape.config(torch::kMeta));
  double block_param_bytes = 0, total_param_bytes = 0;
  for (const auto& p : model->blocks.front()->parameters()) block_param_bytes += p.numel() * 4.0;
  for (const auto& p : model->parameters()) total_param_bytes += p.numel() * 4.0;
  if (sharded) fsdp_bench::shard_gpt(model);
  fsdp_bench::materialize(model);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
  const double rss_setup = resident_bytes();

  std::atomic<bool> stop{false};
  std::mutex mu;
  Sample peak;
  std::vector<Sample> step_peaks(static_cast<size_t>(o.steps));  // the largest RSS sample of each step
  std::unique_ptr<std::ofstream> timeline;
  if (!o.timeline.empty()) {
    timeline = std::make_unique<std::ofstream>(o.timeline + "." + std::to_string(rank));
    *timeline << "# t_s step phase all_gathers reduce_scatters rss_MB fsdp_alive_MB pool_live_MB pool_cached_MB "
                 "pool_cached_resident_MB "
                 "heap_in_use_MB heap_free_MB glibc_mmapped_MB\n";
  }
  const auto t_start = std::chrono::steady_clock::now();
  std::thread sampler([&] {
    Sample last;
    while (!stop.load()) {
      Sample s = take_sample();
      s.t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      {
        std::lock_guard<std::mutex> lock(mu);
        if (s.rss > peak.rss) peak = s;
        if (s.step >= 0 && s.step < o.steps && s.rss > step_peaks[static_cast<size_t>(s.step)].rss) {
          step_peaks[static_cast<size_t>(s.step)] = s;
        }
      }
      if (timeline && (std::abs(s.rss - last.rss) >= 1e6 || s.phase != last.phase || s.step != last.step)) {
        write_sample(*timeline, s);
        last = s;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  struct JoinAtExit {  // an exception in training must not leave a joinable thread behind
    std::atomic<bool>& stop;
    std::thread& t;
    ~JoinAtExit() {
      stop = true;
      if (t.joinable()) t.join();
    }
  } join_at_exit{stop, sampler};
  auto gen = fsdp_bench::token_stream(rank);
  double loss_value = 0;
  std::vector<double> step_s;
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
  stop = true;
  sampler.join();
  const auto state = fsdp_bench::state_bytes(*model, opt);
  const auto fsdp_stats = fsdp::buffer_memory_stats();
  std::ostringstream line;
  line << "rank " << rank << " world " << world << " step_s " << fsdp_bench::median(step_s) << " hwm "
       << fsdp_bench::vm_hwm_bytes() << " rss_setup " << rss_setup << " params " << state.params << " grads "
       << state.grads << " optim " << state.optim << " block_param_bytes " << block_param_bytes << " total_param_bytes "
       << total_param_bytes << " loss " << loss_value << " s_rss " << peak.rss << " s_heap_in_use " << peak.heap_in_use
       << " s_heap_free " << peak.heap_free << " s_mmapped " << peak.mmapped << " s_fsdp " << peak.fsdp.total
       << " s_pool_cached " << peak.fsdp.pool_cached << " s_pool_live " << peak.fsdp.pool_live
       << " s_pool_cached_resident " << peak.fsdp.pool_cached_resident << " fsdp_peak " << fsdp_stats.peak
       << " pool_peak_mapped " << fsdp_stats.pool_peak_mapped << " pool_hits " << fsdp_stats.pool_hits
       << " pool_misses " << fsdp_stats.pool_misses;
  for (int k = 0; k < fsdp::kBufferOwners; ++k) line << " at_peak_" << k << " " << fsdp_stats.at_peak[k];
  for (int k = 0; k < fsdp::kBufferOwners; ++k) line << " s_owner_" << k << " " << peak.fsdp.current[k];
  // Where the peak was: the step, the phase, the collectives issued so far; and each step's peak.
  line << " s_step " << peak.step << " s_phase " << peak.phase << " s_all_gathers " << peak.all_gathers
       << " s_reduce_scatters " << peak.reduce_scatters;
  for (int s = 0; s < o.steps; ++s) {
    const auto& sp = step_peaks[static_cast<size_t>(s)];
    line << " step_rss_" << s << " " << sp.rss << " step_phase_" << s << " " << sp.phase << " step_rs_" << s << " "
         << sp.reduce_scatters << " step_ag_" << s << " " << sp.all_gathers << " step_pool_cached_" << s << " "
         << sp.fsdp.pool_cached_resident << " step_fsdp_" << s << " " << sp.fsdp.total << " step_heap_free_" << s << " "
         << sp.heap_free << " step_heap_in_use_" << s << " " << sp.heap_in_use;
  }
  {
    std::ofstream out(o.result + "." + std::to_string(rank));
    out << line.str() << "\n";
  }
  if (sharded) fsdp::dist::destroy_distributed();
  return 0;
}

double mb(double bytes) { return bytes / 1e6; }

int run_driver(const Options& o) {
  fsdp_bench::WorkerLauncher launcher("memory_bench");
  std::vector<std::string> common = o.shape.worker_args();
  common.insert(common.end(), {"--steps", std::to_string(o.steps), "--threads", std::to_string(o.threads), "--malloc",
                               fsdp_bench::malloc_policy_name(o.malloc), "--pool", o.pool, "--pool-trim", o.pool_trim,
                               "--gloo-fallback", o.gloo_fallback});
  std::printf(
      "memory_bench: %s; %lld sequences per rank, %d steps, fp32, AdamW, %d thread(s) per rank; malloc %s, FSDP "
      "pool %s (trim after forward %s), Gloo fallback %s\n",
      o.shape.describe().c_str(), static_cast<long long>(o.shape.batch), o.steps, o.threads,
      fsdp_bench::malloc_policy_name(o.malloc), o.pool.c_str(), o.pool_trim.c_str(), o.gloo_fallback.c_str());
  std::fflush(stdout);
  struct Run {
    std::string name;
    int world;
    std::map<std::string, double> r;  // the rank with the largest peak
  };
  std::vector<Run> runs;
  // Each configuration in fresh processes: one process, then FSDP on 1 and on each --ranks.
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
    for (int r = 0; r < world; ++r) {  // the rank with the largest peak
      auto kv = fsdp_bench::read_results(out + "." + std::to_string(r));
      if (result.r.empty() || kv["hwm"] > result.r["hwm"]) result.r = kv;
    }
    runs.push_back(result);
  };
  launch("one process (plain LibTorch)", 1, "single");
  launch("fully_shard, world of one", 1, "fsdp");
  for (int w : o.ranks) launch("FSDP", w, "fsdp");
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
  std::printf(
      "\nWhere each run peaked (the largest RSS sample of each step, MB: RSS, phase, FSDP buffers alive / pool "
      "cached and resident, glibc heap free kept; collectives issued so far: all-gathers / reduce-scatters)\n\n| run | "
      "ranks |");
  for (int s = 0; s < o.steps; ++s) std::printf(" step %d |", s + 1);
  std::printf("\n|---|---|");
  for (int s = 0; s < o.steps; ++s) std::printf("---|");
  std::printf("\n");
  for (const auto& run : runs) {
    const auto& r = run.r;
    std::printf("| %s | %d |", run.name.c_str(), run.world);
    for (int s = 0; s < o.steps; ++s) {
      const std::string k = std::to_string(s);
      std::printf(" %.0f, %s, %.0f / %.0f, %.0f; %.0f / %.0f |", mb(r.at("step_rss_" + k)),
                  phase_name(static_cast<int>(r.at("step_phase_" + k))), mb(r.at("step_fsdp_" + k)),
                  mb(r.at("step_pool_cached_" + k)), mb(r.at("step_heap_free_" + k)), r.at("step_ag_" + k),
                  r.at("step_rs_" + k));
    }
    std::printf("\n");
  }
  std::printf("\nlosses of the last step:");
  for (const auto& run : runs) std::printf(" %.5f", run.r.at("loss"));
  std::printf("\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp_bench::run_main(argc, argv, parse, [](const Options& o) {
    return o.role == "driver" ? run_driver(o) : run_worker(o, /*sharded=*/o.role == "fsdp");
  });
}
