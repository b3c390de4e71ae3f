#pragma once
// What the benchmark programs share, so that each keeps only what it measures:
//   - main and the command line: run_main (CPU tuning, options, errors reported), Args (options
//     and flags bound to variables; bad input is one line naming it, the usage, exit 2),
//     GptShape (--layers --dim --heads --seq --batch: the GPT's config, its description, the
//     worker arguments) and Rotation (--steps --block --warmup: configurations alternating in
//     blocks of steps);
//   - the model: bench's GPT from seed 0, fully_shard per block and on the root, materialising a
//     meta model, random tokens, one training step (GptTraining puts these together), the bytes
//     of parameters / gradients / AdamW state;
//   - timing: the median, wall and process CPU time of a stretch (Stopwatch, Samples), and the
//     process's CPU time by thread role (ThreadRoles: compute, transport);
//   - memory: peak and current RSS, VmHWM, minor page faults; --malloc's policies (MallocPolicy);
//   - drivers: starting a worker copy of the program (directly or under fsdprun) with extra
//     environment variables, and the key-value result files the workers write.
#include <dirent.h>
#include <spawn.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"

extern char** environ;

namespace fsdp_bench {

// ---- Timing -------------------------------------------------------------------------------------

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// This process's CPU time so far, all threads, in seconds (CLOCK_PROCESS_CPUTIME_ID).
inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Wall seconds from `t0` to now (steady clock).
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The wall and process CPU time of one stretch (a step, a call), started at construction.
class Stopwatch {
 public:
  Stopwatch() : cpu0_(cpu_seconds()), t0_(std::chrono::steady_clock::now()) {}
  double wall() const { return seconds_since(t0_); }
  double cpu() const { return cpu_seconds() - cpu0_; }

 private:
  double cpu0_;
  std::chrono::steady_clock::time_point t0_;
};

// Wall and CPU seconds of repeated stretches (one configuration's steps), with their medians.
struct Samples {
  std::vector<double> wall, cpu;
  void add(double wall_s, double cpu_s) {
    wall.push_back(wall_s);
    cpu.push_back(cpu_s);
  }
  void add(const Stopwatch& stretch) {  // now: the wall time first, then the CPU time
    const double wall_s = stretch.wall();
    add(wall_s, stretch.cpu());
  }
  size_t size() const { return wall.size(); }
  double wall_median() const { return median(wall); }
  double cpu_median() const { return median(cpu); }
};

// [Note: CPU time by thread role]
// bench splits each step's CPU time into compute, transport and FSDP's own ("ours"). Ours is timed
// inside FSDP (fsdp/debug/phase_timers.h: the thread CPU time of the hooks and of the phases run
// outside them). Transport is the CPU of the threads that move the bytes: c10d's ProcessGroupGloo
// workers, gloo's TCP event loop, the store's threads. They cannot be told by their names: under
// LibTorch 1.13 none of them names itself, so each shows the name of the thread that started it
// (every thread of a bench worker is "bench"). They are told by when they start instead: every
// thread that exists when the process joins its world computes (the main thread, a BLAS pool
// started at load), and every thread started while it joins (fsdp::dist::init_distributed: the
// process group's workers and loop, the store's) carries the transport: 3 on each of bench's 2
// ranks, none in a world of one (joining it starts no thread). A thread first seen later computes
// (OpenMP's pool, started by the first parallel region), unless its name says Gloo or c10d
// (LibTorch versions that name their threads); FSDP's collective watcher (comm/async_watch.cpp)
// starts only for NCCL. Transport done on the calling thread (the sends of Gloo's p2p all-gather)
// is not in it: it is in ours (FSDP's collective calls). Each thread's CPU clock is read
// directly (the kernel's per-thread clock, in nanoseconds, as CLOCK_THREAD_CPUTIME_ID is for the
// caller); /proc's utime/stime count 10 ms ticks, too coarse for a step of tens of milliseconds.
// A thread that ends during a step takes its CPU out of the sum over threads but not out of the
// process's: compute is what is left of the process's CPU.

// The CPU time, in nanoseconds, of thread `tid` of this process (0 once it has ended). The clock id
// is Linux's for a thread's CPU clock (what pthread_getcpuclockid returns: MAKE_THREAD_CPUCLOCK(tid,
// CPUCLOCK_SCHED) = ~tid << 3 | 6), which works for any thread of the calling process.
inline uint64_t thread_cpu_ns(pid_t tid) {
  const auto clock = static_cast<clockid_t>((~static_cast<unsigned>(tid) << 3) | 6u);
  timespec ts{};
  if (clock_gettime(clock, &ts) != 0) return 0;
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}

// The ids of this process's threads now (/proc/self/task).
inline std::vector<pid_t> thread_ids() {
  std::vector<pid_t> ids;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return ids;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] >= '0' && e->d_name[0] <= '9') ids.push_back(static_cast<pid_t>(std::atol(e->d_name)));
  }
  closedir(dir);
  return ids;
}

