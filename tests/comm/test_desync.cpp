// Collective desync detection (TORCH_DISTRIBUTED_DEBUG=DETAIL), with real processes:
// two ranks whose fully_shard GPTs differ in width fail at once (not at the 120 s collective
// timeout) naming the operation, its sequence number and both ranks' calls; equal models train to
// the same losses with and without the check; a mismatched operation or dtype is named; off by
// default; a bad value of the variable is refused in one line.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <regex>
#include <sstream>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "multiprocess.h"
#include "test_helpers.h"

using fsdp::comm::ReduceOp;
using fsdp::testing::RanksOptions;

namespace {

constexpr int kSteps = 4;

// A tiny GPT, sharded block by block then the root; its width is n_embd.
fsdp::models::GPT sharded_gpt(int64_t n_embd) {
  fsdp::models::GPTConfig cfg;
  cfg.vocab_size = 64;
  cfg.block_size = 16;
  cfg.n_layer = 2;
  cfg.n_head = 2;
  cfg.n_embd = n_embd;
  cfg.init_seed = 7;
  fsdp::models::GPT model(cfg);
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  return model;
}

// kSteps of SGD on a fixed global batch (rank r trains rows [2r, 2r+2)); returns rank 0's view of
// the global mean loss of each step.
std::vector<double> train(fsdp::models::GPT& model) {
  auto world = fsdp::dist::world_comm();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  at::Tensor batch = at::randint(0, 64, {2 * world->size(), 17}, gen, at::kLong);
  at::Tensor mine = batch.narrow(0, 2 * world->rank(), 2);
  std::vector<double> losses;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto logits = fsdp::call(model, mine.narrow(1, 0, 16));
    auto loss = fsdp::models::gpt_loss(logits, mine.narrow(1, 1, 16));
    loss.backward();
    opt.step();
    at::Tensor global = loss.detach().clone();
    world->all_reduce(global, ReduceOp::Avg);
    losses.push_back(global.item<double>());
  }
  return losses;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Runs `fn`, which must throw CommError naming every needle; prints the message (for the test
// runner) and checks it came well before the collective timeout.
void expect_desync(const std::function<void()>& fn, const std::vector<std::string>& needles) {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    fn();
  } catch (const fsdp::comm::CommError& e) {
    const double took = seconds_since(t0);
    const std::string what = e.what();
    std::cout << "DESYNC_MESSAGE " << what << "\nDESYNC_SECONDS " << took << std::endl;
    for (const auto& n : needles) TORCH_CHECK(what.find(n) != std::string::npos, "message lacks '", n, "': ", what);
    TORCH_CHECK(took < 30.0, "the desync was reported after ", took, " s: the check did not fire before the timeout");
    return;
  }
  TORCH_CHECK(false, "expected a collective desync error, but the collectives ran");
}

const std::map<std::string, std::string> kDetail = {{"TORCH_DISTRIBUTED_DEBUG", "DETAIL"},
                                                    {"FSDP_COLLECTIVE_TIMEOUT_S", "120"}};

RanksOptions with_env(std::map<std::string, std::string> env) {
  RanksOptions o;
  o.env = std::move(env);
  o.timeout = std::chrono::milliseconds(240000);
  return o;
}

// The text after `key ` on the rank's output line.
std::string line_after(const std::string& output, const std::string& key) {
  auto at = output.find(key + " ");
  if (at == std::string::npos) return "";
  auto end = output.find('\n', at);
  return output.substr(at + key.size() + 1, end == std::string::npos ? std::string::npos : end - at - key.size() - 1);
}

}  // namespace

// Rank r builds a GPT of width 16 + 8r and trains: the first all-gather already differs.
FSDP_RANK_WORKER(desync_model_sizes) {
  const int r = fsdp::dist::rank();
  TORCH_CHECK(fsdp::comm::desync_detection_enabled(), "TORCH_DISTRIBUTED_DEBUG=DETAIL did not turn the check on");
  const auto t0 = std::chrono::steady_clock::now();
  auto model = sharded_gpt(16 + 8 * r);
  try {
    train(model);
  } catch (const fsdp::comm::CommError& e) {
    std::cout << "DESYNC_SECONDS " << seconds_since(t0) << std::endl;
    throw;  // as a real program would: the rank fails with the message
  }
  std::cout << "no desync detected" << std::endl;
}

