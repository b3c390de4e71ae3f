// Comm's point-to-point Gloo fallbacks (GlooFallback::PointToPoint, comm/p2p_collectives.cpp)
// against the collective ones (all_to_all + sum, list all-gather): the same numbers, in place or
// not, with two operations in flight waited in either order, and a reduce-scatter scratch of 1/N
// of the input where all_to_all's is the whole input (FSDP's buffer counting, CommScratch).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "fsdp/comm/backend.h"
#include "fsdp/debug/buffer_pool.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"

using fsdp::comm::GlooFallback;
using fsdp::comm::ReduceOp;

namespace {

// Rank r's input: small integers (sums exact in any order), different per rank and position.
at::Tensor rank_input(int64_t numel, int r, at::ScalarType dtype) {
  return ((at::arange(numel, at::kLong) * (r + 3)) % 11 - 5 + r).to(dtype);
}

at::Tensor reduce_scatter(GlooFallback how, const at::Tensor& in, ReduceOp op, bool in_place) {
  auto comm = fsdp::dist::world_comm();
  fsdp::comm::set_gloo_fallback(how);
  const int n = comm->size();
  at::Tensor input = in.clone();
  at::Tensor out = in_place ? input.view({n, -1})[comm->rank()] : at::full({in.numel() / n}, -99, in.scalar_type());
  comm->reduce_scatter_tensor(out, input, op, /*async_op=*/true).wait();
  return out.clone();
}

}  // namespace

FSDP_RANK_WORKER(p2p_equals_collective) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong}) {
    for (int64_t per_rank : {int64_t{1}, int64_t{7}, int64_t{4099}}) {
      const at::Tensor in = rank_input(n * per_rank, r, dtype);
      for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
        if (op == ReduceOp::Avg && dtype == at::kLong) continue;
        const at::Tensor want = reduce_scatter(GlooFallback::Collective, in, op, false);
        for (bool in_place : {false, true}) {
          const at::Tensor got = reduce_scatter(GlooFallback::PointToPoint, in, op, in_place);
          TORCH_CHECK(torch::equal(got, want), "reduce_scatter ", c10::toString(dtype), " op ", static_cast<int>(op),
                      " per rank ", per_rank, " in place ", in_place, ": p2p ", got, " != collective ", want);
        }
      }
    }
  }
  // All-gather (LibTorch < 2.2 takes the fallback; later ones have Gloo's own): 16-bit floats as bytes.
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    const at::Tensor in = rank_input(1031, r, dtype);
    at::Tensor want = at::empty({n * 1031}, dtype), got = at::empty({n * 1031}, dtype);
    fsdp::comm::set_gloo_fallback(GlooFallback::Collective);
    comm->all_gather_into_tensor(want, in);
    fsdp::comm::set_gloo_fallback(GlooFallback::PointToPoint);
    comm->all_gather_into_tensor(got, in, /*async_op=*/true).wait();
    TORCH_CHECK(torch::equal(got, want), "all_gather ", c10::toString(dtype), ": p2p differs from collective");
    // In place: the input is this rank's chunk of the output.
    at::Tensor inplace = at::zeros({n * 1031}, dtype);
    inplace.narrow(0, r * 1031, 1031).copy_(in);
    comm->all_gather_into_tensor(inplace, inplace.narrow(0, r * 1031, 1031));
    TORCH_CHECK(torch::equal(inplace, want), "in-place all_gather ", c10::toString(dtype), " differs");
  }
}