// A thread's name (/proc/self/task/TID/comm), "" once it has ended.
inline std::string thread_name(pid_t tid) {
  std::ifstream in("/proc/self/task/" + std::to_string(tid) + "/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

// This process's threads by role, and their CPU time (see [Note: CPU time by thread role]).
class ThreadRoles {
 public:
  enum Role { Compute, Transport };
  struct Cpu {
    uint64_t compute_ns = 0, transport_ns = 0;  // over the threads alive when read
    int compute_threads = 0, transport_threads = 0;
  };

  // Before joining the world: the threads there are compute.
  void before_transport() {
    for (pid_t t : thread_ids()) roles_.emplace(t, Compute);
  }
  // After joining it: the threads started since carry the transport.
  void after_transport() {
    for (pid_t t : thread_ids()) roles_.emplace(t, Transport);
  }
  // The CPU time so far of the threads alive now, by role; a thread seen for the first time gets
  // its role from its name.
  Cpu cpu() {
    Cpu c;
    for (pid_t t : thread_ids()) {
      auto it = roles_.find(t);
      if (it == roles_.end()) it = roles_.emplace(t, role_by_name(thread_name(t))).first;
      const uint64_t ns = thread_cpu_ns(t);
      if (it->second == Transport) {
        c.transport_ns += ns;
        ++c.transport_threads;
      } else {
        c.compute_ns += ns;
        ++c.compute_threads;
      }
    }
    return c;
  }

 private:
  static Role role_by_name(std::string name) {
    std::transform(name.begin(), name.end(), name.begin(), [](unsigned char ch) { return std::tolower(ch); });
    return name.find("gloo") != std::string::npos || name.find("c10d") != std::string::npos ? Transport : Compute;
  }
  std::map<pid_t, Role> roles_;
};

// ---- Memory -------------------------------------------------------------------------------------

// Minor page faults of this process so far (getrusage's ru_minflt).
inline uint64_t minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<uint64_t>(u.ru_minflt);
}

// getrusage's ru_maxrss: the peak resident set of this process, in bytes.
inline double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

// This process's resident set now (/proc/self/statm), in bytes.
inline double resident_bytes() {
  std::ifstream in("/proc/self/statm");
  double pages_total = 0, pages_resident = 0;
  in >> pages_total >> pages_resident;
  return pages_resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// The kernel's high-water mark of this process's resident set (VmHWM), in bytes.
inline double vm_hwm_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) * 1024.0;
  }
  return 0;
}

// ---- Command line -------------------------------------------------------------------------------

// The program's name and usage text (set by Args), for bad_input and report_errors.
inline std::string g_program = "benchmark", g_usage;

// Bad input: "program: why", the usage text, exit 2.
[[noreturn]] inline void bad_input(const std::string& why) {
  std::fprintf(stderr, "%s: %s\n%s\n", g_program.c_str(), why.c_str(), g_usage.c_str());
  std::exit(2);
}

// A benchmark's options: "--name value" pairs and value-less flags, each bound to a variable;
// --help prints the usage (exit 0). Unknown options, a missing value and a value that is not an integer where one is
// wanted are refused with one line naming the option (bad_input). Constructing it names the program.
class Args {
 public:
  Args(const std::string& program, const std::string& usage) {
    g_program = program;
    g_usage = usage;
  }

