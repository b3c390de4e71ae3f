// bench: FSDP against the physical limit, measured in one run; in its modes, bench's GPT under
// fully_shard with one setting switched in one run.
//
//   build/bin/bench [--mode limit] [--nproc 2] [--steps 20] [--warmup 3] [--rounds 2]
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
// The modes (each under fsdprun: `fsdprun --nproc-per-node N -- bench --mode M ...`; `--help` after
// the mode prints its options), each switching one setting between blocks of steps in rotation
// (every rank switches at the same step, as it must):
//   layout   FSDP's two CPU layouts (fsdp/debug/cpu_collectives.h): flat (FSDP2's one message per
//            peer and unit, with copy-in, copy-out and the reduce-scatter input) and per parameter
//            with each --pieces-kib min_piece_bytes; per layout the median wall and CPU per step,
//            page faults and the buffer pool's hits / misses / unmapped blocks, and the ratios to
//            the first (flat unless --flat 0). --split 1 adds the all-gather alone and the
//            reduce-scatter alone per parameter; --comm-only KIB: no model, the all-gather of KIB
//            per rank as 1, 2, 5 and 13 pieces (the cost of a message by itself).
//   desync   TORCH_DISTRIBUTED_DEBUG=DETAIL's desync check off and on (--detail 0 or 1 keeps it
//            off or on throughout, e.g. for instruction counts under valgrind); per setting wall
//            and CPU per step, collectives and checks per step, their bytes; then one check alone:
//            --calls one-float all_reduces, off and on alternating in blocks of 10.
//   profile  FSDP's profiler ranges, inactive and recording: --rounds rounds of --steps steps with
//            nothing recording, then --steps recorded by a TraceSession (Kineto where this LibTorch
//            has it, else FSDP's writer); the cost of one inactive range timed alone times the
//            ranges a step runs, and the last round's traces in DIR/trace_rank<r>.json
//            (scripts/trace_summary.py sums them by phase).
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
  fsdp_bench::GptShape shape;     // bench's GPT: 4 layers, d=256, 4 heads, seq 128, global batch 8
  std::string role = "driver";    // driver | single | fsdp
  std::string mp = "fp32";        // fp32 | bf16 (MixedPrecisionPolicy: bf16 params, fp32 reduce)
  std::string parallel = "fsdp";  // fsdp | hsdp | replicate (the distributed worker's parallelism)
  std::string hsdp;               // "RxS" for the HSDP row (default: see parse)
  std::string result;             // where a worker writes its result line
  std::string pool_trim = "on";   // BufferPoolOptions::trim_after_forward (worker; for comparison)
  int64_t bucket_mb = 25;         // --bucket-mb: replicate's bucket_cap_bytes in MiB (DDP's bucket_cap_mb)
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
      "usage: bench [--mode limit|layout|desync|profile] [--nproc N] [--steps N] [--warmup N] [--rounds N] [--layers "
      "N] [--dim N] "
      "[--heads N] [--seq N] [--batch N] [--hsdp RxS] [--pool-trim on|off] [--bucket-mb 25]\n"
      "       [--malloc default|tuned|speed|warm] [--cpu-split on|off]\n"
      "       [--rows single,concurrent,local,fsdp,keep-last,zero2,last-dim,bf16,hsdp,replicate] (default all)\n"
      "       bench --mode layout|desync|profile --help: the options of a mode (run under fsdprun)\n"
      "FSDP_PHASE_TIMERS=1 makes every FSDP worker print where FSDP's own time went, by phase; "
      "FSDP_BENCH_PIN=process|main pins each distributed worker (or its main thread) to one core; "
      "FSDP_CPU_BIND=cores binds the ranks as the library does (fsdp/debug/cpu_tuning.h)");
  o.shape.add_options(args);
  args.option("--nproc", &o.nproc).option("--steps", &o.steps).option("--warmup", &o.warmup);
  args.option("--rounds", &o.rounds).option("--role", &o.role).option("--result", &o.result).option("--mp", &o.mp);
  args.option("--parallel", &o.parallel).option("--hsdp", &o.hsdp).option("--pool-trim", &o.pool_trim);
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

// A worker's process settings, before any tensor: --malloc (in the one-process run and the
// distributed ones alike; speed: glibc's heap keeps freed tensors, no page faulted in again each
// step; fsdp/debug/malloc_tuning.h) and the buffer pool's trimming.
void set_up_worker_process(const Options& o) {
  fsdp_bench::apply_malloc_policy(o.malloc);
  fsdp::BufferPoolOptions pool;
  pool.trim_after_forward = o.pool_trim == "on";
  fsdp::set_buffer_pool_options(pool);
}

