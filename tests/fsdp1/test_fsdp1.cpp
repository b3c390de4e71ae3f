// FSDP1's API over several ranks: every ShardingStrategy trains the uneven GPT (blocks wrapped by
// transformer_auto_wrap_policy) with one process's losses and parameters at 2 and 4 ranks, and
// sends exactly FSDP1's bytes per step (a formula from the parameter shapes); the real peak RSS of
// the rank processes orders FULL_SHARD < SHARD_GRAD_OP < NO_SHARD; CPU offload trains the same;
// no_sync over 4 micro-batches equals one large batch; summon_full_params reads, writes back (or
// not) and gathers on rank 0 only; misuse is refused.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <sstream>

#include "cpu_layout.h"
#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using fsdp::models::BlockImpl;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 6;
constexpr int64_t kBatch = 8;  // divisible by 2 and 4
constexpr double kTolerance = 1e-5;

fsdp::ShardingStrategy parse_strategy(const std::string& s) {
  using S = fsdp::ShardingStrategy;
  if (s == "FULL_SHARD") return S::FULL_SHARD;
  if (s == "SHARD_GRAD_OP") return S::SHARD_GRAD_OP;
  if (s == "NO_SHARD") return S::NO_SHARD;
  if (s == "HYBRID_SHARD") return S::HYBRID_SHARD;
  if (s == "HYBRID_SHARD_ZERO2") return S::HYBRID_SHARD_ZERO2;
  TORCH_CHECK(false, "unknown STRATEGY ", s);
}

fsdp::FSDPOptions options_for(fsdp::ShardingStrategy s) {
  fsdp::FSDPOptions o;
  o.sharding_strategy = s;
  o.auto_wrap_policy = fsdp::transformer_auto_wrap_policy<BlockImpl>();
  if (s == fsdp::ShardingStrategy::HYBRID_SHARD || s == fsdp::ShardingStrategy::HYBRID_SHARD_ZERO2) {
    o.device_mesh = fsdp::init_device_mesh({2, fsdp::dist::world_size() / 2}, {"replicate", "shard"});
  }
  return o;
}

// One process, each step's `micro` batches concatenated into one large batch.
TrainResult train_large_batch(const fsdp::models::GPTConfig& c, int steps, int64_t batch, int micro) {
  auto model = parity_model(c);
  auto opt = parity_optimizer(*model);
  TrainResult r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    std::vector<at::Tensor> parts;
    for (int m = 0; m < micro; ++m) parts.push_back(global_batch(c, batch, s, m));
    auto data = at::cat(parts, 0);
    auto loss =
        fsdp::models::gpt_loss(model->forward(data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& p : model->named_parameters()) r.parameters[p.key()] = p.value().detach().clone();
  return r;
}

}  // namespace