  Args& flag(const std::string& name, std::function<void()> set) {
    flags_[name] = std::move(set);
    return *this;
  }
  Args& flag(const std::string& name, bool* on) {
    return flag(name, [on] { *on = true; });
  }
  Args& option(const std::string& name, std::function<void(const std::string&)> set) {
    options_[name] = std::move(set);
    return *this;
  }
  Args& option(const std::string& name, std::string* value) {
    return option(name, [value](const std::string& v) { *value = v; });
  }
  Args& option(const std::string& name, int64_t* value) {
    return option(name, [this, name, value](const std::string& v) { *value = integer(name, v); });
  }
  Args& option(const std::string& name, int* value) {
    return option(name, [this, name, value](const std::string& v) {
      const int64_t n = integer(name, v);
      if (n < std::numeric_limits<int>::min() || n > std::numeric_limits<int>::max()) {
        fail(name + " takes an integer up to " + std::to_string(std::numeric_limits<int>::max()) + ", got " + v);
      }
      *value = static_cast<int>(n);
    });
  }

  // --help (or -h) prints the usage and exits 0; bad input exits 2 (bad_input).
  void parse(int argc, char** argv) const {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::printf("%s\n", g_usage.c_str());
        std::exit(0);
      }
      if (auto f = flags_.find(a); f != flags_.end()) {
        f->second();
        continue;
      }
      auto o = options_.find(a);
      if (o == options_.end()) fail("unknown option " + a);
      if (i + 1 >= argc) fail("missing value for " + a);
      o->second(argv[++i]);
    }
  }

  // A comma-separated list of integers ("2,4"), for an option that takes several.
  std::vector<int> integers(const std::string& name, const std::string& list) const {
    std::vector<int> out;
    std::stringstream ss(list);
    for (std::string item; std::getline(ss, item, ',');) out.push_back(static_cast<int>(integer(name, item)));
    return out;
  }

  [[noreturn]] void fail(const std::string& why) const { bad_input(why); }

 private:
  int64_t integer(const std::string& name, const std::string& v) const {
    errno = 0;
    char* end = nullptr;
    const long long n = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || errno == ERANGE) fail(name + " takes an integer, got '" + v + "'");
    return n;
  }

  std::map<std::string, std::function<void()>> flags_;
  std::map<std::string, std::function<void(const std::string&)>> options_;
};

// A program with modes: "--mode M" (M one of `modes`, the first the default) taken out of argv, so
// that the mode's own Args parse the rest; returns M. Call it after tune_cpu_or_reexec, which
// re-executes the whole command line. A missing or unknown M is bad input naming the modes.
inline std::string take_mode(int& argc, char** argv, const std::string& program,
                             const std::vector<std::string>& modes) {
  std::string names;
  for (const auto& m : modes) names += (names.empty() ? "" : "|") + m;
  g_program = program;
  g_usage = "usage: " + program + " [--mode " + names + "] ... (" + program + " [--mode M] --help: its options)";
  std::string mode = modes.front();
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) != "--mode") continue;
    if (i + 1 >= argc) bad_input("missing value for --mode");
    mode = argv[i + 1];
    for (int j = i; j + 2 <= argc; ++j) argv[j] = argv[j + 2];  // argv[argc] is the null pointer
    argc -= 2;
    break;
  }
  if (std::find(modes.begin(), modes.end(), mode) == modes.end()) {
    bad_input("--mode takes " + names + ", got '" + mode + "'");
  }
  return mode;
}

// --malloc: how glibc's malloc is set in a benchmark's processes (fsdp/debug/malloc_tuning.h).
enum class MallocPolicy {
  Default,  // "default", also "glibc": glibc's own thresholds, which move with the sizes freed
  Tuned,    // "tuned": fsdp::tune_malloc(), train_gpt's policy for memory (blocks of 1 MiB+ mapped)
  Speed,    // "speed": fsdp::tune_malloc_for_speed() (freed tensors stay in the heap: no page
            // faulted in again each step; the peak RSS is the heap's high-water mark)
  Warm,     // "warm": fsdp::raise_malloc_thresholds() (glibc's mmap threshold where a Python
            // process that imported torch has it, 32 MiB, and the trim threshold fixed at 256 MiB)
};

inline const char* malloc_policy_name(MallocPolicy p) {
  switch (p) {
    case MallocPolicy::Tuned: return "tuned";
    case MallocPolicy::Speed: return "speed";
    case MallocPolicy::Warm: return "warm";
    case MallocPolicy::Default: break;
  }
  return "default";
}

