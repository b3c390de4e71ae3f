// activation_bench: what activation checkpointing buys and costs, measured in one run.
//
//   build/bin/activation_bench [--steps 3] [--warmup 1] [--rounds 1] [--layers 8] [--dim 256] [--heads 4]
//                              [--seq 512] [--batch 8]              memory rows: none / full / every:2
//   build/bin/activation_bench --fit [--budget-mb 1536]               fit table, ~100M parameters
//   [--glibc-default-malloc]: workers keep glibc's dynamic mmap threshold (see run_worker)
//
// Every configuration runs in a fresh process (fsdprun for several ranks), so its peak resident
// memory (getrusage ru_maxrss: the peak RSS of that process; LibTorch 1.13 keeps no CPU allocator
// statistics) belongs to that configuration alone. Rows: peak RSS per rank, the part of it that
// training added on top of the process after model and optimizer construction, the bytes of
// parameters / gradients / optimizer state per rank, and the median step time, wall clock and
// CPU time (user + system of the process: the work done, less sensitive to other load on a
// shared machine).
//
// Memory rows: GPT --layers x --dim, --seq tokens, --batch sequences per rank, fully_shard in a
// world of one (every fsdp::call hook, no network); checkpointing full (every block) and every:2.
// Fit: GPT 14 x 768 (99M parameters), seq 512, 1 sequence per rank, for one process (plain
// LibTorch), FSDP 2 ranks, FSDP 2 ranks + full, FSDP 4 ranks + full; each peak is set against a
// stated per-process budget (--budget-mb).
#include <malloc.h>
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
#include "models/gpt.h"

namespace {

using fsdp_bench::median;
using fsdp_bench::peak_rss_bytes;

struct Options {
  int steps = 3, warmup = 1, rounds = 1;
  int64_t layers = 8, dim = 256, heads = 4, seq = 512, batch = 8;
  bool fit = false;
  int64_t budget_mb = 1536;
  std::string role = "driver";    // driver | worker
  std::string ac = "none";        // none | full | every:K
  std::string parallel = "fsdp";  // fsdp | none (plain LibTorch)
  std::string result;
  bool glibc_default = false;  // keep glibc's dynamic mmap threshold (see run_worker)
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "activation_bench: %s\nusage: activation_bench [--steps N] [--warmup N] [--layers N] [--dim N] "
               "[--heads N] [--seq N] [--batch N] [--rounds N] | --fit [--budget-mb N]; [--glibc-default-malloc]\n",
               why.c_str());
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  std::map<std::string, int64_t*> ints = {
      {"--layers", &o.layers}, {"--dim", &o.dim},     {"--heads", &o.heads},
      {"--seq", &o.seq},       {"--batch", &o.batch}, {"--budget-mb", &o.budget_mb},
  };
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--fit") {
      o.fit = true;
      continue;
    }
    if (a == "--glibc-default-malloc") {
      o.glibc_default = true;
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + a);
    std::string v = argv[++i];
    if (a == "--role")
      o.role = v;
    else if (a == "--ac")
      o.ac = v;
    else if (a == "--parallel")
      o.parallel = v;
    else if (a == "--result")
      o.result = v;
    else if (a == "--steps")
      o.steps = std::stoi(v);
    else if (a == "--warmup")
      o.warmup = std::stoi(v);
    else if (a == "--rounds")
      o.rounds = std::stoi(v);
    else if (ints.count(a))
      *ints[a] = std::stoll(v);
    else
      usage("unknown option " + a);
  }
  if (o.steps < 1 || o.warmup < 0) usage("--steps must be positive, --warmup not negative");
  return o;
}