namespace {

const char* strategy_name(fsdp::ShardingStrategy s) {
  using S = fsdp::ShardingStrategy;
  switch (s) {
    case S::FULL_SHARD: return "FULL_SHARD";
    case S::SHARD_GRAD_OP: return "SHARD_GRAD_OP";
    case S::NO_SHARD: return "NO_SHARD";
    case S::HYBRID_SHARD: return "HYBRID_SHARD";
    case S::HYBRID_SHARD_ZERO2: return "HYBRID_SHARD_ZERO2";
  }
  return "?";
}

bool hybrid(fsdp::ShardingStrategy s) {
  return s == fsdp::ShardingStrategy::HYBRID_SHARD || s == fsdp::ShardingStrategy::HYBRID_SHARD_ZERO2;
}

// Bytes one rank sends in one training step (forward, backward, optimizer step) under FSDP1's
// schedule for `s`, from the parameter shapes alone: the units are the blocks (the transformer
// policy) and the root (everything else). A parameter of R rows of W elements is sharded over S
// ranks as ceil(R / S) rows each (the last ones padded), so a unit's all-gather output and
// reduce-scatter input are S * sum(ceil(R / S) * W) floats, of which a ring sends (S - 1) / S
// (fsdp/debug/comm_stats.h's convention); an all-reduce of B bytes over N ranks sends 2 (N - 1) / N B.
//   FULL_SHARD, HYBRID_SHARD:        all-gather every unit in forward, every unit but the root
//                                    again in backward (FSDP1's root keeps its parameters), one
//                                    reduce-scatter per unit
//   SHARD_GRAD_OP, HYBRID_..._ZERO2: one all-gather and one reduce-scatter per unit
//   HYBRID_*:                        those within the shard group of S, then each unit's reduced
//                                    shard all-reduced over the R replicas
//   NO_SHARD:                        one all-reduce of every gradient (DDP's buckets, no padding)
struct StepTraffic {
  uint64_t gather_calls = 0, gather_bytes = 0;
  uint64_t reduce_scatter_calls = 0, reduce_scatter_bytes = 0;
  uint64_t all_reduce_bytes = 0;  // calls: one per unit (HYBRID), one per bucket (NO_SHARD)
  uint64_t total() const { return gather_bytes + reduce_scatter_bytes + all_reduce_bytes; }
};

StepTraffic fsdp1_formula(const fsdp::models::GPTConfig& c, fsdp::ShardingStrategy s, int world) {
  using S = fsdp::ShardingStrategy;
  auto model = parity_model(c);  // unsharded: only the shapes are read
  constexpr uint64_t kFloat = 4;
  // Each unit's parameters as (rows, elements per row); the root unit last.
  std::vector<std::vector<std::pair<int64_t, int64_t>>> units;
  std::set<const c10::TensorImpl*> in_blocks;
  for (auto& block : model->blocks) {
    units.emplace_back();
    for (const auto& p : block->parameters()) {
      units.back().emplace_back(p.size(0), p.numel() / p.size(0));
      in_blocks.insert(p.unsafeGetTensorImpl());
    }
  }
  units.emplace_back();
  uint64_t all_numel = 0;
  for (const auto& p : model->parameters()) {
    all_numel += static_cast<uint64_t>(p.numel());
    if (!in_blocks.count(p.unsafeGetTensorImpl())) units.back().emplace_back(p.size(0), p.numel() / p.size(0));
  }
  StepTraffic t;
  if (s == S::NO_SHARD) {
    t.all_reduce_bytes = 2 * kFloat * all_numel * static_cast<uint64_t>(world - 1) / static_cast<uint64_t>(world);
    return t;
  }
  const uint64_t replicas = hybrid(s) ? 2 : 1, shard = static_cast<uint64_t>(world) / replicas;
  const bool regather = s == S::FULL_SHARD || s == S::HYBRID_SHARD;
  for (size_t u = 0; u < units.size(); ++u) {
    uint64_t shard_numel = 0;  // one rank's padded shard of the unit
    for (const auto& [rows, width] : units[u]) {
      shard_numel += static_cast<uint64_t>((rows + static_cast<int64_t>(shard) - 1) / static_cast<int64_t>(shard)) *
                     static_cast<uint64_t>(width);
    }
    const uint64_t ring = (shard - 1) * shard_numel * kFloat;  // (S - 1) / S of S shards
    const bool root = u + 1 == units.size();
    const int gathers = regather && !root ? 2 : 1;
    t.gather_calls += static_cast<uint64_t>(gathers);
    t.gather_bytes += static_cast<uint64_t>(gathers) * ring;
    t.reduce_scatter_calls += 1;
    t.reduce_scatter_bytes += ring;
    t.all_reduce_bytes += 2 * (replicas - 1) * shard_numel * kFloat / replicas;
  }
  return t;
}

// Every rank's traffic in the second of two training steps (the first may set things up).
// FSDP1's formula counts its flat parameter's padded messages: measured in the flat layout.
StepTraffic measure_step(const fsdp::models::GPTConfig& c, fsdp::ShardingStrategy s) {
  const fsdp::testing::FlatCpuCollectives flat;
  auto model = parity_model(c);
  fsdp::FSDP wrapped(model, options_for(s));
  auto opt = parity_optimizer(*model);
  const int n = fsdp::dist::world_size(), rank = fsdp::dist::rank();
  fsdp::comm::CommStatsSnapshot ops;
  for (int step = 0; step < 2; ++step) {
    const auto before = fsdp::comm::process_comm_stats().snapshot();
    auto data = global_batch(c, kBatch, step, 0).narrow(0, rank * (kBatch / n), kBatch / n);
    opt.zero_grad();
    fsdp::models::gpt_loss(wrapped(data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size)).backward();
    opt.step();
    ops = fsdp::comm::process_comm_stats().snapshot() - before;
  }
  using K = fsdp::comm::OpKind;
  TORCH_CHECK(ops[K::Broadcast].calls == 0 && ops[K::AllToAll].calls == 0 && ops[K::Barrier].calls == 0,
              strategy_name(s), ": unexpected collectives in a step: ", ops.to_string());
  StepTraffic t;
  t.gather_calls = ops[K::AllGather].calls;
  t.gather_bytes = ops[K::AllGather].bytes_sent;
  t.reduce_scatter_calls = ops[K::ReduceScatter].calls;
  t.reduce_scatter_bytes = ops[K::ReduceScatter].bytes_sent;
  t.all_reduce_bytes = ops[K::AllReduce].bytes_sent;
  TORCH_CHECK(t.total() == ops.total_bytes(), strategy_name(s), ": bytes outside the three kinds: ", ops.to_string());
  return t;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == sep) {
      out.push_back(cur), cur.clear();
    } else {
      cur += ch;
    }
  }
  out.push_back(cur);
  return out;
}

}  // namespace

