// bench: FSDP against the physical limit, measured in one run.
//
//   build/bin/bench [--nproc 2] [--steps 20] [--warmup 3] [--rounds 2]
//                   [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 8] [--hsdp RxS]
//                   [--malloc default|speed] [--rows single,local,fsdp,keep-last,zero2,bf16,hsdp,replicate]
//
// The limit on a CPU is one process doing one rank's share of the work (the global batch / N,
// with the cores / N threads a rank gets), with no communication. bench runs that and the N-rank
// FSDP run alternately (--rounds times each: the machines are noisy), then prints both median
// step times and their ratio, per-rank memory and the bytes each rank sent per step. Rows for
// replicate (DDP) and HSDP (fully_shard on a --hsdp RxS mesh, default 2 x N/2, or N x 1 when N is
// odd or 2) put FSDP's trade-off next to the alternatives: bytes sent, step time, memory; two
// more show what resharding less after forward buys (fewer bytes, more memory). --rows picks rows
// (single must be one: the limit).
//
// The transport floor: after its timed steps the FSDP fp32 worker replays the collectives of its
// last step with no compute and measures the CPU they take (transport_floor). Where every core
// computes (ranks x threads >= cores) no FSDP can beat the limit plus that CPU on this transport;
// the driver prints that ratio next to the measured one.
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
#include "fsdp/comm/flight_recorder.h"
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
  std::string role = "driver";      // driver | single | fsdp
  std::string mp = "fp32";          // fp32 | bf16 (MixedPrecisionPolicy: bf16 params, fp32 reduce)
  std::string mode = "fsdp";        // fsdp | hsdp | replicate (the distributed worker's parallelism)
  std::string hsdp;                 // "RxS" for the HSDP row (default: see parse)
  std::string result;               // where a worker writes its result line
  std::string pool_trim = "on";     // BufferPoolOptions::trim_after_forward (worker; for comparison)
  std::string malloc = "default";   // default | speed (every worker: fsdp::tune_malloc_for_speed)
  std::string rows = "all";         // the driver's rows, comma-separated keys (see run_driver)
  std::string reshard = "default";  // default | keep-last | false (the FSDP worker's reshard_after_forward)
  int floor_steps = 0;              // FSDP fp32 worker: replays of its last step's collectives (see
                                    // transport_floor); the driver passes --steps
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench: %s\nusage: bench [--nproc N] [--steps N] [--warmup N] [--rounds N] [--layers N] [--dim N] "
               "[--heads N] [--seq N] [--batch N] [--hsdp RxS] [--pool-trim on|off] [--malloc default|speed]\n"
               "       [--rows single,local,fsdp,keep-last,zero2,bf16,hsdp,replicate] (default all)\n"
               "FSDP_PHASE_TIMERS=1 makes every FSDP worker print where FSDP's own time went, by phase\n",
               why);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  std::map<std::string, int64_t*> ints = {
      {"--layers", &o.layers}, {"--dim", &o.dim}, {"--heads", &o.heads}, {"--seq", &o.seq}, {"--batch", &o.batch}};
  std::map<std::string, int*> small = {
      {"--nproc", &o.nproc}, {"--steps", &o.steps}, {"--warmup", &o.warmup}, {"--rounds", &o.rounds}};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + a).c_str());
    std::string v = argv[++i];
    if (a == "--role")
      o.role = v;
    else if (a == "--result")
      o.result = v;
    else if (a == "--mp")
      o.mp = v;
    else if (a == "--mode")
      o.mode = v;
    else if (a == "--hsdp")
      o.hsdp = v;
    else if (a == "--pool-trim")
      o.pool_trim = v;
    else if (a == "--malloc")
      o.malloc = v;
    else if (a == "--reshard")
      o.reshard = v;
    else if (a == "--rows")
      o.rows = v;
    else if (a == "--floor-steps")
      o.floor_steps = std::stoi(v);
    else if (ints.count(a))
      *ints[a] = std::stoll(v);
    else if (small.count(a))
      *small[a] = std::stoi(v);
    else
      usage(("unknown option " + a).c_str());
  }
  if (o.nproc < 1 || o.batch % o.nproc != 0) usage("--batch must be a positive multiple of --nproc");
  if (o.steps < 1) usage("--steps must be positive");
  if (o.pool_trim != "on" && o.pool_trim != "off") usage("--pool-trim takes on or off");
  if (o.malloc != "default" && o.malloc != "speed") usage("--malloc takes default or speed");
  if (o.reshard != "default" && o.reshard != "keep-last" && o.reshard != "false") {
    usage("--reshard takes default, keep-last or false");
  }
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