// Same model on every rank: prints the losses and what the checks and the collectives cost.
FSDP_RANK_WORKER(equal_models_train) {
  auto model = sharded_gpt(16);
  auto losses = train(model);
  auto world = fsdp::dist::world_comm();
  const auto counters = fsdp::comm::desync_check_counters();
  std::ostringstream os;
  os << std::setprecision(17);
  for (double l : losses) os << l << ' ';
  std::cout << "LOSSES " << os.str() << "\nBYTES " << world->stats().snapshot().total_bytes() << "\nSEQ "
            << world->seq() << "\nCHECKS " << counters.checks << "\nCHECK_BYTES " << counters.bytes_sent << std::endl;
  if (fsdp::comm::desync_detection_enabled()) {
    // Every collective of the world group was checked, each with one 192-byte fingerprint.
    TORCH_CHECK(counters.checks == world->seq(), "checks ", counters.checks, " != collectives ", world->seq());
    TORCH_CHECK(counters.bytes_sent == counters.checks * 192, "check bytes ", counters.bytes_sent);
  } else {
    TORCH_CHECK(counters.checks == 0 && counters.bytes_sent == 0, "checks ran while TORCH_DISTRIBUTED_DEBUG is off");
  }
}

// Rank 0 all_reduce, rank 1 broadcast of the same tensor.
FSDP_RANK_WORKER(desync_op_kind) {
  auto world = fsdp::dist::world_comm();
  at::Tensor t = at::ones({4});
  world->all_reduce(t);  // sequence number 1 matches
  expect_desync(
      [&] {
        if (world->rank() == 0)
          world->all_reduce(t);
        else
          world->broadcast(t, 0);
      },
      {"collective desync in group 'world' at sequence number 2: ", "rank 0 called all_reduce float32 [4] sum",
       "rank 1 called broadcast float32 [4] root 0"});
  // After a detected desync the group is still usable: nothing was sent.
  world->all_reduce(t);
  TORCH_CHECK(t.eq(4).all().item<bool>(), "the group is unusable after a detected desync: ", t);
}

// Same operation and shape, different dtypes; then different shapes with the same numel.
FSDP_RANK_WORKER(desync_dtype_and_shape) {
  auto world = fsdp::dist::world_comm();
  const int r = world->rank();
  at::Tensor t = at::ones({8}, r == 0 ? at::kFloat : at::kDouble);
  expect_desync([&] { world->all_reduce(t); }, {"at sequence number 1: ", "rank 0 called all_reduce float32 [8] sum",
                                                "rank 1 called all_reduce float64 [8] sum"});
  at::Tensor in = r == 0 ? at::ones({2, 3}) : at::ones({6});
  at::Tensor out = at::empty({12});
  expect_desync([&] { world->all_gather_into_tensor(out, in); },
                {"at sequence number 2: ", "rank 0 called all_gather_into_tensor float32 [2, 3] -> [12]",
                 "rank 1 called all_gather_into_tensor float32 [6] -> [12]"});
  // Different roots of a broadcast.
  at::Tensor b = at::ones({3});
  expect_desync([&] { world->broadcast(b, r); },
                {"rank 0 called broadcast float32 [3] root 0", "rank 1 called broadcast float32 [3] root 1"});
}

// Three ranks, rank 2 differs: the message groups the ranks that agree. A subgroup names its
// global ranks and counts its own sequence.
FSDP_RANK_WORKER(desync_three_ranks) {
  auto world = fsdp::dist::world_comm();
  const int r = world->rank();
  at::Tensor t = at::ones({r == 2 ? 5 : 4});
  expect_desync(
      [&] { world->all_reduce(t, ReduceOp::Max); },
      {"at sequence number 1: ranks 0,1 called all_reduce float32 [4] max, rank 2 called all_reduce float32 [5] max"});
  world->barrier();
  TORCH_CHECK(world->seq() == 2, "world seq ", world->seq());
}