// STRATEGIES: ShardingStrategy names, comma-separated, each optionally "+cpu_offload" or
// "+comm_hook" (register_comm_hook with FSDP1's reduce_scatter_hook: one call per unit and step,
// a second registration and NO_SHARD refused); every one
// trains kSteps steps against one process (losses and parameters within 1e-5), and sends exactly
// fsdp1_formula's bytes per step. NO_SYNC=1: 4 micro-batches per step, the first 3 under
// no_sync(), against one process on the 4 batches concatenated (no byte check).
FSDP_RANK_WORKER(fsdp1_parity) {
  const auto config = uneven_config();
  const bool no_sync = env("NO_SYNC", "0") == "1";
  const int micro = no_sync ? 4 : 1, world = fsdp::dist::world_size();
  const auto want = no_sync ? train_large_batch(config, kSteps, kBatch, micro)
                            : train_reference(config, kSteps, kBatch, 1);  // shared by the strategies
  std::ostringstream report;
  for (const std::string& item : split(env("STRATEGIES", "FULL_SHARD"), ',')) {
    const auto parts = split(item, '+');
    const auto strategy = parse_strategy(parts[0]);
    const bool offload = parts.size() > 1 && parts[1] == "cpu_offload";
    const bool comm_hook = parts.size() > 1 && parts[1] == "comm_hook";
    TORCH_CHECK(parts.size() == 1 || offload || comm_hook, "unknown variant in ", item);
    int64_t hook_calls = 0;
    std::shared_ptr<fsdp::FSDP<GPT>> wrapped;
    std::optional<fsdp::NoSyncGuard> guard;
    ShardedRun run;
    run.shard = [&](GPT& model) {
      auto o = options_for(strategy);
      if (offload) o.cpu_offload = fsdp::CPUOffload{.offload_params = true};
      wrapped = std::make_shared<fsdp::FSDP<GPT>>(model, o);
      if (!comm_hook) return;
      // FSDP1's reduce_scatter_hook: a sum over the group, then the divide.
      const auto hook = [&hook_calls](const at::Tensor& grad, const at::Tensor& output, fsdp::comm::Comm& group) {
        ++hook_calls;
        TORCH_CHECK(grad.numel() == output.numel() * group.size(), "grad ", grad.numel(), " vs output ",
                    output.numel());
        group.reduce_scatter_tensor(output, grad, fsdp::comm::ReduceOp::Sum);
        output.div_(group.size());
      };
      wrapped->register_comm_hook(hook);
      try {
        wrapped->register_comm_hook(hook);
        TORCH_CHECK(false, "a second comm hook was accepted");
      } catch (const std::logic_error& e) {
        TORCH_CHECK(std::string(e.what()).find("already registered") != std::string::npos, e.what());
      }
    };
    run.forward = [&](GPT&, const at::Tensor& x) { return (*wrapped)(x); };
    if (no_sync) {
      run.before_micro_batch = [&](int m, int total, GPT&) {
        if (m == 0) guard.emplace(wrapped->no_sync());
        if (m == total - 1) guard.reset();
      };
    }
    const auto before = fsdp::comm::process_comm_stats().snapshot();
    auto got = train_sharded(config, kSteps, kBatch, micro, run);
    const auto ops = fsdp::comm::process_comm_stats().snapshot() - before;
    check_losses_match(got.losses, want.losses, kTolerance);
    const double worst = strategy == fsdp::ShardingStrategy::NO_SHARD
                             ? check_full_params_match(got.model, want.parameters, kTolerance)
                             : check_shards_match(got.model, want.parameters, kTolerance);
    if (comm_hook) {
      const int64_t units = config.n_layer + 1;
      TORCH_CHECK(hook_calls == units * kSteps, item, ": the comm hook ran ", hook_calls, " times; expected ",
                  units * kSteps);
      GPT other = parity_model(config);
      fsdp::FSDP<GPT> replicated(other, options_for(fsdp::ShardingStrategy::NO_SHARD));
      try {
        replicated.register_comm_hook([](const at::Tensor&, const at::Tensor&, fsdp::comm::Comm&) {});
        TORCH_CHECK(false, "a comm hook on NO_SHARD was accepted");
      } catch (const std::invalid_argument& e) {
        TORCH_CHECK(std::string(e.what()).find("not offered for NO_SHARD") != std::string::npos, e.what());
      }
    }
    if (offload) {
      for (const auto& p : got.model->parameters()) {
        TORCH_CHECK(p.is_cpu() && p.grad().is_cpu(), item, ": a shard or its gradient is off the CPU");
      }
    }
    report << item << (no_sync ? " no_sync x4" : "") << " on " << world << " ranks: last loss " << got.losses.back()
           << " (one process " << want.losses.back() << "), worst parameter difference " << worst << " relative";
    if (no_sync) {
      // No communication for the no_sync micro-batches: each unit reduces once a step.
      const uint64_t units = strategy == fsdp::ShardingStrategy::NO_SHARD ? 0 : config.n_layer + 1;
      const auto rs = ops[fsdp::comm::OpKind::ReduceScatter].calls;
      TORCH_CHECK(rs == units * kSteps, item, ": expected ", units * kSteps, " reduce-scatters, got ", rs);
      report << "; " << rs << " reduce-scatters in " << kSteps << " steps\n";
      continue;
    }
    const StepTraffic formula = fsdp1_formula(config, strategy, world), got_bytes = measure_step(config, strategy);
    TORCH_CHECK(got_bytes.gather_bytes == formula.gather_bytes && got_bytes.gather_calls == formula.gather_calls &&
                    got_bytes.reduce_scatter_bytes == formula.reduce_scatter_bytes &&
                    got_bytes.reduce_scatter_calls == formula.reduce_scatter_calls &&
                    got_bytes.all_reduce_bytes == formula.all_reduce_bytes,
                item, " on ", world, " ranks: a step sent all-gather ", got_bytes.gather_calls, "x/",
                got_bytes.gather_bytes, " B, reduce-scatter ", got_bytes.reduce_scatter_calls, "x/",
                got_bytes.reduce_scatter_bytes, " B, all-reduce ", got_bytes.all_reduce_bytes,
                " B; FSDP1's formula: all-gather ", formula.gather_calls, "x/", formula.gather_bytes,
                " B, reduce-scatter ", formula.reduce_scatter_calls, "x/", formula.reduce_scatter_bytes,
                " B, all-reduce ", formula.all_reduce_bytes, " B");
    report << "; bytes sent per step " << got_bytes.total() << " = formula (all-gather " << formula.gather_calls << "x "
           << formula.gather_bytes << " + reduce-scatter " << formula.reduce_scatter_calls << "x "
           << formula.reduce_scatter_bytes << " + all-reduce " << formula.all_reduce_bytes << ")\n";
  }
  if (fsdp::dist::rank() == 0) std::cout << report.str() << std::flush;
}

