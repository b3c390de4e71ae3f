// bench: FSDP against the physical limit, measured in one run.
//
//   build/bin/bench [--nproc 2] [--steps 20] [--warmup 3] [--rounds 2]
//                   [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 8] [--hsdp RxS]
//
// The limit on a CPU is one process doing one rank's share of the work (the global batch / N,
// with the cores / N threads a rank gets), with no communication. bench runs that and the N-rank
// FSDP run alternately (--rounds times each: the machines are noisy), then prints both median
// step times and their ratio, per-rank memory and the bytes each rank sent per step. Rows for
// replicate (DDP) and HSDP (fully_shard on a --hsdp RxS mesh, default 2 x N/2, or N x 1 when N is
// odd or 2) put FSDP's trade-off next to the alternatives: bytes sent, step time, memory.
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench_support.h"
#include "fsdp/fsdp.h"
#include "fsdp/memory/buffer_pool.h"
#include "fsdp/memory/malloc_tuning.h"
#include "models/gpt.h"


namespace {

using fsdp_bench::median;
using fsdp_bench::spawn_and_wait;
using fsdp_bench::peak_rss_bytes;

struct Options {
  int nproc = 2, steps = 20, warmup = 3, rounds = 2;
  int64_t layers = 4, dim = 256, heads = 4, seq = 128, batch = 8;
  std::string role = "driver";  // driver | single | fsdp
  std::string mp = "fp32";      // fp32 | bf16 (MixedPrecisionPolicy: bf16 params, fp32 reduce)
  std::string mode = "fsdp";    // fsdp | hsdp | replicate (the distributed worker's parallelism)
  std::string hsdp;             // "RxS" for the HSDP row (default: see parse)
  std::string result;           // where a worker writes its result line
  std::string pool_trim = "on"; // BufferPoolOptions::trim_after_forward (worker; for comparison)
  std::string malloc = "default"; // default | speed (every worker: fsdp::tune_malloc_for_speed)
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench: %s\nusage: bench [--nproc N] [--steps N] [--warmup N] [--rounds N] [--layers N] [--dim N] "
               "[--heads N] [--seq N] [--batch N] [--hsdp RxS] [--pool-trim on|off] [--malloc default|speed]\n"
               "FSDP_PHASE_TIMERS=1 makes every FSDP worker print where FSDP's own time went, by phase\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  std::map<std::string, int64_t*> ints = {{"--layers", &o.layers}, {"--dim", &o.dim}, {"--heads", &o.heads},
                                          {"--seq", &o.seq},       {"--batch", &o.batch}};
  std::map<std::string, int*> small = {
      {"--nproc", &o.nproc}, {"--steps", &o.steps}, {"--warmup", &o.warmup}, {"--rounds", &o.rounds}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + a).c_str());
    std::string v = argv[++i];
    if (a == "--role") o.role = v;
    else if (a == "--result") o.result = v;
    else if (a == "--mp") o.mp = v;
    else if (a == "--mode") o.mode = v;
    else if (a == "--hsdp") o.hsdp = v;
    else if (a == "--pool-trim") o.pool_trim = v;
    else if (a == "--malloc") o.malloc = v;
    else if (ints.count(a)) *ints[a] = std::stoll(v);
    else if (small.count(a)) *small[a] = std::stoi(v);
    else usage(("unknown option " + a).c_str());
  }
  if (o.nproc < 1 || o.batch % o.nproc != 0) usage("--batch must be a positive multiple of --nproc");
  if (o.steps < 1) usage("--steps must be positive");
  if (o.pool_trim != "on" && o.pool_trim != "off") usage("--pool-trim takes on or off");
  if (o.malloc != "default" && o.malloc != "speed") usage("--malloc takes default or speed");
  if (o.hsdp.empty()) {
    o.hsdp = (o.nproc % 2 == 0 && o.nproc >= 4) ? "2x" + std::to_string(o.nproc / 2) : std::to_string(o.nproc) + "x1";
  }
  const auto x = o.hsdp.find('x');
  if (x == std::string::npos || std::stoll(o.hsdp.substr(0, x)) * std::stoll(o.hsdp.substr(x + 1)) != o.nproc) {
    usage("--hsdp must be RxS with R * S = --nproc");
  }
  return o;
}

fsdp::models::GPTConfig config_of(const Options& o) {
  fsdp::models::GPTConfig c;
  c.vocab_size = 256;
  c.block_size = o.seq;
  c.n_layer = o.layers;
  c.n_head = o.heads;
  c.n_embd = o.dim;
  return c;
}