// The policy named `name`; another name is bad input (one line listing the names, exit 2).
inline MallocPolicy malloc_policy(const std::string& name) {
  if (name == "default" || name == "glibc") return MallocPolicy::Default;
  if (name == "tuned") return MallocPolicy::Tuned;
  if (name == "speed") return MallocPolicy::Speed;
  if (name == "warm") return MallocPolicy::Warm;
  bad_input(
      "--malloc takes default (glibc's own; also glibc), tuned (fsdp::tune_malloc: memory), speed "
      "(fsdp::tune_malloc_for_speed: step time) or warm (fsdp::raise_malloc_thresholds: glibc's thresholds "
      "as in a Python process), got '" +
      name + "'");
}

// Sets malloc as `p` says (Default: leaves it); first thing in a worker, before tensors are
// allocated. Returns whether malloc was changed (false for Default, or where tuning is off:
// FSDP_MALLOC_TUNING=0, not glibc).
inline bool apply_malloc_policy(MallocPolicy p) {
  if (p == MallocPolicy::Tuned) return fsdp::tune_malloc();
  if (p == MallocPolicy::Speed) return fsdp::tune_malloc_for_speed();
  if (p == MallocPolicy::Warm) return fsdp::raise_malloc_thresholds();
  return false;
}

// --malloc NAME, checked as it is parsed, bound to `policy`.
inline void add_malloc_option(Args& args, MallocPolicy* policy) {
  args.option("--malloc", [policy](const std::string& name) { *policy = malloc_policy(name); });
}

// ---- The model ----------------------------------------------------------------------------------

constexpr int64_t kVocab = 256;  // byte-level tokens, as train_gpt's synthetic data

// The benchmark GPT's shape (defaults: bench's 4 layers, d=256, 4 heads, seq 128, batch 8) and the
// options that set it.
struct GptShape {
  int64_t layers = 4, dim = 256, heads = 4, seq = 128, batch = 8;

  // --layers --dim --heads --seq --batch.
  void add_options(Args& args) {
    args.option("--layers", &layers).option("--dim", &dim).option("--heads", &heads).option("--seq", &seq);
    args.option("--batch", &batch);
  }
  // The same options, to pass to a worker copy of the program.
  std::vector<std::string> worker_args() const {
    return {"--layers", std::to_string(layers), "--dim",   std::to_string(dim),  "--heads", std::to_string(heads),
            "--seq",    std::to_string(seq),    "--batch", std::to_string(batch)};
  }
  // The GPT's config (vocabulary kVocab) with its parameters on `device` (torch::kMeta: none yet).
  fsdp::models::GPTConfig config(torch::Device device = torch::kCPU) const {
    fsdp::models::GPTConfig c;
    c.vocab_size = kVocab;
    c.block_size = seq;
    c.n_layer = layers;
    c.n_head = heads;
    c.n_embd = dim;
    c.device = device;
    return c;
  }
  // "GPT 4 layers, d=256, 4 heads, seq 128": the start of every benchmark's first line.
  std::string describe() const {
    return "GPT " + std::to_string(layers) + " layers, d=" + std::to_string(dim) + ", " + std::to_string(heads) +
           " heads, seq " + std::to_string(seq);
  }
};

// Configurations compared in one run, switched between blocks of steps in rotation (every rank
// switches at the same step, as it must): `warmup` steps, then `steps` measured ones in blocks of
// `block`, block i running configuration i mod n.
struct Rotation {
  int64_t steps = 40, block = 5, warmup = 3;

  // --steps --block --warmup.
  void add_options(Args& args) { args.option("--steps", &steps).option("--block", &block).option("--warmup", &warmup); }
  // Every one of `n` configurations gets at least one block.
  void check(size_t n, const std::string& configurations) const {
    if (block < 1 || steps < static_cast<int64_t>(n) * block)
      bad_input("--steps must be at least " + configurations + " x --block");
  }
  int64_t total() const { return warmup + steps; }
  bool measured(int64_t step) const { return step >= warmup; }
  // The configuration step `step` runs (0 in the warm-up).
  size_t configuration(int64_t step, size_t n) const {
    return measured(step) ? static_cast<size_t>((step - warmup) / block) % n : 0;
  }
  // "GPT 4 layers, d=256, 4 heads, seq 128, global batch 8, float32, fully_shard per block + root;
  // 2 ranks; 40 steps in blocks of 5": bench's training run of `shape` on `world` ranks.
  std::string describe(const GptShape& shape, int world) const {
    return shape.describe() + ", global batch " + std::to_string(shape.batch) +
           ", float32, fully_shard per block + root; " + std::to_string(world) + " ranks; " + std::to_string(steps) +
           " steps in blocks of " + std::to_string(block);
  }
};

