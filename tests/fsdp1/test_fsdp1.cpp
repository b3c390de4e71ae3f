// FSDP1's API over several ranks: every ShardingStrategy trains the uneven GPT (blocks wrapped by
// transformer_auto_wrap_policy) with one process's losses and parameters; the strategies'
// collectives and memory order as FSDP1's do; no_sync over 4 micro-batches equals one large batch;
// summon_full_params reads, writes back (or not) and gathers on rank 0 only; misuse is refused.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <optional>

#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
using fsdp::models::BlockImpl;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 6;
constexpr int64_t kBatch = 8;  // divisible by 2 and 4
constexpr double kTolerance = 1e-5;

std::string env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

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

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const std::exception& e) {
    TORCH_CHECK(std::string(e.what()).find(needle) != std::string::npos, "error '", e.what(), "' lacks '", needle, "'");
    return;
  }
  TORCH_CHECK(false, "no error; expected one mentioning '", needle, "'");
}

}  // namespace

// STRATEGY: a ShardingStrategy name; NO_SYNC=1: 4 micro-batches per step, the first 3 under
// no_sync(), against one process on the 4 batches concatenated.
FSDP_RANK_WORKER(fsdp1_parity) {
  const auto config = uneven_config();
  const std::string name = env("STRATEGY", "FULL_SHARD");
  const auto strategy = parse_strategy(name);
  const bool no_sync = env("NO_SYNC", "0") == "1";
  const int micro = no_sync ? 4 : 1;
  std::shared_ptr<fsdp::FSDP<GPT>> wrapped;
  std::optional<fsdp::NoSyncGuard> guard;
  ShardedRun run;
  run.shard = [&](GPT& model) { wrapped = std::make_shared<fsdp::FSDP<GPT>>(model, options_for(strategy)); };
  run.forward = [&](GPT&, const at::Tensor& x) { return (*wrapped)(x); };
  if (no_sync) {
    run.before_micro_batch = [&](int m, int total, GPT&) {
      if (m == 0) guard.emplace(wrapped->no_sync());
      if (m == total - 1) guard.reset();
    };
  }
  auto want = no_sync ? train_large_batch(config, kSteps, kBatch, micro) : train_reference(config, kSteps, kBatch, 1);
  const auto before = fsdp::dist::world_comm()->stats().snapshot();
  auto got = train_sharded(config, kSteps, kBatch, micro, run);
  const auto ops = fsdp::dist::world_comm()->stats().snapshot() - before;
  check_losses_match(got.losses, want.losses, kTolerance);
  const double worst = strategy == fsdp::ShardingStrategy::NO_SHARD
                           ? check_full_params_match(got.model, want.parameters, kTolerance)
                           : check_shards_match(got.model, want.parameters, kTolerance);
  // No communication for the no_sync micro-batches: 3 units (2 blocks + root) reduce once a step.
  if (strategy == fsdp::ShardingStrategy::FULL_SHARD || strategy == fsdp::ShardingStrategy::SHARD_GRAD_OP) {
    const auto rs = ops[fsdp::comm::OpKind::ReduceScatter].calls;
    TORCH_CHECK(rs == static_cast<uint64_t>(3 * kSteps), "expected ", 3 * kSteps, " reduce-scatters, got ", rs);
  }
  if (fsdp::dist::rank() == 0) {
    std::cout << name << (no_sync ? " no_sync x4" : "") << " on " << fsdp::dist::world_size() << " ranks: last loss "
              << got.losses.back() << " (one process " << want.losses.back() << "), worst parameter difference "
              << worst << " relative; world comm " << ops.to_string() << std::endl;
  }
}

struct ParityCase {
  std::string strategy;
  int world;
  bool no_sync = false;
};

