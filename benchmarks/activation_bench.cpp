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

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "bench_support.h"

namespace {

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
  fsdp_bench::Args args(
      "activation_bench",
      "usage: activation_bench [--steps N] [--warmup N] [--layers N] [--dim N] [--heads N] [--seq N] [--batch N] "
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
      "activation_bench: %s, batch %lld per rank, float32, fully_shard in a world of one; %d steps after %d "
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
      "activation_bench --fit: %s, 1 sequence per rank, float32, AdamW; %d steps after %d warm-up; budget %lld MiB "
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

}  // namespace

int main(int argc, char** argv) {
  return fsdp_bench::run_main(argc, argv, parse, [](const Options& o) {
    if (o.role == "worker") return run_worker(o);
    return o.fit ? run_fit(o) : run_memory(o);
  });
}