// The FSDP worker's fully_shard options: the HSDP mesh, bf16, reshard_after_forward = false
// (--reshard false: ZeRO-2-like, backward gathers nothing) and the last-dim placement
// (--shard-dim last: the unsharded matrices then live over memory laid out last dim first).
fsdp::FullyShardOptions shard_options(const Options& o) {
  fsdp::FullyShardOptions opts;
  if (o.parallel == "hsdp") {
    const auto x = o.hsdp.find('x');
    opts.mesh = fsdp::init_device_mesh({std::stoll(o.hsdp.substr(0, x)), std::stoll(o.hsdp.substr(x + 1))},
                                       {"replicate", "shard"});
  }
  if (o.mp == "bf16") {
    opts.mp_policy.param_dtype = at::kBFloat16;
    opts.mp_policy.reduce_dtype = at::kFloat;
  }
  if (o.reshard == "false") opts.reshard_after_forward = false;
  if (o.shard_dim == "last") {
    opts.shard_placement_fn = [](const std::string&, const at::Tensor& p) -> std::optional<int64_t> {
      return p.dim() >= 2 ? std::optional<int64_t>(-1) : std::nullopt;
    };
  }
  return opts;
}

// The distributed worker's parallelism on `model`: replicate, or fully_shard per block and root
// (--reshard keep-last: the last block keeps its parameters after forward, torchtitan's recipe:
// backward starts by gathering it again, so freeing it saves no memory at the peak and costs a gather).
void parallelize(fsdp::models::GPT& model, const Options& o) {
  if (o.parallel == "replicate") {
    fsdp::ReplicateOptions ropts;
    ropts.bucket_cap_bytes = o.bucket_mb << 20;
    fsdp::replicate(model, ropts);
    return;
  }
  auto units = fsdp_bench::shard_gpt(model, shard_options(o));
  if (o.reshard == "keep-last" && !units.empty()) units.back().set_reshard_after_forward(false, /*recurse=*/false);
}

// What a worker's training loop measured.
struct Measured {
  std::vector<double> times;  // wall seconds per measured step
  double first_loss = 0, cpu_per_step = 0, faults_per_step = 0;
  fsdp::comm::CommStatsSnapshot comm;   // the measured steps' traffic
  uint64_t last_step_first_record = 0;  // the flight record the last step's collectives start at
  std::string splits;                   // the CPU split: one line per measured step
};

// --warmup steps, then --steps measured ones (wall time, CPU, faults, traffic; the CPU split per
// step when `split`).
Measured train_measured(const Options& o, fsdp::models::GPT& model, torch::optim::Optimizer& opt, int rank,
                        bool sharded, bool split, fsdp_bench::ThreadRoles& roles) {
  Measured m;
  auto gen = fsdp_bench::token_stream(rank);
  auto stats0 = fsdp::comm::process_comm_stats().snapshot();
  double cpu0 = 0;
  uint64_t faults0 = 0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    if (s == o.warmup) {
      stats0 = fsdp::comm::process_comm_stats().snapshot();
      fsdp::reset_phase_timers();
      cpu0 = fsdp_bench::cpu_seconds();
      faults0 = fsdp_bench::minor_faults();
    }
    if (s == o.warmup + o.steps - 1) m.last_step_first_record = fsdp::comm::FlightRecorder::process().recorded();
    auto data = fsdp_bench::random_tokens(gen, o.shape.batch / o.nproc, o.shape.seq);
    const bool measured = s >= o.warmup;
    CpuReading before;
    if (split && measured) before = read_before(roles);
    const auto t0 = std::chrono::steady_clock::now();
    const double value = fsdp_bench::train_step(model, opt, data, sharded).item<float>();
    const double wall = fsdp_bench::seconds_since(t0);
    if (s == 0) m.first_loss = value;
    if (measured) m.times.push_back(wall);
    if (split && measured) m.splits += split_line(wall, before, read_after(roles));
  }
  m.cpu_per_step = (fsdp_bench::cpu_seconds() - cpu0) / o.steps;
  m.faults_per_step = static_cast<double>(fsdp_bench::minor_faults() - faults0) / o.steps;
  m.comm = fsdp::comm::process_comm_stats().snapshot() - stats0;
  return m;
}

// Rank 0's result line (the driver reads it) and every rank's CPU split lines (its own file).
void write_results(const Options& o, const Measured& m, double state_bytes, double param_bytes, double max_rss,
                   const Floor& floor, int rank, int world) {
  if (o.result.empty()) return;
  if (rank == 0) {
    std::ofstream out(o.result, std::ios::app);
    out << "median_step_s " << median(m.times) << " state_bytes " << state_bytes << " max_rss " << max_rss
        << " comm_bytes_per_step " << m.comm.total_bytes() / static_cast<double>(o.steps) << " param_bytes "
        << param_bytes << " world " << world << " all_reduce_bytes_per_step "
        << m.comm[fsdp::comm::OpKind::AllReduce].bytes_sent / static_cast<double>(o.steps) << " first_loss "
        << m.first_loss << " cpu_per_step_s " << m.cpu_per_step << " faults_per_step " << m.faults_per_step
        << " floor_cpu_s " << floor.cpu_s << " floor_wall_s " << floor.wall_s << " floor_collectives "
        << floor.collectives << "\n";
  }
  if (!m.splits.empty()) {
    std::ofstream out(o.result + ".cpu." + std::to_string(rank), std::ios::app);
    out << m.splits;
  }
}

