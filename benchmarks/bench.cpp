// bench: FSDP against the physical limit, measured in one run.
//
//   build/bin/bench [--nproc 2] [--steps 20] [--warmup 3] [--rounds 2]
//                   [--layers 4] [--dim 256] [--heads 4] [--seq 128] [--batch 8] [--hsdp RxS]
//                   [--malloc default|tuned|speed|warm] [--cpu-split on|off] [--bucket-mb 25 (replicate)]
//                   [--rows single,concurrent,local,fsdp,keep-last,zero2,bf16,hsdp,replicate]
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
// the driver prints that ratio next to the measured one. The replicate worker does the same with
// its bucket all-reduces: the floor of any DDP on this transport. The driver prints both rows'
// floors alike (print_floor).
//
// The concurrent row runs N copies of the one-process run at once (under fsdprun, no world, no
// byte sent): the limit when every core computes at the same time, as the N ranks do. The cores'
// shared caches, memory bandwidth and clocks cost that row something the limit, which runs alone,
// does not pay; the driver prints the floor again with it (concurrent + the transport's CPU), the
// fastest any N-rank run can be on this machine and transport. The limit itself stays the
// one-process run.
//
// Where the CPU goes (--cpu-split on, the default): every worker of every row splits each
// measured step's CPU time, on every rank, into
//   ours       the CPU time of FSDP's own code on the thread that runs it (the phase timers,
//              fsdp/debug/phase_timers.h, switched on in the FSDP workers: the hooks, inclusive,
//              and phases run outside them), split into copies (copy-in, copy-out, the
//              reduce-scatter input, the sharded gradient write), collective calls (issuing
//              and waiting: with Gloo's p2p all-gather the calling thread writes the sends) and
//              the rest (bookkeeping, freeing, trimming the pool, allocation);
//   transport  the CPU time of the threads that joining the world started (Gloo's workers and
//              event loop, the store: [Note: CPU time by thread role] in bench_support.h);
//   compute    the rest of the process's CPU time (the main thread outside FSDP, BLAS or OpenMP
//              workers),
// with the minor page faults and the wall time of the step, and prints per row and rank the
// medians over the steps of all rounds (medians of the parts need not add up to the median of the
// whole). Time blocked in a wait is wall but no CPU: that is what the split separates. The single
// row has no FSDP and no world, so ours and transport are 0 there by construction, and the local
// row (a world of one) starts no transport thread; replicate's reducer times its gradient copies
// into the buckets and its all-reduce calls as FSDP's copies and collective calls. The phase
// timers cost two thread-clock reads per timed phase (a read is a system call: far below the
// step's noise); --cpu-split off leaves them off.
#include <sched.h>
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

