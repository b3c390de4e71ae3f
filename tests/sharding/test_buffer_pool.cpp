// FSDP's buffer pool (fsdp/debug/buffer_pool.h): reusing blocks across units and steps changes no
// number (bit-equal to the same run without the pool), nothing stays alive between steps (no
// leak), the pool's footprint stays at the live set's peak, the steady state maps nothing new,
// and FSDP's buffers at their peak stay within a few units' parameters. Parity with one process
// is test_fully_shard's (the pool is on by default there).
#include <gtest/gtest.h>

#include <iostream>
#include <sstream>

#include "fsdp/debug/buffer_pool.h"
#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "multiprocess.h"
#include "parity.h"

using fsdp::models::GPT;
using fsdp::testing::global_batch;
using fsdp::testing::uneven_config;

namespace {

struct PoolRun {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> shards;
  std::vector<fsdp::BufferMemoryStats> after_step;
  std::vector<fsdp::BufferMemoryStats> after_forward;   // as the root's forward returned
  std::vector<fsdp::BufferMemoryStats> after_backward;  // as backward returned (before the optimizer step)
  std::map<std::string, at::Tensor> grads;              // the last step's gradients, as backward left them
  double largest_unit_bytes = 0;                        // the largest fully_shard unit's unsharded parameters
};

PoolRun train(bool pool, int steps, size_t trim_min_bytes = 0, bool trim_after_backward = false) {
  fsdp::BufferPoolOptions options;
  options.enabled = pool;
  options.min_bytes = 1;                    // every buffer through the pool: the test model is small
  options.trim_min_bytes = trim_min_bytes;  // 0: the cache is trimmed however small it is
  options.trim_after_backward = trim_after_backward;
  fsdp::set_buffer_pool_options(options);
  fsdp::release_cached_buffers();
  fsdp::reset_buffer_memory_peak();
  const auto c = uneven_config();
  auto world = fsdp::dist::world_comm();
  const int n = world->size(), rank = world->rank();
  const int64_t batch = 2 * n;
  GPT model = fsdp::testing::parity_model(c);
  PoolRun r;
  double rest = 0;
  for (auto& block : model->blocks) {
    double unit = 0;
    for (const auto& p : block->parameters()) unit += p.nbytes();
    r.largest_unit_bytes = std::max(r.largest_unit_bytes, unit);
    fsdp::fully_shard(block);
  }
  for (const auto& p : model->parameters()) {
    if (!fsdp::shard_info(p)) rest += p.nbytes();
  }
  r.largest_unit_bytes = std::max(r.largest_unit_bytes, rest);
  fsdp::fully_shard(model);
  auto opt = fsdp::testing::parity_optimizer(*model);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto data = global_batch(c, batch, s, 0).narrow(0, rank * 2, 2);
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    r.after_forward.push_back(fsdp::buffer_memory_stats());
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    r.after_backward.push_back(fsdp::buffer_memory_stats());
    if (s + 1 == steps) {
      for (const auto& p : model->named_parameters()) {
        if (p.value().grad().defined()) r.grads[p.key()] = p.value().grad().clone();
      }
    }
    opt.step();
    r.losses.push_back(loss.item<double>());
    r.after_step.push_back(fsdp::buffer_memory_stats());
  }
  for (const auto& p : model->named_parameters()) r.shards[p.key()] = p.value().detach().clone();
  return r;
}

std::string describe(const fsdp::BufferMemoryStats& s) {
  std::ostringstream os;
  os << "alive " << s.total << " B, peak " << s.peak << " B, pool live " << s.pool_live << " cached " << s.pool_cached
     << " (resident " << s.pool_cached_resident << ", trimmed so far " << s.pool_trimmed << ") peak mapped "
     << s.pool_peak_mapped << " hits " << s.pool_hits << " misses " << s.pool_misses << "; at the peak:";
  for (int k = 0; k < fsdp::kBufferOwners; ++k) {
    if (s.at_peak[k]) os << " " << fsdp::buffer_owner_name(static_cast<fsdp::BufferOwner>(k)) << " " << s.at_peak[k];
  }
  return os.str();
}

}  // namespace