// FSDP_PHASE_TIMERS=1: where FSDP's own time went on this rank (fsdp/debug/phase_timers.h).
void print_phases(const Options& o, const Measured& m, int rank) {
  double total = 0;
  for (double t : m.times) total += t;
  std::printf("rank %d: %.1f ms per step (mean of %d); FSDP's phases:\n%s", rank, 1e3 * total / o.steps, o.steps,
              fsdp::phase_times().table(o.steps).c_str());
  std::fflush(stdout);
}

// One worker: trains `local_batch` sequences per step, sharded or not; writes one result line.
int run_worker(const Options& o, bool sharded) {
  set_up_worker_process(o);
  fsdp_bench::ThreadRoles roles;  // the threads joining the world starts carry the transport
  const std::string pin = sharded ? pin_mode() : "";
  if (pin == "process") pin_to_local_core();
  roles.before_transport();
  const auto [rank, world] = fsdp_bench::join_world(sharded);
  roles.after_transport();
  if (pin == "main") pin_to_local_core();
  // FSDP_PHASE_TIMERS=1 prints the phase table; the CPU split needs the timers' CPU times.
  const bool phases = sharded && fsdp::phase_timers_enabled();
  const bool split = o.cpu_split == "on";
  if (split) fsdp::set_phase_timers(true);
  auto model = fsdp_bench::seeded_gpt(o.shape.config());
  double param_bytes = 0;
  for (const auto& p : model->parameters()) param_bytes += p.nbytes();
  if (sharded) parallelize(model, o);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const Measured m = train_measured(o, model, opt, rank, sharded, split, roles);
  // The training's peak, read before the floor's replay allocates its own buffers.
  const double max_rss = fsdp_bench::peak_rss_bytes();
  Floor floor;
  if (sharded && o.floor_steps > 0 && world > 1) floor = transport_floor(m.last_step_first_record, o.floor_steps);
  write_results(o, m, fsdp_bench::state_bytes(*model, opt).total(), param_bytes, max_rss, floor, rank, world);
  if (phases) print_phases(o, m, rank);
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

// Every row bench knows, in the order they run and print (--rows picks among them).
std::vector<Row> all_rows(const Options& o) {
  const long long local_batch = o.shape.batch / o.nproc, batch = o.shape.batch;
  auto b = [](long long v) { return " (batch " + std::to_string(v) + ")"; };
  return {
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
       {"--role", "fsdp", "--parallel", "hsdp", "--hsdp", o.hsdp}},
      {"replicate",
       "replicate (DDP: 1 MiB first bucket, then " + std::to_string(o.bucket_mb) + " MiB)" + b(batch),
       {"--role", "fsdp", "--parallel", "replicate", "--floor-steps", std::to_string(o.steps)}},
  };
}