struct ParityCase {
  int world;
  std::string strategies;
  bool no_sync = false;
};

class Fsdp1Parity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(Fsdp1Parity, MatchesOneProcess) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  o.env["STRATEGIES"] = GetParam().strategies;
  o.env["NO_SYNC"] = GetParam().no_sync ? "1" : "0";
  auto r = run_ranks(GetParam().world, "fsdp1_parity", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

// One launch per world size trains every strategy (HYBRID_*: 2 replicas of world / 2 ranks).
const char* const kAll = "FULL_SHARD,SHARD_GRAD_OP,NO_SHARD,HYBRID_SHARD,HYBRID_SHARD_ZERO2";
INSTANTIATE_TEST_SUITE_P(Strategies, Fsdp1Parity,
                         ::testing::Values(ParityCase{2, std::string(kAll) +
                                                             ",FULL_SHARD+cpu_offload,SHARD_GRAD_OP+comm_hook"},
                                           ParityCase{4, kAll}, ParityCase{2, "FULL_SHARD,NO_SHARD", true}),
                         [](const auto& info) {
                           return std::string(info.param.no_sync ? "no_sync_" : "every_strategy_") +
                                  std::to_string(info.param.world) + "ranks";
                         });

namespace {

// This process's resident set from /proc/self/status: "VmRSS" now or "VmHWM", its peak.
int64_t status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;  // kB
  }
  TORCH_CHECK(false, "no ", field, " in /proc/self/status");
}