namespace {

using fsdp_bench::bad_input;
using fsdp_bench::median;

struct Options {
  int nproc = 2, steps = 20, warmup = 3, rounds = 2;
  fsdp_bench::GptShape shape;    // bench's GPT: 4 layers, d=256, 4 heads, seq 128, global batch 8
  std::string role = "driver";   // driver | single | fsdp
  std::string mp = "fp32";       // fp32 | bf16 (MixedPrecisionPolicy: bf16 params, fp32 reduce)
  std::string mode = "fsdp";     // fsdp | hsdp | replicate (the distributed worker's parallelism)
  std::string hsdp;              // "RxS" for the HSDP row (default: see parse)
  std::string result;            // where a worker writes its result line
  std::string pool_trim = "on";  // BufferPoolOptions::trim_after_forward (worker; for comparison)
  int64_t bucket_mb = 25;        // --bucket-mb: replicate's bucket_cap_bytes in MiB (DDP's bucket_cap_mb)
  fsdp_bench::MallocPolicy malloc = fsdp_bench::MallocPolicy::Default;  // --malloc (every worker)
  std::string cpu_split = "on";     // on | off: every worker times compute / transport / ours per step
  std::string rows = "all";         // the driver's rows, comma-separated keys (see run_driver)
  std::string reshard = "default";  // default | keep-last | false (the FSDP worker's reshard_after_forward)
  std::string shard_dim = "0";      // 0 | last: the FSDP worker's matrices split along dim 0 or their last
  int floor_steps = 0;              // FSDP fp32 and replicate workers: replays of their last step's
                                    // collectives (see transport_floor); the driver passes --steps
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "bench",
      "usage: bench [--nproc N] [--steps N] [--warmup N] [--rounds N] [--layers N] [--dim N] "
      "[--heads N] [--seq N] [--batch N] [--hsdp RxS] [--pool-trim on|off] [--bucket-mb 25]\n"
      "       [--malloc default|tuned|speed|warm] [--cpu-split on|off]\n"
      "       [--rows single,concurrent,local,fsdp,keep-last,zero2,last-dim,bf16,hsdp,replicate] (default all)\n"
      "FSDP_PHASE_TIMERS=1 makes every FSDP worker print where FSDP's own time went, by phase; "
      "FSDP_BENCH_PIN=process|main pins each distributed worker (or its main thread) to one core; "
      "FSDP_CPU_BIND=cores binds the ranks as the library does (fsdp/debug/cpu_tuning.h)");
  o.shape.add_options(args);
  args.option("--nproc", &o.nproc).option("--steps", &o.steps).option("--warmup", &o.warmup);
  args.option("--rounds", &o.rounds).option("--role", &o.role).option("--result", &o.result).option("--mp", &o.mp);
  args.option("--mode", &o.mode).option("--hsdp", &o.hsdp).option("--pool-trim", &o.pool_trim);
  args.option("--bucket-mb", &o.bucket_mb);
  fsdp_bench::add_malloc_option(args, &o.malloc);
  args.option("--reshard", &o.reshard).option("--rows", &o.rows).option("--cpu-split", &o.cpu_split);
  args.option("--floor-steps", &o.floor_steps).option("--shard-dim", &o.shard_dim);
  args.parse(argc, argv);
  if (o.nproc < 1 || o.shape.batch % o.nproc != 0) bad_input("--batch must be a positive multiple of --nproc");
  if (o.steps < 1) bad_input("--steps must be positive");
  if (o.pool_trim != "on" && o.pool_trim != "off") bad_input("--pool-trim takes on or off");
  if (o.bucket_mb < 1) bad_input("--bucket-mb takes a whole number of MiB, at least 1");
  if (o.cpu_split != "on" && o.cpu_split != "off") bad_input("--cpu-split takes on or off");
  if (o.shard_dim != "0" && o.shard_dim != "last") bad_input("--shard-dim takes 0 or last");
  if (o.reshard != "default" && o.reshard != "keep-last" && o.reshard != "false") {
    bad_input("--reshard takes default, keep-last or false");
  }
  if (o.role != "driver" && o.role != "single" && o.role != "fsdp") bad_input("--role takes driver, single or fsdp");
  if (o.hsdp.empty()) {
    o.hsdp = (o.nproc % 2 == 0 && o.nproc >= 4) ? "2x" + std::to_string(o.nproc / 2) : std::to_string(o.nproc) + "x1";
  }
  const auto x = o.hsdp.find('x');
  if (x == std::string::npos || std::stoll(o.hsdp.substr(0, x)) * std::stoll(o.hsdp.substr(x + 1)) != o.nproc) {
    bad_input("--hsdp must be RxS with R * S = --nproc");
  }
  return o;
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
  const int64_t n = world->size();
  for (const auto& r : step) {
    const std::string op = r.op;
    auto opts = at::TensorOptions().dtype(r.dtype);
    auto ones = [&](int64_t numel) { return at::ones({numel}, opts); };
    if (op == "all_gather_into_tensor") {
      replays.push_back({Kind::AllGather, ones(r.out_numel), ones(r.in_numel)});
    } else if (op == "reduce_scatter_tensor") {
      replays.push_back({Kind::ReduceScatter, ones(r.out_numel), ones(r.in_numel)});
    } else if (op == "all_reduce") {
      replays.push_back({Kind::AllReduce, ones(r.out_numel), ones(r.in_numel)});
    } else if (op == "all_gather_pieces" || op == "reduce_scatter_pieces") {
      // The per-parameter layout (fsdp/debug/cpu_collectives.h): its bytes replayed as Gloo's
      // one-message collective, which moves them in fewer messages. The full parameters' numel
      // (the gather's output, the reduction's input) is the same on every rank; a rank's share
      // is rounded up as FSDP's padding does.
      const bool gather = op == "all_gather_pieces";
      const int64_t share = ((gather ? r.out_numel : r.in_numel) + n - 1) / n;
      replays.push_back(gather ? Replay{Kind::AllGather, ones(n * share), ones(share)}
                               : Replay{Kind::ReduceScatter, ones(share), ones(n * share)});
    } else {
      return Floor{0, 0, -1};  // not a collective the floor knows
    }
  }
  Floor f;
  f.collectives = static_cast<int>(replays.size());
  fsdp_bench::Samples replayed;
  for (int rep = -1; rep < reps; ++rep) {  // rep -1: warm-up
    world->barrier();
    const fsdp_bench::Stopwatch stretch;
    for (const auto& r : replays) {
      if (r.kind == Kind::AllGather)
        world->all_gather_into_tensor(r.out, r.in);
      else if (r.kind == Kind::ReduceScatter)
        world->reduce_scatter_tensor(r.out, r.in);
      else
        world->all_reduce(r.out);
    }
    if (rep >= 0) replayed.add(stretch);
  }
  f.cpu_s = replayed.cpu_median();
  f.wall_s = replayed.wall_median();
  return f;
}