// The transport floor: the collectives of one FSDP step (this rank's flight records from record
// `first` on), issued again `reps` times with no compute between them, each waited for. Returns
// this process's CPU seconds (every thread: the caller's sends, Gloo's receives and sums) and wall
// seconds per replayed step. When every core is computing, as at 2 ranks x 1 thread on 2 cores,
// that CPU can only come on top of the step: the limit plus it is the fastest FSDP can be with
// this transport, whatever FSDP itself does.
struct Floor {
  double cpu_s = 0, wall_s = 0;
  int collectives = 0;
};

Floor transport_floor(uint64_t first, int reps) {
  auto world = fsdp::dist::world_comm();
  std::vector<fsdp::comm::FlightRecord> step;
  for (const auto& r : fsdp::comm::FlightRecorder::process().snapshot()) {
    if (r.id >= first) step.push_back(r);
  }
  // What to issue, decided once: nothing but the collectives themselves runs in the timed loop.
  enum class Kind { AllGather, ReduceScatter, AllReduce };
  struct Replay {
    Kind kind;
    at::Tensor out, in;  // allocated once
  };
  std::vector<Replay> replays;
  for (const auto& r : step) {
    const std::string op = r.op;
    Kind kind;
    if (op == "all_gather_into_tensor")
      kind = Kind::AllGather;
    else if (op == "reduce_scatter_tensor")
      kind = Kind::ReduceScatter;
    else if (op == "all_reduce")
      kind = Kind::AllReduce;
    else
      return Floor{0, 0, -1};  // per-parameter collectives (FSDP_CPU_COLLECTIVES): not replayed
    auto opts = at::TensorOptions().dtype(r.dtype);
    replays.push_back({kind, at::ones({r.out_numel}, opts), at::ones({r.in_numel}, opts)});
  }
  Floor f;
  f.collectives = static_cast<int>(replays.size());
  std::vector<double> cpu, wall;
  for (int rep = -1; rep < reps; ++rep) {  // rep -1: warm-up
    world->barrier();
    const double c0 = fsdp_bench::cpu_seconds();
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& r : replays) {
      if (r.kind == Kind::AllGather)
        world->all_gather_into_tensor(r.out, r.in);
      else if (r.kind == Kind::ReduceScatter)
        world->reduce_scatter_tensor(r.out, r.in);
      else
        world->all_reduce(r.out);
    }
    if (rep < 0) continue;
    wall.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    cpu.push_back(fsdp_bench::cpu_seconds() - c0);
  }
  f.cpu_s = median(cpu);
  f.wall_s = median(wall);
  return f;
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
    // --reshard false: no unit frees its parameters after forward (ZeRO-2-like: backward gathers
    // nothing). keep-last: the last block keeps them (torchtitan's recipe: backward starts by
    // gathering it again, so freeing it saves no memory at the peak and costs a gather).
    if (o.reshard == "false") opts.reshard_after_forward = false;
    std::vector<fsdp::FSDPModule> units;
    for (auto& b : model->blocks) units.push_back(fsdp::fully_shard(b, opts));
    fsdp::fully_shard(model, opts);
    if (o.reshard == "keep-last" && !units.empty()) units.back().set_reshard_after_forward(false, /*recurse=*/false);
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = at::detail::createCPUGenerator(1234 + rank);
  std::vector<double> times;
  double first_loss = 0;
  auto stats0 = fsdp::comm::process_comm_stats().snapshot();
  double cpu0 = 0;
  uint64_t last_step_first_record = 0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      stats0 = fsdp::comm::process_comm_stats().snapshot();
      fsdp::reset_phase_timers();
      cpu0 = fsdp_bench::cpu_seconds();
    }
    if (s == o.warmup + o.steps - 1) last_step_first_record = fsdp::comm::FlightRecorder::process().recorded();
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
  const double cpu_per_step = (fsdp_bench::cpu_seconds() - cpu0) / o.steps;
  auto comm = fsdp::comm::process_comm_stats().snapshot() - stats0;
  Floor floor;
  if (sharded && o.floor_steps > 0 && world > 1) floor = transport_floor(last_step_first_record, o.floor_steps);
  if (rank == 0 && !o.result.empty()) {
    std::ofstream out(o.result, std::ios::app);
    out << "median_step_s " << median(times) << " state_bytes " << state_bytes(*model, opt) << " max_rss "
        << peak_rss_bytes() << " comm_bytes_per_step " << comm.total_bytes() / static_cast<double>(o.steps)
        << " param_bytes " << param_bytes << " world " << world << " all_reduce_bytes_per_step "
        << comm[fsdp::comm::OpKind::AllReduce].bytes_sent / static_cast<double>(o.steps) << " first_loss " << first_loss
        << " cpu_per_step_s " << cpu_per_step << " floor_cpu_s " << floor.cpu_s << " floor_wall_s " << floor.wall_s
        << " floor_collectives " << floor.collectives << "\n";
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

// One row of the table: a worker run, alternated with the others every round.
struct Row {
  std::string key;                     // --rows name
  std::string label;                   // the table's first column
  std::vector<std::string> args;       // worker arguments after the common ones' place
  bool distributed = true;             // under fsdprun (else one process with the rank's threads)
  std::vector<double> medians;         // per round
  std::map<std::string, double> last;  // the last round's result line
  double step() const { return median(medians); }
};

int run_driver(const Options& o) {
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) usage("cannot find this program's path");
  self[n] = '\0';
  std::string dir = std::string(self).substr(0, std::string(self).rfind('/'));
  const std::string fsdprun = dir + "/fsdprun";
  if (access(fsdprun.c_str(), X_OK) != 0) usage(("fsdprun not found next to bench: " + fsdprun).c_str());
  char tmpl[] = "/tmp/fsdp-bench-XXXXXX";
  if (!mkdtemp(tmpl)) usage("cannot create a temporary folder");
  std::vector<std::string> common = {
      "--steps", std::to_string(o.steps), "--warmup", std::to_string(o.warmup), "--layers", std::to_string(o.layers),
      "--dim",   std::to_string(o.dim),   "--heads",  std::to_string(o.heads),  "--seq",    std::to_string(o.seq),
      "--batch", std::to_string(o.batch), "--nproc",  std::to_string(o.nproc),  "--malloc", o.malloc};
  const long long local_batch = o.batch / o.nproc, batch = o.batch;
  auto b = [](long long v) { return " (batch " + std::to_string(v) + ")"; };
  std::vector<Row> all = {
      {"single", "one process, per-rank work" + b(local_batch), {"--role", "single"}, false},
      // fully_shard in a world of one: every copy FSDP makes, no network. Splits the overhead
      // into bookkeeping (this row) and communication (the rest).
      {"local", "fully_shard, world of one" + b(local_batch) + ": copies, no network", {"--role", "fsdp"}, false},
      {"fsdp", "FSDP fp32" + b(batch), {"--role", "fsdp", "--floor-steps", std::to_string(o.steps)}},
      {"keep-last",
       "FSDP fp32, the last block not resharded after forward (torchtitan's recipe)",
       {"--role", "fsdp", "--reshard", "keep-last"}},
      {"zero2", "FSDP fp32, reshard_after_forward = false (ZeRO-2-like)", {"--role", "fsdp", "--reshard", "false"}},
      {"bf16", "FSDP bf16 params, fp32 reduce" + b(batch), {"--role", "fsdp", "--mp", "bf16"}},
      {"hsdp",
       "HSDP " + o.hsdp + ", replicate x shard" + b(batch),
       {"--role", "fsdp", "--mode", "hsdp", "--hsdp", o.hsdp}},
      {"replicate",
       "replicate (DDP: 1 MiB first bucket, then 25 MiB)" + b(batch),
       {"--role", "fsdp", "--mode", "replicate"}},
  };
  std::vector<Row> rows;
  for (auto& r : all) {
    if (o.rows == "all" || ("," + o.rows + ",").find("," + r.key + ",") != std::string::npos) rows.push_back(r);
  }
  if (o.rows != "all") {  // a misspelt row is an error, not a row quietly left out
    std::string known;
    for (const auto& r : all) known += (known.empty() ? "" : ",") + r.key;
    std::istringstream names(o.rows);
    for (std::string name; std::getline(names, name, ',');) {
      if (std::none_of(all.begin(), all.end(), [&](const Row& r) { return r.key == name; })) {
        usage(("--rows: no row '" + name + "'; the rows are " + known).c_str());
      }
    }
  }
  if (rows.empty() || rows.front().key != "single")
    usage("--rows must include single (the limit the others are measured against)");
  const int threads = fsdp::dist::default_omp_threads(o.nproc);
  std::printf(
      "bench: GPT %lld layers, d=%lld, %lld heads, seq %lld, global batch %lld, float32; %d ranks x %d "
      "thread(s); %d steps after %d warm-up, %d rounds; malloc %s\n",
      static_cast<long long>(o.layers), static_cast<long long>(o.dim), static_cast<long long>(o.heads),
      static_cast<long long>(o.seq), batch, o.nproc, threads, o.steps, o.warmup, o.rounds, o.malloc.c_str());
  std::fflush(stdout);
  for (int round = 0; round < o.rounds; ++round) {
    for (auto& r : rows) {
      const std::string out = std::string(tmpl) + "/" + r.key;
      std::vector<std::string> argv;
      if (r.distributed) argv = {fsdprun, "--nproc-per-node", std::to_string(o.nproc), "--master-port", "0", "--"};
      argv.push_back(self);
      argv.insert(argv.end(), r.args.begin(), r.args.end());
      argv.insert(argv.end(), {"--result", out});
      argv.insert(argv.end(), common.begin(), common.end());
      std::vector<std::string> env;
      if (!r.distributed) env.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
      if (spawn_and_wait(argv, env) != 0) usage(("the " + r.key + " run failed").c_str());
    }
  }
  for (auto& r : rows) r.last = read_results(std::string(tmpl) + "/" + r.key, r.medians);
  const double limit = rows.front().step();
  const double params = rows.front().last["param_bytes"], frac = static_cast<double>(o.nproc - 1) / o.nproc;
  const double hr = std::stod(o.hsdp.substr(0, o.hsdp.find('x'))), hs = o.nproc / hr;
  std::printf(
      "\n| run | ranks | step time (median) | vs limit | train state / rank | max RSS / rank | sent / rank / step |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  for (auto& r : rows) {
    const int ranks = r.distributed ? o.nproc : 1;
    std::string ratio = r.key == "single" ? "1.00x (the limit)" : "";
    if (ratio.empty()) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2fx", r.step() / limit);
      ratio = buf;
    }
    char sent[256] = "0";
    if (r.distributed) {
      const double mb = r.last["comm_bytes_per_step"] / 1e6;
      if (r.key == "fsdp")
        std::snprintf(sent, sizeof sent, "%.2f MB (3 x params x (N-1)/N = %.2f MB)", mb, 3 * params * frac / 1e6);
      else if (r.key == "zero2" || r.key == "replicate")
        std::snprintf(sent, sizeof sent, "%.2f MB (2 x params x (N-1)/N = %.2f MB)", mb, 2 * params * frac / 1e6);
      else if (r.key == "hsdp")
        // FSDP's three passes within the S shard ranks, plus an all-reduce of a 1/S shard over R.
        std::snprintf(
            sent, sizeof sent,
            "%.2f MB, %.2f MB of it across replicas (3 x params x (S-1)/S + 2 x params/S x (R-1)/R = %.2f MB)", mb,
            r.last["all_reduce_bytes_per_step"] / 1e6, params * (3 * (hs - 1) / hs + 2 * (hr - 1) / hr / hs) / 1e6);
      else
        std::snprintf(sent, sizeof sent, "%.2f MB", mb);
    }
    std::printf("| %s | %d | %.1f ms | %s | %.2f MB | %.0f MB | %s |\n", r.label.c_str(), ranks, 1e3 * r.step(),
                ratio.c_str(), r.last["state_bytes"] / 1e6, r.last["max_rss"] / 1e6, sent);
  }
  auto fsdp_row = std::find_if(rows.begin(), rows.end(), [](const Row& r) { return r.key == "fsdp"; });
  if (fsdp_row == rows.end()) return 0;
  Row& f = *fsdp_row;
  std::printf("\nratio FSDP / limit = %.3f (target <= 1.10); per-round medians: single", f.step() / limit);
  for (double m : rows.front().medians) std::printf(" %.1f", 1e3 * m);
  std::printf(" ms, fsdp");
  for (double m : f.medians) std::printf(" %.1f", 1e3 * m);
  std::printf(" ms\n");
  auto cpu = rows.front().last["cpu_per_step_s"], fsdp_cpu = f.last["cpu_per_step_s"];
  std::printf(
      "CPU per rank per step (last round): one process %.1f ms, FSDP fp32 %.1f ms (+%.1f ms); FSDP's wall step "
      "%.1f ms of which the process ran %.0f%%\n",
      1e3 * cpu, 1e3 * fsdp_cpu, 1e3 * (fsdp_cpu - cpu), 1e3 * f.medians.back(), 100 * fsdp_cpu / f.medians.back());
  // The transport floor (transport_floor above): the same collectives with nothing else running.
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (f.last["floor_collectives"] < 0) {
    std::printf("transport floor: not measured (it replays flat collectives only; FSDP_CPU_COLLECTIVES is set)\n");
    return 0;
  }
  const double floor_cpu = f.last["floor_cpu_s"], floor_ratio = (limit + floor_cpu) / limit;
  std::printf(
      "transport floor: FSDP fp32's %d collectives of a step replayed alone (%.2f MB sent per rank): %.1f ms "
      "of CPU per rank (wall %.1f ms)",
      static_cast<int>(f.last["floor_collectives"]), f.last["comm_bytes_per_step"] / 1e6, 1e3 * floor_cpu,
      1e3 * f.last["floor_wall_s"]);
  if (static_cast<long>(o.nproc) * threads >= cores) {
    std::printf(
        "; every one of the %ld cores computes (%d ranks x %d threads), so that CPU comes on top of the "
        "limit: no FSDP can go below (limit + it) / limit = %.3f here with this transport\n",
        cores, o.nproc, threads, floor_ratio);
  } else {
    std::printf(
        "; %ld cores for %d ranks x %d threads: the transport can run on idle cores (a floor of 1.00; "
        "(limit + it) / limit = %.3f if it could not)\n",
        cores, o.nproc, threads, floor_ratio);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  Options o = parse(argc, argv);
  try {
    if (o.role == "single") return run_worker(o, false);
    if (o.role == "fsdp") return run_worker(o, true);
    if (o.role == "driver") return run_driver(o);
    usage(("unknown --role " + o.role).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench: %s\n", e.what());
    return 1;
  }
}