// The rows --rows names (all by default); a misspelt row is an error, not a row quietly left out,
// and single must be one (the limit the others are measured against).
std::vector<Row> pick_rows(const Options& o) {
  const std::vector<Row> all = all_rows(o);
  std::vector<Row> rows;
  for (const auto& r : all) {
    if (o.rows == "all" || ("," + o.rows + ",").find("," + r.key + ",") != std::string::npos) rows.push_back(r);
  }
  if (o.rows != "all") {
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
  return rows;
}

// --rounds rounds, each running every row's workers once (alternating: the machines are noisy);
// then each row's result lines, one per round.
void run_rounds(const Options& o, std::vector<Row>& rows, int threads) {
  fsdp_bench::WorkerLauncher launcher("bench");
  std::vector<std::string> common = o.shape.worker_args();
  common.insert(common.end(),
                {"--steps", std::to_string(o.steps), "--warmup", std::to_string(o.warmup), "--nproc",
                 std::to_string(o.nproc), "--malloc", fsdp_bench::malloc_policy_name(o.malloc), "--cpu-split",
                 o.cpu_split, "--bucket-mb", std::to_string(o.bucket_mb), "--pool-trim", o.pool_trim});
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
  for (auto& r : rows) {
    for (const auto& line : fsdp_bench::read_result_lines(r.result)) {
      r.medians.push_back(line.at("median_step_s"));
      r.cpus.push_back(line.at("cpu_per_step_s"));
      r.faults.push_back(line.at("faults_per_step"));
      if (line.count("floor_cpu_s") && line.at("floor_collectives") > 0) r.floor_cpus.push_back(line.at("floor_cpu_s"));
      r.last = line;
    }
  }
}

// A row's bytes sent per rank and step, with what the row's parallelism should send.
std::string sent_text(Row& r, const Options& o, double params) {
  if (!r.distributed) return "0";
  const double frac = static_cast<double>(o.nproc - 1) / o.nproc;
  const double hr = std::stod(o.hsdp.substr(0, o.hsdp.find('x'))), hs = o.nproc / hr;
  const double mb = r.last["comm_bytes_per_step"] / 1e6;
  char sent[256];
  if (r.key == "fsdp")
    std::snprintf(sent, sizeof sent, "%.2f MB (3 x params x (N-1)/N = %.2f MB)", mb, 3 * params * frac / 1e6);
  else if (r.key == "zero2" || r.key == "replicate")
    std::snprintf(sent, sizeof sent, "%.2f MB (2 x params x (N-1)/N = %.2f MB)", mb, 2 * params * frac / 1e6);
  else if (r.key == "hsdp")
    // FSDP's three passes within the S shard ranks, plus an all-reduce of a 1/S shard over R.
    std::snprintf(sent, sizeof sent,
                  "%.2f MB, %.2f MB of it across replicas (3 x params x (S-1)/S + 2 x params/S x (R-1)/R = %.2f MB)",
                  mb, r.last["all_reduce_bytes_per_step"] / 1e6,
                  params * (3 * (hs - 1) / hs + 2 * (hr - 1) / hr / hs) / 1e6);
  else
    std::snprintf(sent, sizeof sent, "%.2f MB", mb);
  return sent;
}

// The table: per row, step time, CPU and page faults against the limit, memory, bytes sent. CPU
// time and page faults do not move with other processes' load as wall time does.
void print_table(std::vector<Row>& rows, const Options& o) {
  const double limit = rows.front().step(), limit_cpu = median(rows.front().cpus);
  const double params = rows.front().last["param_bytes"];
  std::printf(
      "\n| run | ranks | step time (median) | vs limit | CPU / step, rank 0 (median) | vs limit | page faults / step | "
      "train state / rank | max RSS / rank | sent / rank / step |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (auto& r : rows) {
    char ratio[32] = "1.00x (the limit)";
    if (r.key != "single") std::snprintf(ratio, sizeof ratio, "%.2fx", r.step() / limit);
    std::printf("| %s | %d | %.1f ms | %s | %.1f ms | %.3fx | %.0f | %.2f MB | %.0f MB | %s |\n", r.label.c_str(),
                r.distributed ? o.nproc : 1, 1e3 * r.step(), ratio, 1e3 * median(r.cpus), median(r.cpus) / limit_cpu,
                median(r.faults), r.last["state_bytes"] / 1e6, r.last["max_rss"] / 1e6,
                sent_text(r, o, params).c_str());
  }
}

// FSDP / limit with the per-round medians and the CPU per step, then FSDP's and replicate's
// transport floors (replicate's target is against DDP, fsdp2-cpu-compare.sh, not its floor).
void print_summary(std::vector<Row>& rows, const Options& o, int threads) {
  const double limit = rows.front().step();
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
  auto rep = find_row(rows, "replicate");
  if (rep != rows.end())
    print_floor(*rep, {"replicate's", "all-reduces", "replicate", "DDP", ""}, limit, concurrent, o.nproc, threads);
}

int run_driver(const Options& o) {
  std::vector<Row> rows = pick_rows(o);
  const int threads = fsdp::dist::default_omp_threads(o.nproc);
  const char* bind = std::getenv("FSDP_CPU_BIND");
  std::printf(
      "bench: %s, global batch %lld, float32; %d ranks x %d thread(s); %d steps after %d warm-up, %d rounds; "
      "malloc %s; FSDP_CPU_BIND %s\n",
      o.shape.describe().c_str(), static_cast<long long>(o.shape.batch), o.nproc, threads, o.steps, o.warmup, o.rounds,
      fsdp_bench::malloc_policy_name(o.malloc), bind && *bind ? bind : "unset");
  std::fflush(stdout);
  run_rounds(o, rows, threads);
  print_table(rows, o);
  if (o.cpu_split == "on") print_cpu_split(rows, o.nproc);
  print_summary(rows, o, threads);
  return 0;
}

}  // namespace

// ---- --mode layout: FSDP's CPU layouts in rotation ----------------------------------------------

