// FSDP's phase timers (fsdp/debug/phase_timers.h): with the timers on, every phase
// of a training step is counted as often as FSDP runs it (an all-gather per unit in forward, one
// per resharded unit in backward, a reduce-scatter per unit) and takes time; the hooks' inclusive
// time covers the phases inside them; with the timers off nothing is counted; a bad
// FSDP_PHASE_TIMERS names the variable and the values it takes.
#include <gtest/gtest.h>

#include <cstdlib>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "multiprocess.h"
#include "parity.h"

using fsdp::Phase;
using fsdp::models::GPT;
using fsdp::testing::global_batch;
using fsdp::testing::uneven_config;

namespace {

// Two steps of the parity GPT, every block a unit plus the root; returns the number of blocks.
int64_t train_two_steps() {
  const auto c = uneven_config();
  auto world = fsdp::dist::world_comm();
  GPT model = fsdp::testing::parity_model(c);
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
  auto opt = fsdp::testing::parity_optimizer(*model);
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    auto data = global_batch(c, 2 * world->size(), s, 0).narrow(0, world->rank() * 2, 2);
    auto loss =
        fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
  }
  return static_cast<int64_t>(model->blocks.size());
}

uint64_t calls(const fsdp::PhaseTimes& t, Phase p) { return t.calls[static_cast<size_t>(p)]; }

}  // namespace

FSDP_RANK_WORKER(phase_timers_count_every_phase) {
  fsdp::set_phase_timers(true);
  fsdp::reset_phase_timers();
  const auto blocks = static_cast<uint64_t>(train_two_steps());
  const auto t = fsdp::phase_times();
  std::cout << t.table(2);
  // Per step: forward gathers the root and every block; backward gathers every block again (the
  // root keeps its parameters); every unit reduces once.
  const uint64_t gathers = 2 * (1 + 2 * blocks), reduces = 2 * (1 + blocks);
  for (Phase p : {Phase::CopyIn, Phase::AllGatherIssue, Phase::AllGatherWait, Phase::CopyOut}) {
    TORCH_CHECK(calls(t, p) == gathers, fsdp::phase_name(p), ": ", calls(t, p), " calls, expected ", gathers);
  }
  for (Phase p : {Phase::ReduceScatterInput, Phase::ReduceScatterIssue, Phase::ReduceScatterWait}) {
    TORCH_CHECK(calls(t, p) == reduces, fsdp::phase_name(p), ": ", calls(t, p), " calls, expected ", reduces);
  }
  TORCH_CHECK(calls(t, Phase::Reshard) >= 2 * 2 * blocks, "reshard: ", calls(t, Phase::Reshard), " calls");
  TORCH_CHECK(calls(t, Phase::GradAccumulate) >= reduces, "grad write: ", calls(t, Phase::GradAccumulate));
  TORCH_CHECK(calls(t, Phase::PoolTrim) >= 1, "the pool was never trimmed after forward");
  double leaves = 0;
  for (int i = 0; i < static_cast<int>(Phase::Count); ++i) {
    const auto p = static_cast<Phase>(i);
    if (p == Phase::Hooks || calls(t, p) == 0) continue;
    TORCH_CHECK(t.ns[static_cast<size_t>(i)] > 0, fsdp::phase_name(p), " was counted but took no time");
    leaves += t.ms(p);
  }
  TORCH_CHECK(t.ms(Phase::Hooks) >= leaves, "the hooks (", t.ms(Phase::Hooks),
              " ms) took less than the phases inside them (", leaves, " ms)");
  // Off: nothing more is counted.
  fsdp::set_phase_timers(false);
  fsdp::reset_phase_timers();
  train_two_steps();
  const auto off = fsdp::phase_times();
  for (int i = 0; i < static_cast<int>(Phase::Count); ++i) {
    TORCH_CHECK(off.calls[static_cast<size_t>(i)] == 0 && off.ns[static_cast<size_t>(i)] == 0,
                fsdp::phase_name(static_cast<Phase>(i)), " was counted with the timers off");
  }
}

FSDP_RANK_WORKER(phase_timers_from_environment) {
  TORCH_CHECK(fsdp::phase_timers_enabled(), "FSDP_PHASE_TIMERS=1 did not turn the timers on");
  fsdp::reset_phase_timers();
  train_two_steps();
  TORCH_CHECK(fsdp::phase_times().calls[static_cast<size_t>(Phase::AllGatherWait)] > 0, "nothing was timed");
}

TEST(PhaseTimers, TwoRanksCountEveryPhase) { EXPECT_RANKS_PASS(2, "phase_timers_count_every_phase"); }

TEST(PhaseTimers, OnFromTheEnvironment) {
  fsdp::testing::RanksOptions options;
  options.env = {{"FSDP_PHASE_TIMERS", std::string("1")}};
  EXPECT_RANKS_PASS(2, "phase_timers_from_environment", options);
}

TEST(PhaseTimers, BadEnvironmentValueIsAClearError) {
  ::setenv("FSDP_PHASE_TIMERS", "yes", 1);
  try {
    fsdp::phase_timers_enabled();
    FAIL() << "FSDP_PHASE_TIMERS=yes was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("FSDP_PHASE_TIMERS='yes' is not 0 or 1"), std::string::npos) << e.what();
  }
  ::unsetenv("FSDP_PHASE_TIMERS");
  EXPECT_FALSE(fsdp::phase_timers_enabled());
}