// Six wide blocks and a small vocabulary: parameters, gradients and AdamW's state (18.9M
// parameters, 303 MB unsharded) dwarf the activations of 2 sequences of 16 tokens.
fsdp::models::GPTConfig state_dominated_config() {
  fsdp::models::GPTConfig c;
  c.vocab_size = 64;
  c.block_size = 16;
  c.n_layer = 6;
  c.n_head = 4;
  c.n_embd = 512;
  c.device = torch::kMeta;  // nothing allocated before sharding: only shards get memory
  return c;
}

}  // namespace

// STRATEGY trains the state-dominated GPT for 2 steps (built on meta, initialised through
// param_init_fn) and prints this rank's real peak RSS growth: VmHWM at the end minus VmRSS when
// the worker started.
FSDP_RANK_WORKER(fsdp1_peak_rss) {
  const int64_t start_rss = status_bytes("VmRSS");
  const auto strategy = parse_strategy(env("STRATEGY", "FULL_SHARD"));
  const auto config = state_dominated_config();
  GPT model(config);
  auto o = options_for(strategy);
  o.param_init_fn = [](torch::nn::Module& m) { dynamic_cast<fsdp::models::GPTImpl&>(m).reset_parameters(); };
  fsdp::FSDP wrapped(model, o);
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  const int rank = fsdp::dist::rank();
  for (int step = 0; step < 2; ++step) {  // the peak: the second backward, AdamW's state allocated
    auto data = global_batch(config, 2, step, rank);
    opt.zero_grad();
    fsdp::models::gpt_loss(wrapped(data.narrow(1, 0, config.block_size)), data.narrow(1, 1, config.block_size))
        .backward();
    opt.step();
  }
  std::cout << "rank " << rank << " peak_rss_growth=" << status_bytes("VmHWM") - start_rss
            << " state_bytes=" << static_cast<int64_t>(training_state_bytes(*model, opt)) << std::endl;
}

// Peak RSS, measured in each rank process, orders FULL_SHARD < SHARD_GRAD_OP < NO_SHARD (one
// launch per strategy: a process's peak never comes down).
TEST(Fsdp1, PeakRssOrdersAsFsdp1) {
  struct Row {
    std::string strategy;
    int64_t growth = 0, state = 0;  // the larger of the two ranks'
  };
  std::vector<Row> rows;
  for (const char* s : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    RanksOptions o;
    o.timeout = std::chrono::milliseconds(120000);
    o.env["STRATEGY"] = s;
    auto r = run_ranks(2, "fsdp1_peak_rss", o);
    ASSERT_TRUE(r.all_ok()) << r.report();
    Row row{s};
    for (const auto& rank : r.ranks) {
      const auto at = rank.output.find("peak_rss_growth="), st = rank.output.find("state_bytes=");
      ASSERT_NE(at, std::string::npos) << rank.output;
      row.growth = std::max<int64_t>(row.growth, std::stoll(rank.output.substr(at + 16)));
      row.state = std::max<int64_t>(row.state, std::stoll(rank.output.substr(st + 12)));
    }
    std::cout << s << ": peak RSS growth " << row.growth / 1e6 << " MB (parameters + gradients + AdamW state "
              << row.state / 1e6 << " MB)" << std::endl;
    rows.push_back(row);
  }
  EXPECT_LT(rows[0].growth, rows[1].growth) << "FULL_SHARD's peak RSS should be below SHARD_GRAD_OP's";
  EXPECT_LT(rows[1].growth, rows[2].growth) << "SHARD_GRAD_OP's peak RSS should be below NO_SHARD's";
}