// The GPT of `c` with the values of torch::manual_seed(0): every process builds the same model.
inline fsdp::models::GPT seeded_gpt(const fsdp::models::GPTConfig& c) {
  torch::manual_seed(0);
  return fsdp::models::GPT(c);
}

// fully_shard on every block, then on the root (bottom-up, as FSDP2 wants); the blocks' units.
inline std::vector<fsdp::FSDPModule> shard_gpt(fsdp::models::GPT& model, const fsdp::FullyShardOptions& options = {}) {
  std::vector<fsdp::FSDPModule> units;
  for (auto& b : model->blocks) units.push_back(fsdp::fully_shard(b, options));
  fsdp::fully_shard(model, options);
  return units;
}

// A model built on the meta device (and sharded): this rank's parameters allocated on the CPU and
// initialised (train_gpt's recipe: a rank never holds the whole model).
inline void materialize(fsdp::models::GPT& model) {
  fsdp::to_empty(*model, torch::kCPU);
  model->reset_parameters();
}

// Rank `rank`'s stream of synthetic tokens.
inline at::Generator token_stream(int rank) { return at::detail::createCPUGenerator(1234 + rank); }

// `batch` sequences of `seq` + 1 random tokens (inputs and the next-token targets).
inline at::Tensor random_tokens(at::Generator& gen, int64_t batch, int64_t seq) {
  return at::randint(kVocab, {batch, seq + 1}, gen, at::kLong);
}

// One training step on `data` (random_tokens): forward through fsdp::call (the hooks of
// fully_shard and activation checkpointing) or, with `through_fsdp` false, the plain forward;
// the loss, backward, the optimizer's step. Returns the loss.
inline at::Tensor train_step(fsdp::models::GPT& model, torch::optim::Optimizer& opt, const at::Tensor& data,
                             bool through_fsdp = true) {
  const int64_t seq = data.size(1) - 1;
  opt.zero_grad();
  auto input = data.narrow(1, 0, seq);
  auto logits = through_fsdp ? fsdp::call(model, input) : model->forward(input);
  auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, seq));
  loss.backward();
  opt.step();
  return loss;
}

// This process's place: rank 0 of 1, or, when `distributed` (under fsdprun), its rank in the
// world it joins (fsdp::dist::init_distributed; the caller destroys it).
struct Place {
  int rank = 0, world = 1;
};
inline Place join_world(bool distributed) {
  if (!distributed) return {};
  fsdp::dist::init_distributed();
  return {fsdp::dist::rank(), fsdp::dist::world_size()};
}

// bench's training setup on one rank: the GPT of `shape` from seed 0, fully_shard per block and on
// the root when `sharded` (else plain LibTorch), AdamW (lr 1e-3) over what the rank holds, and the
// rank's token stream of shape.batch / world sequences per step.
struct GptTraining {
  GptTraining(const GptShape& shape, Place place, bool sharded = true)
      : sharded(sharded),
        seq(shape.seq),
        local_batch(shape.batch / place.world),
        model(seeded_gpt(shape.config())),
        opt(shard_and_list(model, sharded), torch::optim::AdamWOptions(1e-3)),
        gen(token_stream(place.rank)) {}

  at::Tensor next_batch() { return random_tokens(gen, local_batch, seq); }
  at::Tensor step(const at::Tensor& data) { return train_step(model, opt, data, sharded); }

  bool sharded;
  int64_t seq, local_batch;
  fsdp::models::GPT model;
  torch::optim::AdamW opt;
  at::Generator gen;

 private:
  static std::vector<at::Tensor> shard_and_list(fsdp::models::GPT& model, bool sharded) {
    if (sharded) shard_gpt(model);
    return model->parameters();  // after fully_shard: this rank's shards
  }
};