FSDP_RANK_WORKER(pool_reuse_exact_and_bounded) {
  const int steps = 5;
  const PoolRun without = train(/*pool=*/false, steps);
  const PoolRun with = train(/*pool=*/true, steps);
  const int n = fsdp::dist::world_size();
  // Reuse changes no number: losses and every shard bit for bit equal to the run without pool.
  for (int s = 0; s < steps; ++s) {
    TORCH_CHECK(with.losses[s] == without.losses[s], "step ", s, ": loss ", with.losses[s], " with the pool, ",
                without.losses[s], " without");
  }
  for (const auto& [name, t] : without.shards) {
    TORCH_CHECK(torch::equal(with.shards.at(name), t), "parameter ", name, " differs with the pool");
  }
  for (int s = 0; s < steps; ++s) {
    const auto& st = with.after_step[s];
    // No leak: between steps FSDP holds at most the last reduce-scatter's buffers (LibTorch 2.14's
    // Gloo work objects were seen releasing them after the step ended: 24000 B alive after step 1;
    // 1.13 holds none), and what stays alive does not grow from step to step.
    const double slack = 2.0 * with.largest_unit_bytes + 64 * 4096;
    TORCH_CHECK(st.total <= slack && st.pool_live <= slack, "after step ", s, ": ", describe(st));
    if (s > 0)
      TORCH_CHECK(st.total <= std::max<double>(with.after_step[0].total, slack), "after step ", s, ": ", describe(st));
    // The pool's footprint stays at the live set's peak: a block serves requests down to half its
    // size, and blocks are whole pages, hence 2x plus a page per block.
    TORCH_CHECK(st.pool_cached <= st.pool_peak_mapped && st.pool_peak_mapped <= 2 * st.peak + 64 * 4096, "after step ",
                s, ": ", describe(st));
  }
  // The cache's pages are given back when forward ends (BufferPoolOptions::trim_after_forward):
  // none is resident as the root's forward returns, yet no block was mapped anew for it (the reuse
  // bound below).
  for (int s = 1; s < steps && n > 1; ++s) {
    const auto& st = with.after_forward[s];
    TORCH_CHECK(st.pool_cached_resident == 0 && st.pool_trimmed > with.after_forward[s - 1].pool_trimmed, "step ", s,
                ": the pool's cache was not trimmed after forward: ", st.pool_cached_resident, " B resident of ",
                st.pool_cached, " B cached, ", st.pool_trimmed, " B trimmed so far");
  }
  // ... unless the cache is smaller than trim_min_bytes (refaulting it would cost more than it saves).
  if (n > 1) {
    const PoolRun kept = train(/*pool=*/true, 3, /*trim_min_bytes=*/size_t{1} << 40);
    for (int s = 1; s < 3; ++s) {
      const auto& st = kept.after_forward[s];
      TORCH_CHECK(st.pool_trimmed == kept.after_forward[0].pool_trimmed && st.pool_cached_resident > 0, "step ", s,
                  ": a cache below trim_min_bytes was trimmed: ", describe(st));
    }
  }
  const auto& last = with.after_step.back();
  if (n == 1) {
    // A world of one gathers nothing: each unsharded parameter is its shard's memory (no copy),
    // and gradients need no reduce-scatter. FSDP holds no buffer at any time.
    TORCH_CHECK(last.peak == 0 && last.pool_hits + last.pool_misses == 0,
                "a world of one allocated FSDP buffers: ", describe(last));
    return;
  }
  // Reuse: from the third step on (the second is the first with forward prefetching) every block
  // comes from the cache.
  const auto& third = with.after_step[2];
  // LibTorch 2.14's Gloo releases reduce-scatter buffers asynchronously, so a few requests can
  // still miss later (seen: 7 misses against 194 hits); most requests must be served from the cache.
  const auto later_misses = last.pool_misses - with.after_step[1].pool_misses;
  TORCH_CHECK(last.pool_hits > third.pool_hits && later_misses * 10 <= last.pool_hits - third.pool_hits,
              "the pool keeps mapping new blocks in the steady state: step 2: ", describe(with.after_step[1]),
              "; last: ", describe(last));
  // FSDP's buffers at their peak: the target is 5 units (2 units' parameters + gradients + one
  // prefetched unit), whatever the depth. What is alive at most: the unit in backward's parameters,
  // the prefetched all-gather output, and the previous unit's reduce-scatter (input + 1/N scratch of
  // the point-to-point fallback; the output is a row of the input), ~3.5 units at 2 ranks. The
  // bound holds on LibTorch 2.x too because finished buffers are released at wait()
  // (release_buffer), not when Gloo's worker thread drops them.
  const double units = 5.0;
  const double bound = units * with.largest_unit_bytes;
  TORCH_CHECK(last.peak <= bound, "FSDP's buffers peaked at ", last.peak, " B, over ", units, " units (", bound, " B)");
  if (fsdp::dist::rank() == 0) {
    std::cout << "world " << n << ": " << describe(last) << "; largest unit " << with.largest_unit_bytes
              << " B; peak = " << last.peak / with.largest_unit_bytes << " units" << std::endl;
  }
}

