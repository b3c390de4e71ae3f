// FSDP's phase timers (fsdp/debug/phase_timers.h): with the timers on, every phase
// of a training step is counted as often as FSDP runs it (an all-gather per unit in forward, one
// per resharded unit in backward, a reduce-scatter per unit) and takes time; the hooks' inclusive
// time covers the phases inside them; each phase's thread CPU time is counted, and is at most its
// wall time; the difference of two snapshots is what ran between them; with the timers off
// nothing is counted; a bad FSDP_PHASE_TIMERS names the variable and the values it takes.
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
  double leaves = 0, leaves_cpu = 0;
  for (int i = 0; i < static_cast<int>(Phase::Count); ++i) {
    const auto p = static_cast<Phase>(i);
    // The CPU clock is read inside the wall clock's readings: a scope's CPU time cannot exceed them.
    TORCH_CHECK(t.cpu_ns[static_cast<size_t>(i)] <= t.ns[static_cast<size_t>(i)], fsdp::phase_name(p), ": CPU ",
                t.cpu_ms(p), " ms > wall ", t.ms(p), " ms");
    if (p == Phase::Hooks || calls(t, p) == 0) continue;
    TORCH_CHECK(t.ns[static_cast<size_t>(i)] > 0, fsdp::phase_name(p), " was counted but took no time");
    leaves += t.ms(p);
    leaves_cpu += t.cpu_ms(p);
  }
  TORCH_CHECK(t.ms(Phase::Hooks) >= leaves, "the hooks (", t.ms(Phase::Hooks),
              " ms) took less than the phases inside them (", leaves, " ms)");
  // Copying the shards in and out is work on this thread, not waiting.
  TORCH_CHECK(t.cpu_ns[static_cast<size_t>(Phase::CopyIn)] > 0 && t.cpu_ns[static_cast<size_t>(Phase::CopyOut)] > 0,
              "the copies took no CPU time");
  // Every phase here runs inside a hook, so FSDP's own CPU time is the hooks' (which hold the phases').
  TORCH_CHECK(t.unhooked_ns == 0 && t.unhooked_cpu_ns == 0, "a phase was counted outside the hooks");
  TORCH_CHECK(t.own_cpu_ms() == t.cpu_ms(Phase::Hooks) && t.own_cpu_ms() >= leaves_cpu, "FSDP's own CPU ",
              t.own_cpu_ms(), " ms, the hooks' ", t.cpu_ms(Phase::Hooks), " ms, the phases' ", leaves_cpu, " ms");
  // Two more steps without a reset: the difference of the snapshots counts them alone.
  train_two_steps();
  const auto more = fsdp::phase_times() - t;
  for (int i = 0; i < static_cast<int>(Phase::Count); ++i) {
    const auto p = static_cast<Phase>(i);
    TORCH_CHECK(calls(more, p) == calls(t, p), fsdp::phase_name(p), ": ", calls(more, p),
                " calls in the difference, expected ", calls(t, p));
    TORCH_CHECK(calls(t, p) == 0 || more.ns[static_cast<size_t>(i)] > 0, fsdp::phase_name(p),
                " took no time in the difference");
  }
  // FSDPModule::unshard and reshard called directly: their phases are FSDP's own time outside any hook.
  {
    GPT model = fsdp::testing::parity_model(uneven_config());
    auto unit = fsdp::fully_shard(model->blocks[0]);
    fsdp::reset_phase_timers();
    unit.unshard();
    unit.reshard();
    const auto direct = fsdp::phase_times();
    TORCH_CHECK(calls(direct, Phase::AllGatherWait) == 1 && calls(direct, Phase::Hooks) == 0,
                "a direct unshard: ", calls(direct, Phase::AllGatherWait), " waits, ", calls(direct, Phase::Hooks),
                " hooks");
    uint64_t leaves = 0;
    for (int i = 0; i < static_cast<int>(Phase::Count); ++i) leaves += direct.ns[static_cast<size_t>(i)];
    TORCH_CHECK(direct.unhooked_ns == leaves && direct.unhooked_cpu_ns > 0 &&
                    direct.own_cpu_ms() == static_cast<double>(direct.unhooked_cpu_ns) / 1e6,
                "the direct unshard's phases took ", leaves, " ns, counted outside the hooks ", direct.unhooked_ns,
                " ns");
  }
  // Off: nothing more is counted.
  fsdp::set_phase_timers(false);
  fsdp::reset_phase_timers();
  train_two_steps();
  const auto off = fsdp::phase_times();
  for (int i = 0; i < static_cast<int>(Phase::Count); ++i) {
    TORCH_CHECK(off.calls[static_cast<size_t>(i)] == 0 && off.ns[static_cast<size_t>(i)] == 0 &&
                    off.cpu_ns[static_cast<size_t>(i)] == 0,
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