double cpu_seconds() {  // this process's user + system time, all threads
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

int run_worker(const Options& o) {
  // glibc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after which
  // tensors below it come from the heap and stay resident when freed: the peak RSS then measures
  // the heap's high-water mark, not the tensors alive at once. A fixed 1 MiB threshold returns
  // every freed tensor to the system, so the peak follows what is alive (--glibc-default-malloc:
  // leave glibc as it is).
  if (!o.glibc_default) mallopt(M_MMAP_THRESHOLD, 1 << 20);
  const bool sharded = o.parallel == "fsdp";
  int rank = 0, world = 1;
  if (sharded) {
    fsdp::dist::init_distributed();
    rank = fsdp::dist::rank();
    world = fsdp::dist::world_size();
  }
  fsdp::models::GPTConfig c;
  c.vocab_size = 256;
  c.block_size = o.seq;
  c.n_layer = o.layers;
  c.n_head = o.heads;
  c.n_embd = o.dim;
  c.device = torch::kMeta;  // a sharded rank never holds the whole model
  fsdp::models::GPT model(c);
  int64_t n_params = 0;
  for (const auto& p : model->parameters()) n_params += p.numel();
  if (o.ac == "full") {
    fsdp::activation::apply_activation_checkpointing(*model, fsdp::activation::every_kth<fsdp::models::BlockImpl>(1));
  } else if (o.ac.rfind("every:", 0) == 0) {
    fsdp::activation::apply_activation_checkpointing(
        *model, fsdp::activation::every_kth<fsdp::models::BlockImpl>(std::stoi(o.ac.substr(6))));
  } else if (o.ac != "none") {
    usage("--ac must be none, full or every:K");
  }
  if (sharded) {
    for (auto& b : model->blocks) fsdp::fully_shard(b);
    fsdp::fully_shard(model);
  }
  fsdp::to_empty(*model, torch::kCPU);
  model->reset_parameters();
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-4));
  auto gen = at::detail::createCPUGenerator(1234 + rank);
  const double rss_before = fsdp_bench::resident_bytes();
  std::vector<double> times, cpu_times;
  double loss_value = 0;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    auto data = at::randint(c.vocab_size, {o.batch, c.block_size + 1}, gen, at::kLong);
    auto t0 = std::chrono::steady_clock::now();
    const double c0 = cpu_seconds();
    opt.zero_grad();
    auto input = data.narrow(1, 0, c.block_size);
    auto logits = fsdp::call(model, input);
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
    loss_value = loss.item<double>();
    if (s >= o.warmup) {
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      cpu_times.push_back(cpu_seconds() - c0);
    }
  }
  double param_bytes = 0, grad_bytes = 0, optim_bytes = 0;
  for (const auto& p : model->parameters()) {
    param_bytes += p.nbytes();
    if (p.grad().defined()) grad_bytes += p.grad().nbytes();
  }
  for (const auto& item : opt.state()) {
    auto& st = static_cast<torch::optim::AdamWParamState&>(*item.second);
    optim_bytes += st.exp_avg().nbytes() + st.exp_avg_sq().nbytes();
  }
  // Every rank's peak: the table shows the largest.
  double peak = peak_rss_bytes(), base = rss_before;
  if (sharded && world > 1) {
    auto t = at::tensor({peak, base}, at::kDouble);
    fsdp::dist::world_comm()->all_reduce(t, fsdp::comm::ReduceOp::Max);
    peak = t[0].item<double>();
    base = t[1].item<double>();
  }
  if (rank == 0 && !o.result.empty()) {
    std::ofstream out(o.result, std::ios::app);
    out << "step_s " << median(times) << " cpu_s " << median(cpu_times) << " peak " << peak << " base " << base
        << " params " << param_bytes << " grads " << grad_bytes << " optim " << optim_bytes << " n_params " << n_params
        << " world " << world << " loss " << loss_value << "\n";
  }
  if (sharded) fsdp::dist::destroy_distributed();
  return 0;
}

// One configuration in fresh processes (fsdprun for several ranks); returns its result, with the
// exit status in "rc" (the rest empty when it failed).
struct Driver {
  fsdp_bench::WorkerLauncher launcher{"activation_bench"};
  bool glibc_default = false;

  explicit Driver(bool glibc_default_malloc) : glibc_default(glibc_default_malloc) {}

  std::map<std::string, double> run(int nproc, std::vector<std::string> args) {
    const std::string out = launcher.result_path("r");
    std::vector<std::string> cmd = {"--role", "worker", "--result", out};
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
      "activation_bench: GPT %lld layers, d=%lld, %lld heads, seq %lld, batch %lld per rank, float32, "
      "fully_shard in a world of one; %d steps after %d warm-up, %d round(s); peak RSS of a fresh process per row\n",
      static_cast<long long>(o.layers), static_cast<long long>(o.dim), static_cast<long long>(o.heads),
      static_cast<long long>(o.seq), static_cast<long long>(o.batch), o.steps, o.warmup, o.rounds);
  std::fflush(stdout);
  const std::vector<std::string> common = {"--steps",  std::to_string(o.steps),  "--warmup", std::to_string(o.warmup),
                                           "--layers", std::to_string(o.layers), "--dim",    std::to_string(o.dim),
                                           "--heads",  std::to_string(o.heads),  "--seq",    std::to_string(o.seq),
                                           "--batch",  std::to_string(o.batch)};
  // Rounds alternate the configurations (the machine is shared and noisy): per configuration the
  // median over rounds of each run's median step time, and the largest peak.
  std::map<std::string, std::map<std::string, double>> rows;
  std::map<std::string, std::vector<double>> walls, cpus;
  for (int round = 0; round < o.rounds; ++round) {
    for (const std::string ac : {"none", "full", "every:2"}) {
      auto args = common;
      args.insert(args.end(), {"--ac", ac});
      auto r = d.run(1, args);
      if (r["rc"] != 0) usage("the " + ac + " run failed");
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
  const int64_t layers = 14, dim = 768, heads = 12, seq = 512;
  std::printf(
      "activation_bench --fit: GPT %lld layers, d=%lld, %lld heads, seq %lld, 1 sequence per rank, float32, "
      "AdamW; %d steps after %d warm-up; budget %lld MiB per process%s\n",
      static_cast<long long>(layers), static_cast<long long>(dim), static_cast<long long>(heads),
      static_cast<long long>(seq), o.steps, o.warmup, static_cast<long long>(o.budget_mb), " (stated)");
  std::fflush(stdout);
  const std::vector<std::string> common = {"--steps",  std::to_string(o.steps),
                                           "--warmup", std::to_string(o.warmup),
                                           "--layers", std::to_string(layers),
                                           "--dim",    std::to_string(dim),
                                           "--heads",  std::to_string(heads),
                                           "--seq",    std::to_string(seq),
                                           "--batch",  "1"};
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

}  // namespace

int main(int argc, char** argv) {
  fsdp::dist::tune_cpu_or_reexec(argc, argv);
  Options o = parse(argc, argv);
  try {
    if (o.role == "worker") return run_worker(o);
    if (o.role == "driver") return o.fit ? run_fit(o) : run_memory(o);
    usage("unknown --role " + o.role);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "activation_bench: %s\n", e.what());
    return 1;
  }
}