// Off by default: the collectives run unchecked, the sequence numbers still count.
FSDP_RANK_WORKER(desync_off_by_default) {
  TORCH_CHECK(!fsdp::comm::desync_detection_enabled(), "on without TORCH_DISTRIBUTED_DEBUG=DETAIL");
  auto world = fsdp::dist::world_comm();
  at::Tensor t = at::ones({4});
  world->all_reduce(t);
  world->barrier();
  TORCH_CHECK(world->seq() == 2, "seq ", world->seq());
  TORCH_CHECK(fsdp::comm::desync_check_counters().checks == 0, "a check ran");
}

FSDP_RANK_WORKER(desync_bad_value) {
  fsdp::testing::expect_error([] { fsdp::comm::desync_detection_enabled(); },
                              "TORCH_DISTRIBUTED_DEBUG='verbose' is not one of OFF, INFO, DETAIL");
}

TEST(Desync, RanksWithDifferentModelSizesFailAtOnceNamingBothCalls) {
  const auto t0 = std::chrono::steady_clock::now();
  auto result = fsdp::testing::run_ranks(2, "desync_model_sizes", with_env(kDetail));
  const double took = seconds_since(t0);
  ASSERT_EQ(result.ranks.size(), 2u);
  std::string seq;
  for (int r = 0; r < 2; ++r) {
    const auto& rank = result.ranks[r];
    // Each rank fails by itself with the message (not killed, not timed out).
    EXPECT_FALSE(rank.timed_out) << result.report();
    EXPECT_EQ(rank.term_signal, 0) << result.report();
    EXPECT_EQ(rank.exit_code, 1) << result.report();
    std::smatch m;
    const std::regex re(
        "collective desync in group 'world' at sequence number ([0-9]+): rank 0 called all_gather_into_tensor "
        "float32 \\[[0-9]+\\] -> \\[[0-9]+\\], rank 1 called all_gather_into_tensor float32 \\[[0-9]+\\] -> "
        "\\[[0-9]+\\]");
    ASSERT_TRUE(std::regex_search(rank.output, m, re)) << result.report();
    if (r == 0) seq = m[1];
    EXPECT_EQ(m[1], seq) << "both ranks name the same sequence number\n" << result.report();
    const double detected = std::stod(line_after(rank.output, "DESYNC_SECONDS"));
    EXPECT_LT(detected, 30.0) << result.report();
    std::cout << "rank " << r << " failed after " << detected
              << " s of training: " << line_after(rank.output, "failed:") << "\n";
  }
  EXPECT_LT(took, 60.0) << "whole run, process start included (collective timeout 120 s)";
  std::cout << "whole run " << took << " s\n";
}

TEST(Desync, EqualModelsTrainToTheSameLossesWithAndWithoutTheCheck) {
  auto with = fsdp::testing::run_ranks(2, "equal_models_train", with_env(kDetail));
  ASSERT_TRUE(with.all_ok()) << with.report();
  auto without = fsdp::testing::run_ranks(2, "equal_models_train", with_env({{"TORCH_DISTRIBUTED_DEBUG", "OFF"}}));
  ASSERT_TRUE(without.all_ok()) << without.report();
  for (int r = 0; r < 2; ++r) {
    const auto& a = with.ranks[r].output;
    const auto& b = without.ranks[r].output;
    EXPECT_FALSE(line_after(a, "LOSSES").empty()) << a;
    EXPECT_EQ(line_after(a, "LOSSES"), line_after(b, "LOSSES")) << "bit-identical losses";
    EXPECT_EQ(line_after(a, "BYTES"), line_after(b, "BYTES")) << "the checks are not in the byte counters";
    EXPECT_EQ(line_after(a, "SEQ"), line_after(b, "SEQ"));
    EXPECT_NE(line_after(a, "CHECKS"), "0");
    EXPECT_EQ(line_after(b, "CHECKS"), "0");
  }
  std::cout << "losses " << line_after(with.ranks[0].output, "LOSSES") << "\ncollectives "
            << line_after(with.ranks[0].output, "SEQ") << ", checks " << line_after(with.ranks[0].output, "CHECKS")
            << " (" << line_after(with.ranks[0].output, "CHECK_BYTES") << " B), collective bytes "
            << line_after(with.ranks[0].output, "BYTES") << "\n";
}