// Where a worker's process stands at one instant, for the CPU split (see the header): the
// process's CPU time, its threads' CPU by role, FSDP's phase times and the minor page faults.
struct CpuReading {
  double process_cpu_s = 0;
  fsdp_bench::ThreadRoles::Cpu threads;
  fsdp::PhaseTimes phases;
  uint64_t faults = 0;
};

// Read before a step: the slower readings first, the process's CPU clock last.
CpuReading read_before(fsdp_bench::ThreadRoles& roles) {
  CpuReading r;
  r.threads = roles.cpu();
  r.phases = fsdp::phase_times();
  r.faults = fsdp_bench::minor_faults();
  r.process_cpu_s = fsdp_bench::cpu_seconds();
  return r;
}
// Read after it: the process's CPU clock first.
CpuReading read_after(fsdp_bench::ThreadRoles& roles) {
  CpuReading r;
  r.process_cpu_s = fsdp_bench::cpu_seconds();
  r.faults = fsdp_bench::minor_faults();
  r.phases = fsdp::phase_times();
  r.threads = roles.cpu();
  return r;
}

// One step's split, as a result line ("key value ..."; seconds, faults, thread counts).
std::string split_line(double wall_s, const CpuReading& a, const CpuReading& b) {
  using fsdp::Phase;
  const fsdp::PhaseTimes d = b.phases - a.phases;
  auto cpu_s = [&d](std::initializer_list<Phase> phases) {
    double ms = 0;
    for (Phase p : phases) ms += d.cpu_ms(p);
    return ms / 1e3;
  };
  const double cpu = b.process_cpu_s - a.process_cpu_s;
  const double transport = 1e-9 * static_cast<double>(static_cast<int64_t>(b.threads.transport_ns) -
                                                      static_cast<int64_t>(a.threads.transport_ns));
  const double ours = d.own_cpu_ms() / 1e3;
  const double copies = cpu_s({Phase::CopyIn, Phase::CopyOut, Phase::ReduceScatterInput, Phase::GradAccumulate});
  const double calls =
      cpu_s({Phase::AllGatherIssue, Phase::AllGatherWait, Phase::ReduceScatterIssue, Phase::ReduceScatterWait});
  std::ostringstream out;
  out << "wall_s " << wall_s << " cpu_s " << cpu << " compute_s " << cpu - transport - ours << " transport_s "
      << transport << " ours_s " << ours << " copies_s " << copies << " calls_s " << calls << " rest_s "
      << ours - copies - calls << " faults " << static_cast<double>(b.faults - a.faults) << " compute_threads "
      << b.threads.compute_threads << " transport_threads " << b.threads.transport_threads << "\n";
  return out.str();
}