TEST(BufferPool, TwoRanksReuseIsExactAndBounded) { EXPECT_RANKS_PASS(2, "pool_reuse_exact_and_bounded"); }

TEST(BufferPool, WorldOfOneReuseIsExactAndBounded) { EXPECT_RANKS_PASS(1, "pool_reuse_exact_and_bounded"); }

// BufferPoolOptions::trim_after_backward: when backward ends (the root's final callback, after the
// last reduce-scatter) the pool's cache gives its pages back, so none is resident as backward
// returns, before the optimizer step; without it the blocks backward freed stay resident. The
// gradients, losses and shards are bit for bit those of the run without the trim.
FSDP_RANK_WORKER(pool_trim_after_backward) {
  const int steps = 3;
  const PoolRun kept = train(/*pool=*/true, steps, /*trim_min_bytes=*/0, /*trim_after_backward=*/false);
  const PoolRun trimmed = train(/*pool=*/true, steps, /*trim_min_bytes=*/0, /*trim_after_backward=*/true);
  for (int s = 0; s < steps; ++s) {
    const auto& on = trimmed.after_backward[s];
    TORCH_CHECK(
        on.pool_cached > 0 && on.pool_cached_resident == 0 && on.pool_trimmed > trimmed.after_forward[s].pool_trimmed,
        "step ", s, ": the cache was not trimmed after backward: ", describe(on));
    const auto& off = kept.after_backward[s];
    TORCH_CHECK(off.pool_cached_resident > 0 && off.pool_trimmed == kept.after_forward[s].pool_trimmed, "step ", s,
                ": the cache was trimmed after backward with trim_after_backward off: ", describe(off));
    TORCH_CHECK(trimmed.losses[s] == kept.losses[s], "step ", s, ": loss ", trimmed.losses[s], " with the trim, ",
                kept.losses[s], " without");
  }
  TORCH_CHECK(!kept.grads.empty() && kept.grads.size() == trimmed.grads.size(), "gradients missing");
  for (const auto& [name, g] : kept.grads) {
    TORCH_CHECK(torch::equal(trimmed.grads.at(name), g), "gradient of ", name, " differs with the trim");
  }
  for (const auto& [name, t] : kept.shards) {
    TORCH_CHECK(torch::equal(trimmed.shards.at(name), t), "parameter ", name, " differs with the trim");
  }
}

TEST(BufferPool, TwoRanksTrimAfterBackward) { EXPECT_RANKS_PASS(2, "pool_trim_after_backward"); }