namespace layout_mode {

using fsdp_bench::bad_input;
struct Options {
  fsdp_bench::GptShape shape;         // bench's GPT, global batch 8
  fsdp_bench::Rotation rotation{60};  // the layouts: 60 steps in blocks of 5 after 3
  int64_t comm_only = 0, flat = 1, split = 0;
  std::string pieces_kib = "64,1024";
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args("bench --mode layout",
                        "usage: fsdprun --nproc-per-node N -- bench --mode layout [--steps N] [--block N] [--warmup N] "
                        "[--layers N] [--dim N] "
                        "[--heads N] [--seq N] [--batch N] [--pieces-kib K,K,...] [--flat 0|1] [--split 0|1] "
                        "[--comm-only KIB]");
  o.shape.add_options(args);
  o.rotation.add_options(args);
  args.option("--comm-only", &o.comm_only).option("--flat", &o.flat).option("--split", &o.split);
  args.option("--pieces-kib", &o.pieces_kib);
  args.parse(argc, argv);
  return o;
}

struct Layout {
  std::string name;
  fsdp::CpuCollectiveOptions options;
  fsdp_bench::Samples per_step;
  uint64_t faults = 0, misses = 0, hits = 0, unmapped = 0;
};

// The collectives alone: a unit's worth of bytes per rank (--comm-only KiB) as one piece or split
// into k pieces, all-gathered `--steps` times each, in rotation.
void run_comm_only(const Options& o, int rank, int world) {
  auto w = fsdp::dist::world_comm();
  const int64_t numel = o.comm_only * 256;
  const std::vector<int> splits = {1, 2, 5, 13};
  std::map<int, fsdp_bench::Samples> calls;
  at::Tensor shard = at::randn({numel}), full = at::empty({numel * world});
  for (int64_t s = 0; s < o.rotation.steps * static_cast<int64_t>(splits.size()); ++s) {
    const int k = splits[static_cast<size_t>(s) % splits.size()];
    std::vector<at::Tensor> ins;
    std::vector<std::vector<at::Tensor>> outs;
    for (int i = 0; i < k; ++i) {
      const int64_t a = numel * i / k, b = numel * (i + 1) / k;
      ins.push_back(shard.narrow(0, a, b - a));
      std::vector<at::Tensor> by_rank;
      for (int r = 0; r < world; ++r) by_rank.push_back(full.narrow(0, r * numel + a, b - a));
      outs.push_back(by_rank);
    }
    const fsdp_bench::Stopwatch call;
    w->all_gather_pieces(ins, outs);
    calls[k].add(call);
  }
  if (rank != 0) return;
  std::printf(
      "| pieces (%lld KiB per rank in all) | calls | wall (median) | process CPU (median) |\n|---|---|---|---|\n",
      static_cast<long long>(o.comm_only));
  for (int k : splits) {
    std::printf("| %d | %zu | %.3f ms | %.3f ms |\n", k, calls[k].size(), 1e3 * calls[k].wall_median(),
                1e3 * calls[k].cpu_median());
  }
}

int run(const Options& o) {
  const auto place = fsdp_bench::join_world(true);
  const int rank = place.rank, world = place.world;
  if (world < 2) bad_input("run it under fsdprun with 2 or more ranks (a world of one has no collectives)");
  if (o.shape.batch % world != 0) bad_input("--batch must be a multiple of the world size");
  if (o.comm_only > 0) {
    run_comm_only(o, rank, world);
    fsdp::dist::destroy_distributed();
    return 0;
  }
  std::vector<Layout> layouts;
  if (o.flat) layouts.push_back({"flat", {false, false, 0}, {}});
  std::stringstream kibs(o.pieces_kib);
  for (std::string k; std::getline(kibs, k, ',');) {
    const size_t bytes = static_cast<size_t>(std::stoll(k)) * 1024;
    layouts.push_back({"per parameter, min_piece_bytes " + k + " KiB", {true, true, bytes}, {}});
    if (o.split) {
      layouts.push_back({"gather per parameter only, " + k + " KiB", {true, false, bytes}, {}});
      layouts.push_back({"reduce per parameter only, " + k + " KiB", {false, true, bytes}, {}});
    }
  }
  const auto& r = o.rotation;
  r.check(layouts.size(), "(layouts)");
  fsdp_bench::GptTraining t(o.shape, place);
  for (int64_t s = 0; s < r.total(); ++s) {
    const bool measured = r.measured(s);
    const size_t which = r.configuration(s, layouts.size());
    fsdp::set_cpu_collective_options(layouts[which].options);
    auto data = t.next_batch();
    const auto pool0 = fsdp::buffer_memory_stats();
    const uint64_t faults0 = fsdp_bench::minor_faults();
    const fsdp_bench::Stopwatch step;
    (void)t.step(data).item<float>();
    const double wall = step.wall(), cpu = step.cpu();
    if (!measured) continue;
    const auto pool1 = fsdp::buffer_memory_stats();
    Layout& l = layouts[which];
    l.per_step.add(wall, cpu);
    l.faults += fsdp_bench::minor_faults() - faults0;
    l.misses += pool1.pool_misses - pool0.pool_misses;
    l.hits += pool1.pool_hits - pool0.pool_hits;
    l.unmapped += pool1.pool_unmapped - pool0.pool_unmapped;
  }
  fsdp::set_cpu_collective_options({});
  if (rank == 0) {
    std::printf("bench --mode layout: %s, layouts in rotation, after %lld warm-up\n",
                r.describe(o.shape, world).c_str(), static_cast<long long>(r.warmup));
    std::printf(
        "| layout | steps | step wall (median) | step CPU, rank 0 (median) | wall / flat | CPU / flat | page faults "
        "/ step | pool hits / misses / unmapped per step |\n"
        "|---|---|---|---|---|---|---|---|\n");
    // Ratios to the first layout (flat unless --flat 0).
    const double flat_wall = layouts[0].per_step.wall_median(), flat_cpu = layouts[0].per_step.cpu_median();
    for (const auto& l : layouts) {
      const double wall = l.per_step.wall_median(), cpu = l.per_step.cpu_median();
      const double n = static_cast<double>(l.per_step.size());
      std::printf("| %s | %zu | %.1f ms | %.1f ms | %.3fx | %.3fx | %.0f | %.1f / %.1f / %.1f |\n", l.name.c_str(),
                  l.per_step.size(), 1e3 * wall, 1e3 * cpu, wall / flat_wall, cpu / flat_cpu, l.faults / n, l.hits / n,
                  l.misses / n, l.unmapped / n);
    }
  }
  fsdp::dist::destroy_distributed();
  return 0;
}

}  // namespace layout_mode