// FSDP_BENCH_PIN (an experiment, off by default; no library default pins anything): process pins
// a distributed worker, before it joins the world, to core LOCAL_RANK % cores, so the transport
// threads it starts share that core with it alone; main pins only the main (compute) thread, after
// joining, and lets the transport threads go where the scheduler puts them. It tells whether the
// time neither of a rank's threads runs is the scheduler placing one rank's transport threads on
// the other rank's core (docs/benchmarks.md, "Where the CPU goes").
void pin_to_local_core() {
  const char* local = std::getenv("LOCAL_RANK");
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (local == nullptr || cores <= 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(static_cast<int>(std::atol(local) % cores), &set);
  if (sched_setaffinity(0, sizeof set, &set) != 0) std::perror("bench: sched_setaffinity");
}

std::string pin_mode() {
  const char* v = std::getenv("FSDP_BENCH_PIN");
  const std::string mode = v ? v : "";
  if (!mode.empty() && mode != "process" && mode != "main") bad_input("FSDP_BENCH_PIN takes process or main");
  return mode;
}

// One worker: trains `local_batch` sequences per step, sharded or not; writes one result line.
int run_worker(const Options& o, bool sharded) {
  // --malloc, in the one-process run and the distributed ones alike (speed: glibc's heap keeps
  // freed tensors, no page faulted in again each step; fsdp/debug/malloc_tuning.h).
  fsdp_bench::apply_malloc_policy(o.malloc);
  {
    fsdp::BufferPoolOptions pool;
    pool.trim_after_forward = o.pool_trim == "on";
    fsdp::set_buffer_pool_options(pool);
  }
  fsdp_bench::ThreadRoles roles;  // the threads joining the world starts carry the transport
  const std::string pin = sharded ? pin_mode() : "";
  if (pin == "process") pin_to_local_core();
  roles.before_transport();
  const auto [rank, world] = fsdp_bench::join_world(sharded);
  roles.after_transport();
  if (pin == "main") pin_to_local_core();
  // FSDP_PHASE_TIMERS=1 prints the phase table; the CPU split needs the timers' CPU times.
  const bool print_phases = sharded && fsdp::phase_timers_enabled();
  const bool split = o.cpu_split == "on";
  if (split) fsdp::set_phase_timers(true);
  const int64_t local_batch = o.shape.batch / o.nproc;
  auto model = fsdp_bench::seeded_gpt(o.shape.config());
  double param_bytes = 0;
  for (const auto& p : model->parameters()) param_bytes += p.nbytes();
  if (sharded && o.mode == "replicate") {
    fsdp::ReplicateOptions ropts;
    ropts.bucket_cap_bytes = o.bucket_mb << 20;
    fsdp::replicate(model, ropts);
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
    // --shard-dim last: shard_placement_fn splits every matrix along its last dim (the unsharded
    // matrices then live over memory laid out last dim first: what that layout costs).
    if (o.shard_dim == "last") {
      opts.shard_placement_fn = [](const std::string&, const at::Tensor& p) -> std::optional<int64_t> {
        return p.dim() >= 2 ? std::optional<int64_t>(-1) : std::nullopt;
      };
    }
    auto units = fsdp_bench::shard_gpt(model, opts);
    if (o.reshard == "keep-last" && !units.empty()) units.back().set_reshard_after_forward(false, /*recurse=*/false);
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto gen = fsdp_bench::token_stream(rank);
  std::vector<double> times;
  double first_loss = 0;
  auto stats0 = fsdp::comm::process_comm_stats().snapshot();
  double cpu0 = 0;
  uint64_t faults0 = 0;
  uint64_t last_step_first_record = 0;
  std::string splits;  // one line per measured step
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      stats0 = fsdp::comm::process_comm_stats().snapshot();
      fsdp::reset_phase_timers();
      cpu0 = fsdp_bench::cpu_seconds();
      faults0 = fsdp_bench::minor_faults();
    }
    if (s == o.warmup + o.steps - 1) last_step_first_record = fsdp::comm::FlightRecorder::process().recorded();
    auto data = fsdp_bench::random_tokens(gen, local_batch, o.shape.seq);
    const bool measured = s >= o.warmup;
    CpuReading before;
    if (split && measured) before = read_before(roles);
    const auto t0 = std::chrono::steady_clock::now();
    const double value = fsdp_bench::train_step(model, opt, data, sharded).item<float>();
    const double wall = fsdp_bench::seconds_since(t0);
    if (s == 0) first_loss = value;
    if (measured) times.push_back(wall);
    if (split && measured) splits += split_line(wall, before, read_after(roles));
  }
  const double cpu_per_step = (fsdp_bench::cpu_seconds() - cpu0) / o.steps;
  const double faults_per_step = static_cast<double>(fsdp_bench::minor_faults() - faults0) / o.steps;
  auto comm = fsdp::comm::process_comm_stats().snapshot() - stats0;
  // The training's peak, read before the floor's replay allocates its own buffers.
  const double max_rss = fsdp_bench::peak_rss_bytes();
  Floor floor;
  if (sharded && o.floor_steps > 0 && world > 1) floor = transport_floor(last_step_first_record, o.floor_steps);
  if (rank == 0 && !o.result.empty()) {
    std::ofstream out(o.result, std::ios::app);
    out << "median_step_s " << median(times) << " state_bytes " << fsdp_bench::state_bytes(*model, opt).total()
        << " max_rss " << max_rss << " comm_bytes_per_step " << comm.total_bytes() / static_cast<double>(o.steps)
        << " param_bytes " << param_bytes << " world " << world << " all_reduce_bytes_per_step "
        << comm[fsdp::comm::OpKind::AllReduce].bytes_sent / static_cast<double>(o.steps) << " first_loss " << first_loss
        << " cpu_per_step_s " << cpu_per_step << " faults_per_step " << faults_per_step << " floor_cpu_s "
        << floor.cpu_s << " floor_wall_s " << floor.wall_s << " floor_collectives " << floor.collectives << "\n";
  }
  if (!splits.empty() && !o.result.empty()) {  // every rank: its own file
    std::ofstream out(o.result + ".cpu." + std::to_string(rank), std::ios::app);
    out << splits;
  }
  if (print_phases) {
    // FSDP_PHASE_TIMERS=1: where FSDP's own time went on this rank (fsdp/debug/phase_timers.h).
    double total = 0;
    for (double t : times) total += t;
    std::printf("rank %d: %.1f ms per step (mean of %d); FSDP's phases:\n%s", rank, 1e3 * total / o.steps, o.steps,
                fsdp::phase_times().table(o.steps).c_str());
    std::fflush(stdout);
  }
  if (sharded) fsdp::dist::destroy_distributed();
  return 0;
}