namespace {
// A module whose forward (wrongly) summons its own parameters.
struct SummonInForwardImpl : torch::nn::Module {
  SummonInForwardImpl() { lin = register_module("lin", torch::nn::Linear(4, 4)); }
  at::Tensor forward(const at::Tensor& x) {
    auto full = fsdp::summon_full_params(*this);
    return lin(x);
  }
  torch::nn::Linear lin{nullptr};
};
TORCH_MODULE(SummonInForward);
}  // namespace

FSDP_RANK_WORKER(fsdp1_summon) {
  const auto config = uneven_config();
  const int rank = fsdp::dist::rank();
  auto reference = parity_model(config);  // the same initial values, unsharded
  auto model = parity_model(config);
  fsdp::FSDP wrapped(model, options_for(fsdp::ShardingStrategy::FULL_SHARD));
  int64_t total_bytes = 0;
  for (const auto& p : reference->parameters()) total_bytes += static_cast<int64_t>(p.nbytes());
  auto tokens = global_batch(config, 2, 0, 0).narrow(1, 0, config.block_size);
  at::Tensor head_shard = model->lm_head->named_parameters()["weight"];
  const auto info = *fsdp::shard_info(head_shard);

  // Reading: every parameter full, with the original names and values.
  TORCH_CHECK(fsdp::full_parameter_bytes(*model) == 0, "parameters gathered before summon");
  {
    auto full = wrapped.summon_full_params(/*writeback=*/false);
    TORCH_CHECK(fsdp::full_parameter_bytes(*model) == total_bytes, "not every parameter gathered");
    size_t n = 0;
    for (const auto& item : reference->named_parameters()) {
      TORCH_CHECK(at::equal(full.parameter(item.key()), item.value()), item.key(), ": summoned value differs");
      ++n;
    }
    TORCH_CHECK(n == full.named_parameters().size(), "named_parameters() count");
    TORCH_CHECK(model->lm_head->weight.sizes() == reference->lm_head->weight.sizes(), "field not full");
    // Misuse while it lives: nested, forward inside.
    expect_error([&] { auto inner = fsdp::summon_full_params(*model->blocks[0], false); }, "nested over");
    expect_error([&] { wrapped(tokens); }, "forward inside summon_full_params");
    // writeback=false: edits are dropped.
    torch::NoGradGuard no_grad;
    model->lm_head->weight.fill_(7.0);
  }
  TORCH_CHECK(fsdp::full_parameter_bytes(*model) == 0, "summon left parameters gathered");
  TORCH_CHECK(at::equal(head_shard, reference->lm_head->weight.narrow(0, info.dim0_offset, info.local_rows)),
              "writeback=false changed the shard");

  // Writeback: the edit reaches every rank's shard and the next forward.
  {
    auto full = fsdp::summon_full_params(*model);
    torch::NoGradGuard no_grad;
    model->lm_head->weight.mul_(2.0);
  }
  {
    torch::NoGradGuard no_grad;
    reference->lm_head->weight.mul_(2.0);
  }
  TORCH_CHECK(at::equal(head_shard, reference->lm_head->weight.narrow(0, info.dim0_offset, info.local_rows)),
              "writeback did not reach the shard");
  auto out = wrapped(tokens);
  TORCH_CHECK(at::allclose(out, reference(tokens), 1e-5, 1e-6), "the next forward misses the edit");
  out.sum().backward();  // the root keeps its parameters from forward until backward
  TORCH_CHECK(fsdp::full_parameter_bytes(*model) == 0, "backward left parameters gathered");

  // rank0_only: rank 0 holds the full parameters, the others their shards.
  {
    auto full = wrapped.summon_full_params(/*writeback=*/false, /*rank0_only=*/true);
    const int64_t held = fsdp::full_parameter_bytes(*model);
    at::Tensor head = full.parameter("lm_head.weight");
    if (rank == 0) {
      TORCH_CHECK(held == total_bytes && at::equal(head, reference->lm_head->weight), "rank 0 lacks the full values");
    } else {
      TORCH_CHECK(held == 0 && head.size(0) == info.local_rows, "rank ", rank, " holds full parameters");
    }
  }
  expect_error([&] { auto g = wrapped.summon_full_params(/*writeback=*/true, /*rank0_only=*/true); },
               "rank0_only with writeback");

  // During forward: a module that summons inside its own forward.
  SummonInForward inner;
  fsdp::FSDP w2(inner, fsdp::FSDPOptions{});
  expect_error([&] { w2(at::ones({2, 4})); }, "called during forward");
  // And the model still trains afterwards.
  fsdp::models::gpt_loss(wrapped(tokens), global_batch(config, 2, 0, 0).narrow(1, 1, config.block_size)).backward();
  if (rank == 0)
    std::cout << "summon_full_params: read, writeback, writeback=false, rank0_only, misuse: ok" << std::endl;
}