double state_bytes(torch::nn::Module& model, torch::optim::AdamW& opt) {
  double bytes = 0;
  for (const auto& p : model.parameters()) bytes += p.nbytes() + (p.grad().defined() ? p.grad().nbytes() : 0);
  for (const auto& item : opt.state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*item.second);
    bytes += st.exp_avg().nbytes() + st.exp_avg_sq().nbytes();
  }
  return bytes;
}

// One worker: trains `local_batch` sequences per step, sharded or not; writes one result line.
int run_worker(const Options& o, bool sharded) {
  // --malloc speed: glibc's heap keeps freed tensors (no page faulted in again each step), in the
  // one-process run and the distributed ones alike (fsdp/memory/malloc_tuning.h).
  if (o.malloc == "speed") fsdp::tune_malloc_for_speed();
  {
    fsdp::BufferPoolOptions pool;
    pool.trim_after_forward = o.pool_trim == "on";
    fsdp::set_buffer_pool_options(pool);
  }
  int rank = 0, world = 1;
  if (sharded) {
    fsdp::dist::init_distributed();
    rank = fsdp::dist::rank();
    world = fsdp::dist::world_size();
  }
  const int64_t local_batch = o.batch / o.nproc;
  const auto c = config_of(o);
  torch::manual_seed(0);
  fsdp::models::GPT model(c);
  double param_bytes = 0;
  for (const auto& p : model->parameters()) param_bytes += p.nbytes();
  if (sharded && o.mode == "replicate") {
    fsdp::replicate(model);
  } else if (sharded) {
    fsdp::FullyShardOptions opts;
    if (o.mode == "hsdp") {
      const auto x = o.hsdp.find('x');
      opts.mesh = fsdp::init_device_mesh({std::stoll(o.hsdp.substr(0, x)), std::stoll(o.hsdp.substr(x + 1))},
                                         {"replicate", "shard"});
    }
    if (o.mp == "bf16") {
      opts.mp_policy.param_dtype = at::kBFloat16;
      opts.mp_policy.reduce_dtype = at::kFloat;
    }
    for (auto& b : model->blocks) fsdp::fully_shard(b, opts);
    fsdp::fully_shard(model, opts);
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::detail::createCPUGenerator(1234 + rank);
  std::vector<double> times;
  double first_loss = 0;
  auto stats0 = fsdp::comm::process_comm_stats().snapshot();
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      stats0 = fsdp::comm::process_comm_stats().snapshot();
      fsdp::reset_phase_timers();
    }
    auto data = at::randint(c.vocab_size, {local_batch, c.block_size + 1}, gen, at::kLong);
    auto t0 = std::chrono::steady_clock::now();
    opt.zero_grad();
    auto input = data.narrow(1, 0, c.block_size);
    auto logits = sharded ? fsdp::call(model, input) : model->forward(input);
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
    const double value = loss.item<float>();
    if (s == 0) first_loss = value;
    if (s >= o.warmup) times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  auto comm = fsdp::comm::process_comm_stats().snapshot() - stats0;
  if (rank == 0 && !o.result.empty()) {
    std::ofstream out(o.result, std::ios::app);
    out << "median_step_s " << median(times) << " state_bytes " << state_bytes(*model, opt) << " max_rss "
        << peak_rss_bytes() << " comm_bytes_per_step " << comm.total_bytes() / static_cast<double>(o.steps)
        << " param_bytes " << param_bytes << " world " << world << " all_reduce_bytes_per_step "
        << comm[fsdp::comm::OpKind::AllReduce].bytes_sent / static_cast<double>(o.steps) << " first_loss "
        << first_loss << "\n";
  }
  if (sharded && fsdp::phase_timers_enabled()) {
    // FSDP_PHASE_TIMERS=1: where FSDP's own time went on this rank (fsdp/sharding/phase_timers.h).
    double total = 0;
    for (double t : times) total += t;
    std::printf("rank %d: %.1f ms per step (mean of %d); FSDP's phases:\n%s", rank, 1e3 * total / o.steps, o.steps,
                fsdp::phase_times().table(o.steps).c_str());
    std::fflush(stdout);
  }
  if (sharded) fsdp::dist::destroy_distributed();
  return 0;
}

std::map<std::string, double> read_results(const std::string& path, std::vector<double>& medians) {
  std::ifstream in(path);
  std::string line;
  std::map<std::string, double> last;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string k;
    double v;
    while (ls >> k >> v) last[k] = v;
    medians.push_back(last["median_step_s"]);
  }
  return last;
}