// One row of the table: a worker run, alternated with the others every round.
struct Row {
  std::string key;                     // --rows name
  std::string label;                   // the table's first column
  std::vector<std::string> args;       // worker arguments after the common ones' place
  bool distributed = true;             // under fsdprun (else one process with the rank's threads)
  std::string result;                  // the result file its workers append a line to, each round
  std::vector<double> medians;         // per round
  std::vector<double> cpus, faults;    // per round: rank 0's CPU seconds and minor page faults per step
  std::vector<double> floor_cpus;      // per round: the transport floor's CPU seconds (rows that replay)
  std::map<std::string, double> last;  // the last round's result line
  double step() const { return median(medians); }
};

// The row `key` names among those run, or rows.end().
std::vector<Row>::iterator find_row(std::vector<Row>& rows, const std::string& key) {
  return std::find_if(rows.begin(), rows.end(), [&key](const Row& r) { return r.key == key; });
}

// The CPU split (see the header): per row and rank, the medians over every measured step of every
// round.
void print_cpu_split(const std::vector<Row>& rows, int nproc) {
  std::printf(
      "\nWhere the CPU goes, per rank and step (medians over the steps of all rounds; ours: FSDP's hooks and "
      "phases on the main thread; transport: the threads joining the world started; compute: the rest):\n"
      "| run | rank | wall | CPU | compute | transport | ours | ours: copies | ours: collective calls | ours: rest "
      "| ours / wall | minor faults | threads (compute + transport) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const auto& r : rows) {
    const int ranks = r.distributed ? nproc : 1;
    for (int rank = 0; rank < ranks; ++rank) {
      std::map<std::string, std::vector<double>> steps;
      for (const auto& line : fsdp_bench::read_result_lines(r.result + ".cpu." + std::to_string(rank))) {
        for (const auto& [k, v] : line) steps[k].push_back(v);
      }
      if (steps.empty()) continue;
      auto ms = [&steps](const char* key) { return 1e3 * median(steps[key]); };
      // replicate's reducer times its slot fills, all-reduce calls and waits under the
      // reduce-scatter's phases (reducer.h): its copies and collective calls.
      char ours[200];
      std::snprintf(ours, sizeof ours, "%.2f ms | %.2f ms | %.2f ms | %.2f ms | %.1f%%", ms("ours_s"), ms("copies_s"),
                    ms("calls_s"), ms("rest_s"), 100 * median(steps["ours_s"]) / median(steps["wall_s"]));
      std::printf("| %s | %d | %.1f ms | %.1f ms | %.1f ms | %.2f ms | %s | %.0f | %.0f + %.0f |\n", r.key.c_str(),
                  rank, ms("wall_s"), ms("cpu_s"), ms("compute_s"), ms("transport_s"), ours, median(steps["faults"]),
                  median(steps["compute_threads"]), median(steps["transport_threads"]));
    }
  }
}