// ---- --mode desync: the desync check's cost, off and on -----------------------------------------

namespace desync_mode {

using fsdp_bench::bad_input;
using fsdp_bench::median;

struct Options {
  fsdp_bench::GptShape shape;     // bench's GPT, global batch 8
  fsdp_bench::Rotation rotation;  // off and on (--detail 2): 40 steps in blocks of 5 after 3
  int64_t detail = 2, calls = 200;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args("bench --mode desync",
                        "usage: fsdprun --nproc-per-node N -- bench --mode desync [--steps N] [--block N] [--warmup N] "
                        "[--layers N] [--dim N] "
                        "[--heads N] [--seq N] [--batch N] [--detail 0|1|2] [--calls N]");
  o.shape.add_options(args);
  o.rotation.add_options(args);
  args.option("--detail", &o.detail).option("--calls", &o.calls);
  args.parse(argc, argv);
  if (o.detail < 0 || o.detail > 2) bad_input("--detail must be 0 (off), 1 (on) or 2 (alternate)");
  if (o.detail == 2) o.rotation.check(2, "2");
  return o;
}

struct Mode {
  fsdp_bench::Samples per_step;
  uint64_t steps = 0, collectives = 0, checks = 0, comm_bytes = 0, check_bytes = 0;
};

int run(const Options& o) {
  const auto place = fsdp_bench::join_world(true);
  const int rank = place.rank, world = place.world;
  if (world < 2) bad_input("run it under fsdprun with 2 or more ranks (a world of one is never checked)");
  if (o.shape.batch % world != 0) bad_input("--batch must be a multiple of the world size");
  fsdp_bench::GptTraining t(o.shape, place);
  auto w = fsdp::dist::world_comm();
  Mode modes[2];
  const auto& r = o.rotation;
  for (int64_t s = 0; s < r.total(); ++s) {
    const bool measured = r.measured(s);
    const bool on = measured && (o.detail == 2 ? r.configuration(s, 2) == 1 : o.detail == 1);
    fsdp::comm::set_desync_detection(on);
    auto data = t.next_batch();
    const auto stats0 = fsdp::comm::process_comm_stats().snapshot();
    const auto checks0 = fsdp::comm::desync_check_counters();
    const uint64_t seq0 = w->seq();
    const fsdp_bench::Stopwatch step;
    (void)t.step(data).item<float>();
    const double wall = step.wall(), cpu = step.cpu();
    if (!measured) continue;
    const auto checks = fsdp::comm::desync_check_counters();
    Mode& m = modes[on ? 1 : 0];
    m.per_step.add(wall, cpu);
    m.steps += 1;
    m.collectives += w->seq() - seq0;
    m.checks += checks.checks - checks0.checks;
    m.comm_bytes += (fsdp::comm::process_comm_stats().snapshot() - stats0).total_bytes();
    m.check_bytes += checks.bytes_sent - checks0.bytes_sent;
  }
  // One check alone: a one-float all_reduce, off and on alternating in blocks of 10 calls.
  std::vector<double> call_s[2];
  at::Tensor one = at::ones({1});
  for (int64_t i = 0; i < o.calls; ++i) {
    const bool on = (i / 10) % 2 == 1;
    fsdp::comm::set_desync_detection(on);
    const auto t0 = std::chrono::steady_clock::now();
    w->all_reduce(one);
    call_s[on ? 1 : 0].push_back(fsdp_bench::seconds_since(t0));
  }
  fsdp::comm::set_desync_detection(false);
  if (rank == 0 && !call_s[0].empty() && !call_s[1].empty()) {
    const double off_us = 1e6 * median(call_s[0]), on_us = 1e6 * median(call_s[1]);
    std::printf("one-float all_reduce (median of %zu calls each): off %.0f us, on %.0f us: one check adds %.0f us\n",
                call_s[0].size(), off_us, on_us, on_us - off_us);
  }
  if (rank == 0) {
    std::printf("bench --mode desync: %s alternating off/on after %lld warm-up\n", r.describe(o.shape, world).c_str(),
                static_cast<long long>(r.warmup));
    std::printf(
        "| DETAIL | steps | step wall (median) | step CPU (median) | collectives / step | checks / step | "
        "collective bytes / step | check bytes / step |\n|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < 2; ++i) {
      const Mode& m = modes[i];
      if (m.steps == 0) continue;
      const double n = static_cast<double>(m.steps);
      std::printf("| %s | %llu | %.1f ms | %.1f ms | %.1f | %.1f | %.0f | %.0f |\n", i ? "on" : "off",
                  static_cast<unsigned long long>(m.steps), 1e3 * m.per_step.wall_median(),
                  1e3 * m.per_step.cpu_median(), m.collectives / n, m.checks / n, m.comm_bytes / n, m.check_bytes / n);
    }
    if (modes[0].steps > 0 && modes[1].steps > 0) {
      const double wall_ratio = modes[1].per_step.wall_median() / modes[0].per_step.wall_median();
      const double cpu_ratio = modes[1].per_step.cpu_median() / modes[0].per_step.cpu_median();
      std::printf("on / off: wall %.3fx, CPU %.3fx; extra bytes %.4f%% of the collectives'\n", wall_ratio, cpu_ratio,
                  100.0 * static_cast<double>(modes[1].check_bytes) / static_cast<double>(modes[1].comm_bytes));
    }
  }
  fsdp::dist::destroy_distributed();
  return 0;
}

}  // namespace desync_mode