// The bytes of a model's parameters, their gradients and AdamW's state (exp_avg, exp_avg_sq) in
// this process: with fully_shard, this rank's shards.
struct StateBytes {
  double params = 0, grads = 0, optim = 0;
  double total() const { return params + grads + optim; }
};
inline StateBytes state_bytes(torch::nn::Module& model, torch::optim::AdamW& opt) {
  StateBytes b;
  for (const auto& p : model.parameters()) {
    b.params += p.nbytes();
    if (p.grad().defined()) b.grads += p.grad().nbytes();
  }
  for (const auto& item : opt.state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*item.second);
    b.optim += st.exp_avg().nbytes() + st.exp_avg_sq().nbytes();
  }
  return b;
}

// main()'s body with an exception reported as "program: what" (exit 1).
template <typename Body>
int report_errors(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", g_program.c_str(), e.what());
    return 1;
  }
}

// A benchmark's main(): the CPU tuning of a process started without the launcher (it may start
// the program again), the options (`parse`, bad input: exit 2), then `body(options)` with its
// exceptions reported (exit 1).
template <typename Parse, typename Body>
int run_main(int argc, char** argv, Parse&& parse, Body&& body) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  const auto options = parse(argc, argv);
  return report_errors([&] { return body(options); });
}

// ---- Drivers and workers ------------------------------------------------------------------------

// Runs args[0] (a path) with this process's environment plus `extra_env` ("NAME=value"); returns
// its exit status (128 + signal when killed, 127 when it could not start).
inline int spawn_and_wait(const std::vector<std::string>& args, const std::vector<std::string>& extra_env) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) env_strings.emplace_back(*e);
  for (const auto& kv : extra_env) env_strings.push_back(kv);
  std::vector<char*> envp;
  for (auto& s : env_strings) envp.push_back(s.data());
  envp.push_back(nullptr);
  pid_t pid;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), envp.data()) != 0) return 127;
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A worker's result file, one map per line of "key value key value ...".
inline std::vector<std::map<std::string, double>> read_result_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::map<std::string, double>> lines;
  std::string line, k;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::map<std::string, double> r;
    double v;
    while (ls >> k >> v) r[k] = v;
    lines.push_back(std::move(r));
  }
  return lines;
}

// A worker's result file as one map (a key on a later line replaces the same key before it).
inline std::map<std::string, double> read_results(const std::string& path) {
  std::map<std::string, double> r;
  for (auto& line : read_result_lines(path)) {
    for (auto& [k, v] : line) r[k] = v;
  }
  return r;
}

// The driver side of a benchmark whose configurations run as fresh worker copies of the program:
// this program's path, fsdprun next to it, and a temporary folder for the result files.
class WorkerLauncher {
 public:
  // `program` names the benchmark in the one-line errors (exit 2) when this program's path,
  // fsdprun next to it or a temporary folder cannot be had.
  explicit WorkerLauncher(const std::string& program) : program_(program) {
    char buf[4096];
    const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
    if (n <= 0) fail("cannot find this program's path");
    buf[n] = '\0';
    self_ = buf;
    fsdprun_ = self_.substr(0, self_.rfind('/')) + "/fsdprun";
    if (access(fsdprun_.c_str(), X_OK) != 0) fail("fsdprun not found next to " + program + ": " + fsdprun_);
    std::string tmpl = "/tmp/fsdp-" + program + "-XXXXXX";
    if (!mkdtemp(tmpl.data())) fail("cannot create a temporary folder");
    dir_ = tmpl;
  }

  const std::string& self() const { return self_; }
  // A new result path in the temporary folder (a worker of rank r writes `path + "." + r` or `path`).
  std::string result_path(const std::string& name) { return dir_ + "/" + name + std::to_string(counter_++); }

  // Runs this program with `args`: directly when `ranks` is 0, else under fsdprun with `ranks`
  // local workers (any free port). Returns the exit status (see spawn_and_wait).
  int run(int ranks, const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {}) const {
    std::vector<std::string> cmd;
    if (ranks > 0) cmd = {fsdprun_, "--nproc-per-node", std::to_string(ranks), "--master-port", "0", "--"};
    cmd.push_back(self_);
    cmd.insert(cmd.end(), args.begin(), args.end());
    return spawn_and_wait(cmd, extra_env);
  }

  [[noreturn]] void fail(const std::string& why) const {
    std::fprintf(stderr, "%s: %s\n", program_.c_str(), why.c_str());
    std::exit(2);
  }

 private:
  std::string program_, self_, fsdprun_, dir_;
  int counter_ = 0;
};

}  // namespace fsdp_bench