FSDP_RANK_WORKER(p2p_two_in_flight_any_order) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  fsdp::comm::set_gloo_fallback(GlooFallback::PointToPoint);
  const at::Tensor a = rank_input(n * 5000, r, at::kFloat), b = rank_input(n * 5000, r + 7, at::kFloat);
  const at::Tensor want_a = reduce_scatter(GlooFallback::Collective, a, ReduceOp::Sum, false);
  const at::Tensor want_b = reduce_scatter(GlooFallback::Collective, b, ReduceOp::Sum, false);
  fsdp::comm::set_gloo_fallback(GlooFallback::PointToPoint);
  at::Tensor out_a = at::empty({5000}), out_b = at::empty({5000});
  auto work_a = comm->reduce_scatter_tensor(out_a, a, ReduceOp::Sum, /*async_op=*/true);
  auto work_b = comm->reduce_scatter_tensor(out_b, b, ReduceOp::Sum, /*async_op=*/true);
  // Odd ranks wait for the second first: every operation has its own tag, so no message is taken
  // by the wrong one.
  if (r % 2) work_b.wait();
  work_a.wait();
  work_b.wait();
  TORCH_CHECK(torch::equal(out_a, want_a) && torch::equal(out_b, want_b), "two reduce-scatters in flight mixed up");
}

FSDP_RANK_WORKER(p2p_scratch_is_one_chunk) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  const int64_t per_rank = 64 * 1024;  // 256 KiB per chunk: from the buffer pool, counted
  const at::Tensor in = rank_input(n * per_rank, r, at::kFloat);
  at::Tensor out = at::empty({per_rank});
  uint64_t scratch_peak[2] = {0, 0};
  for (auto how : {GlooFallback::PointToPoint, GlooFallback::Collective}) {
    fsdp::comm::set_gloo_fallback(how);
    fsdp::reset_buffer_memory_peak();
    comm->reduce_scatter_tensor(out, in, ReduceOp::Sum);
    const auto st = fsdp::buffer_memory_stats();
    TORCH_CHECK(st.current[static_cast<int>(fsdp::BufferOwner::CommScratch)] == 0, "scratch still alive after wait()");
    scratch_peak[how == GlooFallback::Collective] = st.at_peak[static_cast<int>(fsdp::BufferOwner::CommScratch)];
  }
  TORCH_CHECK(scratch_peak[0] == static_cast<uint64_t>(out.nbytes()), "p2p scratch ", scratch_peak[0],
              " B, expected one chunk ", out.nbytes(), " B");
  TORCH_CHECK(scratch_peak[1] == static_cast<uint64_t>(in.nbytes()), "all_to_all scratch ", scratch_peak[1],
              " B, expected the input's ", in.nbytes(), " B");
}

FSDP_RANK_WORKER(p2p_bad_setting_is_named) {
  auto comm = fsdp::dist::world_comm();
  at::Tensor out = at::empty({4});
  fsdp::testing::expect_error([&] { comm->reduce_scatter_tensor(out, at::ones({4 * comm->size()})); },
                              "FSDP_GLOO_FALLBACK='ring' is not a Gloo fallback; use p2p");
}

class P2PTest : public ::testing::TestWithParam<int> {};

TEST_P(P2PTest, EqualsCollective) { EXPECT_RANKS_PASS(GetParam(), "p2p_equals_collective"); }
TEST_P(P2PTest, TwoInFlightAnyOrder) { EXPECT_RANKS_PASS(GetParam(), "p2p_two_in_flight_any_order"); }
TEST_P(P2PTest, ScratchIsOneChunk) { EXPECT_RANKS_PASS(GetParam(), "p2p_scratch_is_one_chunk"); }

INSTANTIATE_TEST_SUITE_P(Ranks, P2PTest, ::testing::Values(2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(P2PSetting, BadValueIsNamed) {
  fsdp::testing::RanksOptions opts;
  opts.env["FSDP_GLOO_FALLBACK"] = "ring";
  EXPECT_RANKS_PASS(2, "p2p_bad_setting_is_named", opts);
}

// Gloo's worker threads (FSDP_GLOO_THREADS, default 2): with one, collectives issued back to back
// run one after another; the results and any-order waits must not change.
TEST(P2PSetting, OneGlooThread) {
  fsdp::testing::RanksOptions opts;
  opts.env["FSDP_GLOO_THREADS"] = "1";
  EXPECT_RANKS_PASS(2, "p2p_equals_collective", opts);
  EXPECT_RANKS_PASS(2, "p2p_two_in_flight_any_order", opts);
}