// How a row's transport floor reads: "transport floor: <owner> <n> <collectives> of a step ...",
// "no <any> can go below ...", "<name> / (limit x floor) = ...<target>".
struct FloorText {
  const char* owner;        // whose collectives: "FSDP fp32's"
  const char* collectives;  // what they are: "collectives", "all-reduces"
  const char* name;         // the row in the ratios
  const char* any;          // in "no <any> can go below": "FSDP", "DDP"
  const char* target;       // after its ratio to the floor; "" where the row's target is against something else
};

// A row's transport floor (transport_floor, measured by its worker after its timed steps: the median
// over the rounds, as the step times are, so that one round's slow replay does not move the ratio),
// against the limit and, when the concurrent row ran, against the limit with the cores shared. Rows
// whose worker replayed nothing (a world of one, no --floor-steps) print nothing.
void print_floor(const Row& r, const FloorText& t, double limit, const Row* concurrent, int nproc, int threads) {
  const double collectives = r.last.at("floor_collectives");
  if (collectives == 0) return;
  if (collectives < 0) {
    std::printf("\ntransport floor: %s %s: not measured (the step issued a collective the floor does not replay)\n",
                t.owner, t.collectives);
    return;
  }
  const double floor_cpu = median(r.floor_cpus), floor_ratio = (limit + floor_cpu) / limit;
  const auto [lo, hi] = std::minmax_element(r.floor_cpus.begin(), r.floor_cpus.end());
  std::printf(
      "\ntransport floor: %s %d %s of a step replayed alone (%.2f MB sent per rank): %.1f ms of CPU per rank (median "
      "of %zu rounds, %.1f-%.1f ms; wall %.1f ms in the last)",
      t.owner, static_cast<int>(collectives), t.collectives, r.last.at("comm_bytes_per_step") / 1e6, 1e3 * floor_cpu,
      r.floor_cpus.size(), 1e3 * *lo, 1e3 * *hi, 1e3 * r.last.at("floor_wall_s"));
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (static_cast<long>(nproc) * threads < cores) {
    std::printf(
        "; %ld cores for %d ranks x %d threads: the transport can run on idle cores (a floor of 1.00; "
        "(limit + it) / limit = %.3f if it could not)\n",
        cores, nproc, threads, floor_ratio);
    return;
  }
  std::printf(
      "; every one of the %ld cores computes (%d ranks x %d threads), so that CPU comes on top of the "
      "limit: no %s can go below (limit + it) / limit = %.3f here with this transport\n"
      "%s / (limit x floor) = %.3f%s\n",
      cores, nproc, threads, t.any, floor_ratio, t.name, r.step() / limit / floor_ratio, t.target);
  if (concurrent == nullptr) return;
  const double shared = (concurrent->step() + floor_cpu) / limit;
  std::printf(
      "with the cores shared: %d one-process runs at once take %.3fx of the limit each (the concurrent row, "
      "nothing sent); with the transport's CPU on top, no %d-rank run can go below %.3f here: %s / that = %.3f\n",
      nproc, concurrent->step() / limit, nproc, shared, t.name, r.step() / limit / shared);
}