int run_driver(const Options& o, const char* argv0) {
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) usage("cannot find this program's path");
  self[n] = '\0';
  std::string dir = std::string(self).substr(0, std::string(self).rfind('/'));
  const std::string fsdprun = dir + "/fsdprun";
  if (access(fsdprun.c_str(), X_OK) != 0) usage(("fsdprun not found next to bench: " + fsdprun).c_str());
  char tmpl[] = "/tmp/fsdp-bench-XXXXXX";
  if (!mkdtemp(tmpl)) usage("cannot create a temporary folder");
  const std::string single_out = std::string(tmpl) + "/single", fsdp_out = std::string(tmpl) + "/fsdp",
                    local_out = std::string(tmpl) + "/local", bf16_out = std::string(tmpl) + "/bf16",
                    hsdp_out = std::string(tmpl) + "/hsdp", ddp_out = std::string(tmpl) + "/replicate";
  std::vector<std::string> common = {"--steps",  std::to_string(o.steps), "--warmup", std::to_string(o.warmup),
                                     "--layers", std::to_string(o.layers), "--dim",   std::to_string(o.dim),
                                     "--heads",  std::to_string(o.heads), "--seq",    std::to_string(o.seq),
                                     "--batch",  std::to_string(o.batch), "--nproc",  std::to_string(o.nproc),
                                     "--malloc", o.malloc};
  const int threads = fsdp::dist::default_omp_threads(o.nproc);
  std::printf("bench: GPT %lld layers, d=%lld, %lld heads, seq %lld, global batch %lld, float32; %d ranks x %d "
              "thread(s); %d steps after %d warm-up, %d rounds; malloc %s\n",
              static_cast<long long>(o.layers), static_cast<long long>(o.dim), static_cast<long long>(o.heads),
              static_cast<long long>(o.seq), static_cast<long long>(o.batch), o.nproc, threads, o.steps, o.warmup,
              o.rounds, o.malloc.c_str());
  std::fflush(stdout);
  for (int r = 0; r < o.rounds; ++r) {
    std::vector<std::string> single = {self, "--role", "single", "--result", single_out};
    single.insert(single.end(), common.begin(), common.end());
    if (spawn_and_wait(single, {"OMP_NUM_THREADS=" + std::to_string(threads)}) != 0) usage("the single-process run failed");
    // fully_shard in a world of one: every copy FSDP makes, no network. Splits the overhead into
    // bookkeeping (this row) and communication (the rest).
    std::vector<std::string> local = {self, "--role", "fsdp", "--result", local_out};
    local.insert(local.end(), common.begin(), common.end());
    if (spawn_and_wait(local, {"OMP_NUM_THREADS=" + std::to_string(threads)}) != 0) usage("the world-of-one run failed");
    std::vector<std::string> sharded = {fsdprun, "--nproc-per-node", std::to_string(o.nproc), "--master-port", "0",
                                        "--", self, "--role", "fsdp", "--result", fsdp_out};
    sharded.insert(sharded.end(), common.begin(), common.end());
    if (spawn_and_wait(sharded, {}) != 0) usage("the FSDP run failed");
    std::vector<std::string> bf16 = {fsdprun, "--nproc-per-node", std::to_string(o.nproc), "--master-port", "0",
                                     "--", self, "--role", "fsdp", "--mp", "bf16", "--result", bf16_out};
    bf16.insert(bf16.end(), common.begin(), common.end());
    if (spawn_and_wait(bf16, {}) != 0) usage("the FSDP bf16 run failed");
    std::vector<std::string> hsdp = {fsdprun, "--nproc-per-node", std::to_string(o.nproc), "--master-port", "0",
                                     "--", self, "--role", "fsdp", "--mode", "hsdp", "--hsdp", o.hsdp, "--result", hsdp_out};
    hsdp.insert(hsdp.end(), common.begin(), common.end());
    if (spawn_and_wait(hsdp, {}) != 0) usage("the HSDP run failed");
    std::vector<std::string> ddp = {fsdprun, "--nproc-per-node", std::to_string(o.nproc), "--master-port", "0",
                                    "--", self, "--role", "fsdp", "--mode", "replicate", "--result", ddp_out};
    ddp.insert(ddp.end(), common.begin(), common.end());
    if (spawn_and_wait(ddp, {}) != 0) usage("the replicate run failed");
  }
  std::vector<double> single_medians, fsdp_medians;
  auto single = read_results(single_out, single_medians);
  auto fsdp = read_results(fsdp_out, fsdp_medians);
  std::vector<double> local_medians, bf16_medians;
  auto bf16 = read_results(bf16_out, bf16_medians);
  const double bf16_step = median(bf16_medians);
  auto local = read_results(local_out, local_medians);
  std::vector<double> hsdp_medians, ddp_medians;
  auto hsdp = read_results(hsdp_out, hsdp_medians);
  auto ddp = read_results(ddp_out, ddp_medians);
  const double hsdp_step = median(hsdp_medians), ddp_step = median(ddp_medians);
  const double local_step = median(local_medians);
  const double single_step = median(single_medians), fsdp_step = median(fsdp_medians);
  const double expected = 3 * fsdp["param_bytes"] * (o.nproc - 1) / o.nproc;
  std::printf("\n| run | ranks | step time (median) | vs limit | train state / rank | max RSS / rank | sent / rank / step |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  std::printf("| one process, per-rank work (batch %lld) | 1 | %.1f ms | 1.00x (the limit) | %.2f MB | %.0f MB | 0 |\n",
              static_cast<long long>(o.batch / o.nproc), 1e3 * single_step, single["state_bytes"] / 1e6,
              single["max_rss"] / 1e6);
  std::printf("| fully_shard, world of one (batch %lld): copies, no network | 1 | %.1f ms | %.2fx | %.2f MB | %.0f MB | 0 |\n",
              static_cast<long long>(o.batch / o.nproc), 1e3 * local_step, local_step / single_step,
              local["state_bytes"] / 1e6, local["max_rss"] / 1e6);
  std::printf("| FSDP fp32 (batch %lld) | %d | %.1f ms | %.2fx | %.2f MB | %.0f MB | %.2f MB (3 x params x (N-1)/N = %.2f MB) |\n",
              static_cast<long long>(o.batch), o.nproc, 1e3 * fsdp_step, fsdp_step / single_step,
              fsdp["state_bytes"] / 1e6, fsdp["max_rss"] / 1e6, fsdp["comm_bytes_per_step"] / 1e6, expected / 1e6);
  std::printf("| FSDP bf16 params, fp32 reduce (batch %lld) | %d | %.1f ms | %.2fx | %.2f MB | %.0f MB | %.2f MB |\n",
              static_cast<long long>(o.batch), o.nproc, 1e3 * bf16_step, bf16_step / single_step,
              bf16["state_bytes"] / 1e6, bf16["max_rss"] / 1e6, bf16["comm_bytes_per_step"] / 1e6);
  // HSDP: FSDP's three passes within the S shard ranks, plus an all-reduce of a 1/S shard over R.
  const double hr = std::stod(o.hsdp.substr(0, o.hsdp.find('x'))), hs = o.nproc / hr;
  const double hsdp_expected = fsdp["param_bytes"] * (3 * (hs - 1) / hs + 2 * (hr - 1) / hr / hs);
  std::printf("| HSDP %s, replicate x shard (batch %lld) | %d | %.1f ms | %.2fx | %.2f MB | %.0f MB | %.2f MB, %.2f MB of it across replicas (3 x params x (S-1)/S + 2 x params/S x (R-1)/R = %.2f MB) |\n",
              o.hsdp.c_str(), static_cast<long long>(o.batch), o.nproc, 1e3 * hsdp_step, hsdp_step / single_step,
              hsdp["state_bytes"] / 1e6, hsdp["max_rss"] / 1e6, hsdp["comm_bytes_per_step"] / 1e6,
              hsdp["all_reduce_bytes_per_step"] / 1e6, hsdp_expected / 1e6);
  std::printf("| replicate (DDP: 1 MiB first bucket, then 25 MiB) (batch %lld) | %d | %.1f ms | %.2fx | %.2f MB | %.0f MB | %.2f MB (2 x params x (N-1)/N = %.2f MB) |\n",
              static_cast<long long>(o.batch), o.nproc, 1e3 * ddp_step, ddp_step / single_step, ddp["state_bytes"] / 1e6,
              ddp["max_rss"] / 1e6, ddp["comm_bytes_per_step"] / 1e6, 2 * expected / 3 / 1e6);
  std::printf("\nratio FSDP / limit = %.3f (target <= 1.10); per-round medians: single", fsdp_step / single_step);
  for (double m : single_medians) std::printf(" %.1f", 1e3 * m);
  std::printf(" ms, fsdp");
  for (double m : fsdp_medians) std::printf(" %.1f", 1e3 * m);
  std::printf(" ms\n");
  (void)argv0;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  Options o = parse(argc, argv);
  try {
    if (o.role == "single") return run_worker(o, false);
    if (o.role == "fsdp") return run_worker(o, true);
    if (o.role == "driver") return run_driver(o, argv[0]);
    usage(("unknown --role " + o.role).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: %s\n", e.what());
    return 1;
  }
}