class Fsdp1Parity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(Fsdp1Parity, MatchesOneProcess) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  o.env["STRATEGY"] = GetParam().strategy;
  o.env["NO_SYNC"] = GetParam().no_sync ? "1" : "0";
  auto r = run_ranks(GetParam().world, "fsdp1_parity", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

INSTANTIATE_TEST_SUITE_P(Strategies, Fsdp1Parity,
                         ::testing::Values(ParityCase{"FULL_SHARD", 2}, ParityCase{"SHARD_GRAD_OP", 2},
                                           ParityCase{"NO_SHARD", 2}, ParityCase{"HYBRID_SHARD", 4},
                                           ParityCase{"HYBRID_SHARD_ZERO2", 4}, ParityCase{"FULL_SHARD", 2, true},
                                           ParityCase{"NO_SHARD", 2, true}),
                         [](const auto& info) {
                           return info.param.strategy + (info.param.no_sync ? "_no_sync" : "") + "_" +
                                  std::to_string(info.param.world) + "ranks";
                         });

// One training step per strategy: collectives as FSDP1 issues them (FULL_SHARD gathers each unit
// but the root again in backward, SHARD_GRAD_OP does not, NO_SHARD only all-reduces), and the
// bytes held at the end of forward (full parameters then + parameters, gradients and AdamW state)
// ordered FULL_SHARD < SHARD_GRAD_OP < NO_SHARD.
FSDP_RANK_WORKER(fsdp1_comm_and_memory) {
  using S = fsdp::ShardingStrategy;
  auto config = uneven_config();
  config.vocab_size = 512;  // the embeddings and head dominate: the root unit's gather shows
  struct Row {
    const char* name;
    uint64_t gathers, reduce_scatters, all_reduces, gather_bytes;
    double held;
  };
  std::vector<Row> rows;
  for (S s : {S::FULL_SHARD, S::SHARD_GRAD_OP, S::NO_SHARD}) {
    auto model = parity_model(config);
    fsdp::FSDP wrapped(model, options_for(s));
    auto opt = parity_optimizer(*model);
    auto data = global_batch(config, 4, 0, 0);
    const auto before = fsdp::dist::world_comm()->stats().snapshot();
    auto logits = wrapped(data.narrow(1, 0, config.block_size));
    const double full_after_forward = static_cast<double>(fsdp::full_parameter_bytes(*model));
    fsdp::models::gpt_loss(logits, data.narrow(1, 1, config.block_size)).backward();
    opt.step();
    const auto ops = fsdp::dist::world_comm()->stats().snapshot() - before;
    const char* names[] = {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"};
    rows.push_back({names[rows.size()], ops[fsdp::comm::OpKind::AllGather].calls,
                    ops[fsdp::comm::OpKind::ReduceScatter].calls, ops[fsdp::comm::OpKind::AllReduce].calls,
                    ops[fsdp::comm::OpKind::AllGather].bytes_sent,
                    full_after_forward + training_state_bytes(*model, opt)});
  }
  const Row &full = rows[0], &grad_op = rows[1], &none = rows[2];
  TORCH_CHECK(full.gathers == 5 && full.reduce_scatters == 3, "FULL_SHARD: ", full.gathers, " all-gathers, ",
              full.reduce_scatters, " reduce-scatters (want 3 + 2 and 3)");
  TORCH_CHECK(grad_op.gathers == 3 && grad_op.reduce_scatters == 3, "SHARD_GRAD_OP: ", grad_op.gathers,
              " all-gathers, ", grad_op.reduce_scatters, " reduce-scatters (want 3 and 3)");
  TORCH_CHECK(none.gathers == 0 && none.reduce_scatters == 0 && none.all_reduces > 0, "NO_SHARD: ", none.gathers,
              " all-gathers, ", none.reduce_scatters, " reduce-scatters, ", none.all_reduces, " all-reduces");
  TORCH_CHECK(full.gather_bytes > grad_op.gather_bytes, "FULL_SHARD should gather more bytes than SHARD_GRAD_OP");
  TORCH_CHECK(full.held < grad_op.held && grad_op.held < none.held, "held bytes not ordered: FULL_SHARD ", full.held,
              ", SHARD_GRAD_OP ", grad_op.held, ", NO_SHARD ", none.held);
  if (fsdp::dist::rank() == 0) {
    for (const auto& r : rows) {
      std::cout << r.name << ": " << r.gathers << " all-gathers (" << r.gather_bytes << " bytes sent), "
                << r.reduce_scatters << " reduce-scatters, " << r.all_reduces << " all-reduces; held at end of forward "
                << r.held << " bytes" << std::endl;
    }
  }
}

TEST(Fsdp1, CollectivesAndMemoryOrderAsFsdp1) {
  auto r = run_ranks(2, "fsdp1_comm_and_memory");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
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