int run_driver(const Options& o) {
  fsdp_bench::WorkerLauncher launcher("bench");
  std::vector<std::string> common = o.shape.worker_args();
  common.insert(common.end(),
                {"--steps", std::to_string(o.steps), "--warmup", std::to_string(o.warmup), "--nproc",
                 std::to_string(o.nproc), "--malloc", fsdp_bench::malloc_policy_name(o.malloc), "--cpu-split",
                 o.cpu_split, "--bucket-mb", std::to_string(o.bucket_mb), "--pool-trim", o.pool_trim});
  const long long local_batch = o.shape.batch / o.nproc, batch = o.shape.batch;
  auto b = [](long long v) { return " (batch " + std::to_string(v) + ")"; };
  std::vector<Row> all = {
      {"single", "one process, per-rank work" + b(local_batch), {"--role", "single"}, false},
      {"concurrent",
       std::to_string(o.nproc) + " one-process runs at once, per-rank work" + b(local_batch) + ", no communication",
       {"--role", "single"}},
      // fully_shard in a world of one: every copy FSDP makes, no network. Splits the overhead
      // into bookkeeping (this row) and communication (the rest).
      {"local", "fully_shard, world of one" + b(local_batch) + ": copies, no network", {"--role", "fsdp"}, false},
      {"fsdp", "FSDP fp32" + b(batch), {"--role", "fsdp", "--floor-steps", std::to_string(o.steps)}},
      {"keep-last",
       "FSDP fp32, the last block not resharded after forward (torchtitan's recipe)",
       {"--role", "fsdp", "--reshard", "keep-last"}},
      {"zero2", "FSDP fp32, reshard_after_forward = false (ZeRO-2-like)", {"--role", "fsdp", "--reshard", "false"}},
      {"last-dim",
       "FSDP fp32, matrices sharded along their last dim (shard_placement_fn)",
       {"--role", "fsdp", "--shard-dim", "last"}},
      {"bf16", "FSDP bf16 params, fp32 reduce" + b(batch), {"--role", "fsdp", "--mp", "bf16"}},
      {"hsdp",
       "HSDP " + o.hsdp + ", replicate x shard" + b(batch),
       {"--role", "fsdp", "--mode", "hsdp", "--hsdp", o.hsdp}},
      {"replicate",
       "replicate (DDP: 1 MiB first bucket, then " + std::to_string(o.bucket_mb) + " MiB)" + b(batch),
       {"--role", "fsdp", "--mode", "replicate", "--floor-steps", std::to_string(o.steps)}},
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
        bad_input("--rows: no row '" + name + "'; the rows are " + known);
      }
    }
  }
  if (rows.empty() || rows.front().key != "single")
    bad_input("--rows must include single (the limit the others are measured against)");
  const int threads = fsdp::dist::default_omp_threads(o.nproc);
  std::printf(
      "bench: %s, global batch %lld, float32; %d ranks x %d thread(s); %d steps after %d warm-up, %d rounds; "
      "malloc %s; FSDP_CPU_BIND %s\n",
      o.shape.describe().c_str(), batch, o.nproc, threads, o.steps, o.warmup, o.rounds,
      fsdp_bench::malloc_policy_name(o.malloc),
      std::getenv("FSDP_CPU_BIND") && *std::getenv("FSDP_CPU_BIND") ? std::getenv("FSDP_CPU_BIND") : "unset");
  std::fflush(stdout);
  for (auto& r : rows) r.result = launcher.result_path(r.key);
  for (int round = 0; round < o.rounds; ++round) {
    for (auto& r : rows) {
      std::vector<std::string> args = r.args;
      args.insert(args.end(), {"--result", r.result});
      args.insert(args.end(), common.begin(), common.end());
      std::vector<std::string> env;
      if (!r.distributed) env.push_back("OMP_NUM_THREADS=" + std::to_string(threads));
      if (launcher.run(r.distributed ? o.nproc : 0, args, env) != 0) launcher.fail("the " + r.key + " run failed");
    }
  }
  for (auto& r : rows) {  // one line per round
    for (const auto& line : fsdp_bench::read_result_lines(r.result)) {
      r.medians.push_back(line.at("median_step_s"));
      r.cpus.push_back(line.at("cpu_per_step_s"));
      r.faults.push_back(line.at("faults_per_step"));
      if (line.count("floor_cpu_s") && line.at("floor_collectives") > 0) r.floor_cpus.push_back(line.at("floor_cpu_s"));
      r.last = line;
    }
  }
  const double limit = rows.front().step();
  const double params = rows.front().last["param_bytes"], frac = static_cast<double>(o.nproc - 1) / o.nproc;
  const double hr = std::stod(o.hsdp.substr(0, o.hsdp.find('x'))), hs = o.nproc / hr;
  std::printf(
      "\n| run | ranks | step time (median) | vs limit | CPU / step, rank 0 (median) | vs limit | page faults / step | "
      "train state / rank | max RSS / rank | sent / rank / step |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  const double limit_cpu = median(rows.front().cpus);
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
    // CPU time and page faults do not move with other processes' load as wall time does.
    std::printf("| %s | %d | %.1f ms | %s | %.1f ms | %.3fx | %.0f | %.2f MB | %.0f MB | %s |\n", r.label.c_str(),
                ranks, 1e3 * r.step(), ratio.c_str(), 1e3 * median(r.cpus), median(r.cpus) / limit_cpu,
                median(r.faults), r.last["state_bytes"] / 1e6, r.last["max_rss"] / 1e6, sent);
  }
  if (o.cpu_split == "on") print_cpu_split(rows, o.nproc);
  auto conc = find_row(rows, "concurrent");
  const Row* concurrent = conc == rows.end() ? nullptr : &*conc;
  auto fsdp_row = find_row(rows, "fsdp");
  if (fsdp_row != rows.end()) {
    Row& f = *fsdp_row;
    std::printf("\nratio FSDP / limit = %.3f; per-round medians: single", f.step() / limit);
    for (double m : rows.front().medians) std::printf(" %.1f", 1e3 * m);
    std::printf(" ms, fsdp");
    for (double m : f.medians) std::printf(" %.1f", 1e3 * m);
    std::printf(" ms\n");
    auto cpu = rows.front().last["cpu_per_step_s"], fsdp_cpu = f.last["cpu_per_step_s"];
    std::printf(
        "CPU per rank per step (last round): one process %.1f ms, FSDP fp32 %.1f ms (+%.1f ms); FSDP's wall step "
        "%.1f ms of which the process ran %.0f%%\n",
        1e3 * cpu, 1e3 * fsdp_cpu, 1e3 * (fsdp_cpu - cpu), 1e3 * f.medians.back(), 100 * fsdp_cpu / f.medians.back());
    print_floor(f, {"FSDP fp32's", "collectives", "FSDP", "FSDP", " (target <= 1.03)"}, limit, concurrent, o.nproc,
                threads);
  }
  // replicate's target is against DDP (fsdp2-cpu-compare.sh), not against its floor.
  auto rep = find_row(rows, "replicate");
  if (rep != rows.end())
    print_floor(*rep, {"replicate's", "all-reduces", "replicate", "DDP", ""}, limit, concurrent, o.nproc, threads);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fsdp_bench::run_main(argc, argv, parse, [](const Options& o) {
    return o.role == "driver" ? run_driver(o) : run_worker(o, /*sharded=*/o.role == "fsdp");
  });
}