// ---- --mode profile: what FSDP's profiler ranges cost, and a trace --------------------------------

namespace profile_mode {

using fsdp_bench::bad_input;
using fsdp_bench::median;

struct Options {
  fsdp_bench::GptShape shape;  // bench's GPT, global batch 8
  std::string dir = "runs/bench_profile";
  int rounds = 5, steps = 4;
};

Options parse(int argc, char** argv) {
  Options o;
  fsdp_bench::Args args(
      "bench --mode profile",
      "usage: fsdprun --nproc-per-node N -- bench --mode profile [--dir DIR] [--rounds N] [--steps N] "
      "[--layers N] [--dim N] [--heads N] [--seq N] [--batch N]");
  o.shape.add_options(args);
  args.option("--dir", &o.dir).option("--rounds", &o.rounds).option("--steps", &o.steps);
  args.parse(argc, argv);
  if (o.rounds < 1 || o.steps < 1) bad_input("--rounds and --steps must be at least 1");
  return o;
}

// Ranges named fsdp::... in one step of a trace: counted from the file, a plain substring count
// over the step's events (the trace holds only recorded steps).
size_t count_fsdp_ranges(const std::string& path) {
  std::ifstream in(path);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t n = 0;
  for (size_t at = text.find("\"fsdp::"); at != std::string::npos; at = text.find("\"fsdp::", at + 1)) ++n;
  return n;
}

// bench's GPT under fully_shard, stepped with a ProfilerStep range around each step and an
// optimizer range around AdamW's step (what train_gpt --profile-steps records).
struct ProfiledTraining {
  ProfiledTraining(const Options& o, int rank, int world)
      : shape(o.shape),
        rank(rank),
        world(world),
        model(fsdp_bench::seeded_gpt(o.shape.config())),
        opt(
            [this] {
              fsdp_bench::shard_gpt(model);
              return model->parameters();  // this rank's shards
            }(),
            torch::optim::AdamWOptions(1e-3)) {}

  void step() {
    ++step_no;
    const fsdp::profiler::Range step_range("ProfilerStep#" + std::to_string(step_no));
    torch::manual_seed(1000 + step_no * world + rank);
    const int64_t per_rank = std::max<int64_t>(1, shape.batch / world);
    const at::Tensor batch = torch::randint(0, fsdp_bench::kVocab, {per_rank, shape.seq + 1}, at::kLong);
    opt.zero_grad();
    auto loss = fsdp::models::gpt_loss(fsdp::call(model, batch.narrow(1, 0, shape.seq)), batch.narrow(1, 1, shape.seq));
    loss.backward();
    const fsdp::profiler::Range opt_range("fsdp::optimizer_step");
    opt.step();
  }
  // `n` steps, each one's wall seconds appended to `times`.
  void timed_steps(int n, std::vector<double>& times) {
    for (int i = 0; i < n; ++i) {
      const auto t = std::chrono::steady_clock::now();
      step();
      times.push_back(fsdp_bench::seconds_since(t));
    }
  }