TEST(Fsdp1, SummonFullParams) {
  auto r = run_ranks(2, "fsdp1_summon");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

// State dicts through state_dict_type: FULL (rank 0 only) equals the one-process model; SHARDED
// round-trips into a fresh wrapper; the optimizer's likewise.
FSDP_RANK_WORKER(fsdp1_state_dict) {
  const auto config = uneven_config();
  auto reference = parity_model(config);
  auto model = parity_model(config);
  fsdp::FSDP wrapped(model, options_for(fsdp::ShardingStrategy::FULL_SHARD));
  auto opt = parity_optimizer(*model);
  auto data = global_batch(config, 4, 0, 0);
  fsdp::models::gpt_loss(wrapped(data.narrow(1, 0, config.block_size)), data.narrow(1, 1, config.block_size))
      .backward();
  opt.step();
  {
    fsdp::StateDictTypeGuard type(wrapped, fsdp::StateDictType::FULL_STATE_DICT, {.rank0_only = true});
    auto sd = wrapped.state_dict();
    auto summoned = wrapped.summon_full_params(false);
    if (fsdp::dist::rank() == 0) {
      for (const auto& item : reference->named_parameters()) {
        TORCH_CHECK(sd.count(item.key()), item.key(), " missing from the full dict");
        TORCH_CHECK(at::equal(sd.at(item.key()), summoned.parameter(item.key())), item.key(), ": full dict value");
      }
    } else {
      TORCH_CHECK(sd.empty(), "rank0_only: other ranks get an empty dict");
    }
  }
  TORCH_CHECK(wrapped.state_dict_type() == fsdp::StateDictType::FULL_STATE_DICT, "guard did not restore");
  wrapped.set_state_dict_type(fsdp::StateDictType::SHARDED_STATE_DICT);
  auto sd = wrapped.state_dict();
  auto osd = fsdp::optim_state_dict(wrapped, opt);
  auto model2 = parity_model(config);
  fsdp::FSDP wrapped2(model2, options_for(fsdp::ShardingStrategy::FULL_SHARD));
  wrapped2.set_state_dict_type(fsdp::StateDictType::SHARDED_STATE_DICT);
  auto opt2 = parity_optimizer(*model2);
  auto r = wrapped2.load_state_dict(sd);
  TORCH_CHECK(r.missing_keys.empty() && r.unexpected_keys.empty(), "sharded load keys");
  fsdp::optim_state_dict_to_load(wrapped2, opt2, osd);
  auto next = global_batch(config, 4, 1, 0);
  for (auto* w : {&wrapped, &wrapped2}) {
    auto& o = w == &wrapped ? opt : opt2;
    o.zero_grad();
    fsdp::models::gpt_loss((*w)(next.narrow(1, 0, config.block_size)), next.narrow(1, 1, config.block_size)).backward();
    o.step();
  }
  auto a = model->named_parameters(), b = model2->named_parameters();
  for (const auto& item : a) TORCH_CHECK(at::equal(item.value(), b[item.key()]), item.key(), ": resumed step differs");
  if (fsdp::dist::rank() == 0)
    std::cout << "state dicts: FULL rank0_only, SHARDED round trip with optimizer: ok" << std::endl;
}

TEST(Fsdp1, StateDictTypes) {
  auto r = run_ranks(2, "fsdp1_state_dict");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}