TEST(Desync, MismatchedOperationIsNamed) { EXPECT_RANKS_PASS(2, "desync_op_kind", with_env(kDetail)); }

TEST(Desync, MismatchedDtypeShapeAndRootAreNamed) { EXPECT_RANKS_PASS(2, "desync_dtype_and_shape", with_env(kDetail)); }

TEST(Desync, ThreeRanksGroupTheRanksThatAgree) { EXPECT_RANKS_PASS(3, "desync_three_ranks", with_env(kDetail)); }

TEST(Desync, OffByDefault) {
  EXPECT_RANKS_PASS(2, "desync_off_by_default", with_env({{"TORCH_DISTRIBUTED_DEBUG", ""}}));
  EXPECT_RANKS_PASS(2, "desync_off_by_default", with_env({{"TORCH_DISTRIBUTED_DEBUG", "INFO"}}));
}

TEST(Desync, BadValueIsRefusedInOneLine) {
  auto options = with_env({{"TORCH_DISTRIBUTED_DEBUG", "verbose"}});
  options.init_runtime = false;
  EXPECT_RANKS_PASS(1, "desync_bad_value", options);
}

// Through the launcher: fsdprun starts this binary's worker on 2 ranks; it reports the failed
// worker with its rank, and the ranks' desync message reaches the console.
TEST(Desync, ThroughFsdprunTheFailedWorkerIsNamedWithTheMessage) {
  fsdp::testing::ProcessSpec spec;
  spec.argv = {std::string(FSDPRUN_PATH), "--nproc-per-node", "2", "--master-port", "0", "--grace-period-s", "5", "--",
               fsdp::testing::self_exe()};
  spec.env_set = {{"FSDP_TEST_WORKER", "desync_model_sizes"},
                  {"TORCH_DISTRIBUTED_DEBUG", "DETAIL"},
                  {"FSDP_COLLECTIVE_TIMEOUT_S", "120"},
                  {"OMP_NUM_THREADS", "1"}};
  spec.timeout = std::chrono::milliseconds(240000);
  const auto t0 = std::chrono::steady_clock::now();
  auto result = fsdp::testing::run_process(spec);
  const double took = seconds_since(t0);
  EXPECT_FALSE(result.timed_out) << result.output;
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_TRUE(std::regex_search(result.output, std::regex("worker rank [01] \\(pid [0-9]+\\) failed: exit code 1")))
      << result.output;
  EXPECT_NE(result.output.find("collective desync in group 'world' at sequence number"), std::string::npos)
      << result.output;
  EXPECT_LT(took, 60.0) << result.output;
  std::cout << "fsdprun exited " << result.exit_code << " after " << took << " s\n";
  std::istringstream lines(result.output);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("fsdprun") != std::string::npos || line.find("desync") != std::string::npos) {
      std::cout << "  | " << line.substr(0, 300) << "\n";
    }
  }
}

// A group of one (Local backend) is never checked, whatever the setting: nothing to compare.
TEST(Desync, AGroupOfOneIsNeverChecked) {
  fsdp::comm::set_desync_detection(true);
  auto one = fsdp::comm::Comm::single_process("solo");
  at::Tensor t = at::ones({3});
  at::Tensor out = at::empty({3});
  one->all_reduce(t);
  one->all_gather_into_tensor(out, t);
  one->barrier();
  fsdp::comm::set_desync_detection(false);
  EXPECT_EQ(one->seq(), 3u);
  EXPECT_EQ(fsdp::comm::desync_check_counters().checks, 0u);
  EXPECT_TRUE(out.equal(t));
}