  fsdp_bench::GptShape shape;
  int rank, world, step_no = 0;
  fsdp::models::GPT model;
  torch::optim::AdamW opt;
};

// What the rounds measured: step times with nothing recording and recording, the last trace.
struct Rounds {
  std::vector<double> off, on;
  std::string path;
  int first_recorded = 0;
  fsdp::profiler::Backend backend = fsdp::profiler::Backend::Auto;
};

// --rounds rounds of --steps steps with the ranges inactive, then --steps recorded by a
// TraceSession (Backend::Auto: Kineto where this LibTorch has it, else FSDP's writer).
Rounds run_rounds(const Options& o, ProfiledTraining& t) {
  Rounds r;
  auto world_comm = fsdp::dist::world_comm();
  for (int round = 0; round < o.rounds; ++round) {
    world_comm->barrier();
    t.timed_steps(o.steps, r.off);
    world_comm->barrier();
    fsdp::profiler::TraceSession trace(fsdp::profiler::rank_trace_path(o.dir, t.rank));
    r.first_recorded = t.step_no + 1;
    trace.start();
    t.timed_steps(o.steps, r.on);
    trace.stop();
    r.path = trace.path();
    r.backend = trace.backend();
  }
  return r;
}

// One inactive range, timed alone 10^6 times: nanoseconds per range.
double inactive_range_ns() {
  const int reps = 1000000;
  const auto t = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) {
    const fsdp::profiler::Range range("fsdp::copy_out", "h.0");
  }
  return fsdp_bench::seconds_since(t) / reps * 1e9;
}

void print_report(const Options& o, const Rounds& r, double ns_per_range, size_t ranges_per_step, int world) {
  const double m_off = median(r.off), m_on = median(r.on);
  const auto [off_lo, off_hi] = std::minmax_element(r.off.begin(), r.off.end());
  const auto [on_lo, on_hi] = std::minmax_element(r.on.begin(), r.on.end());
  std::printf("bench --mode profile: %d ranks, %s, global batch %lld, %d rounds x %d steps\n", world,
              o.shape.describe().c_str(), static_cast<long long>(o.shape.batch), o.rounds, o.steps);
  std::printf("  step, nothing recording (ranges inactive): median %.1f ms (min %.1f, max %.1f)\n", m_off * 1e3,
              *off_lo * 1e3, *off_hi * 1e3);
  std::printf("  step, recording (%s):                   median %.1f ms (min %.1f, max %.1f), %.2fx\n",
              fsdp::profiler::backend_name(r.backend), m_on * 1e3, *on_lo * 1e3, *on_hi * 1e3, m_on / m_off);
  const double per_step_ns = ns_per_range * static_cast<double>(ranges_per_step);
  std::printf("  one inactive range: %.1f ns; %zu fsdp:: ranges per step -> %.2f us per step (%.4f%% of it)\n",
              ns_per_range, ranges_per_step, per_step_ns / 1e3, per_step_ns / (m_off * 1e9) * 100);
  std::printf("  traces of steps %d-%d: %s (one per rank)\n", r.first_recorded, r.first_recorded + o.steps - 1,
              r.path.c_str());
}

// After 3 warm-up steps, the rounds; rank 0 prints the median step time of each kind, the cost of
// one inactive range times the ranges a step runs (counted in the trace), and where the traces are.
int run(const Options& o) {
  const auto place = fsdp_bench::join_world(true);
  ProfiledTraining t(o, place.rank, place.world);
  for (int i = 0; i < 3; ++i) t.step();
  const Rounds r = run_rounds(o, t);
  const double ns_per_range = inactive_range_ns();
  const size_t ranges_per_step = count_fsdp_ranges(r.path) / static_cast<size_t>(o.steps);
  if (place.rank == 0) print_report(o, r, ns_per_range, ranges_per_step, place.world);
  fsdp::dist::world_comm()->barrier();
  fsdp::dist::destroy_distributed();
  return 0;
}

}  // namespace profile_mode

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  std::vector<char*> args(argv, argv + argc + 1);  // argv[argc] is the null pointer
  const std::string mode = fsdp_bench::take_mode(argc, args.data(), "bench", {"limit", "layout", "desync", "profile"});
  if (mode == "layout") return fsdp_bench::run_main(argc, args.data(), layout_mode::parse, layout_mode::run);
  if (mode == "desync") return fsdp_bench::run_main(argc, args.data(), desync_mode::parse, desync_mode::run);
  if (mode == "profile") return fsdp_bench::run_main(argc, args.data(), profile_mode::parse, profile_mode::run);
  return fsdp_bench::run_main(argc, args.data(), parse, [](const Options& o) {
    return o.role == "driver" ? run_driver(o) : run_worker(o, /*sharded=*/o.role == "fsdp");
  });
}
