// Comm::all_gather_pieces and Comm::reduce_scatter_pieces (comm/p2p_collectives.cpp): several
// exchanges in one operation, pieces of different sizes on different ranks (FSDP's last shard,
// an empty piece), received where the caller says, in place or not; every rank's result checked
// against what each rank's inputs must give (each rank can compute every rank's input).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "fsdp/debug/buffer_pool.h"
#include "fsdp/debug/cpu_collectives.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"

using fsdp::comm::ReduceOp;

namespace {

// Exchange i's piece size on rank r: sizes differ by rank, and exchange 2 is empty on the last rank.
int64_t piece_numel(int i, int r, int n) {
  if (i == 2 && r == n - 1) return 0;
  return 5 + 3 * i + (i == 1 ? r : 0) + (i == 3 ? 70000 : 0);  // exchange 3: large (pool-sized)
}
constexpr int kExchanges = 4;

// Small integers (exact sums in any order), different per exchange, rank and destination.
at::Tensor value(int64_t numel, int i, int r, int dest, at::ScalarType dtype) {
  return ((at::arange(numel, at::kLong) * (r + 3 + i) + 7 * dest) % 13 - 6 + r).to(dtype);
}

}  // namespace

FSDP_RANK_WORKER(pieces_all_gather) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kLong}) {
    for (bool own_in_place : {false, true}) {
      std::vector<at::Tensor> full, ins;
      std::vector<std::vector<at::Tensor>> outs;
      for (int i = 0; i < kExchanges; ++i) {
        int64_t total = 0;
        for (int q = 0; q < n; ++q) total += piece_numel(i, q, n);
        full.push_back(at::full({total}, -99, dtype));
        std::vector<at::Tensor> by_rank;
        int64_t offset = 0;
        for (int q = 0; q < n; ++q) {
          by_rank.push_back(full.back().narrow(0, offset, piece_numel(i, q, n)));
          offset += piece_numel(i, q, n);
        }
        at::Tensor mine = value(piece_numel(i, r, n), i, r, 0, dtype);
        if (own_in_place) {
          by_rank[static_cast<size_t>(r)].copy_(mine);
          mine = by_rank[static_cast<size_t>(r)];
        }
        ins.push_back(mine);
        outs.push_back(by_rank);
      }
      comm->all_gather_pieces(ins, outs, /*async_op=*/true).wait();
      for (int i = 0; i < kExchanges; ++i) {
        for (int q = 0; q < n; ++q) {
          const at::Tensor want = value(piece_numel(i, q, n), i, q, 0, dtype);
          TORCH_CHECK(torch::equal(outs[static_cast<size_t>(i)][static_cast<size_t>(q)], want), "all_gather_pieces ",
                      c10::toString(dtype), " in place ", own_in_place, ": exchange ", i, " piece of rank ", q,
                      " wrong");
        }
      }
    }
  }
}

FSDP_RANK_WORKER(pieces_reduce_scatter) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (auto op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      for (bool in_place : {false, true}) {
        std::vector<at::Tensor> outs;
        std::vector<std::vector<at::Tensor>> ins;
        for (int i = 0; i < kExchanges; ++i) {
          std::vector<at::Tensor> by_dest;
          for (int d = 0; d < n; ++d) by_dest.push_back(value(piece_numel(i, d, n), i, r, d, dtype));
          outs.push_back(in_place ? by_dest[static_cast<size_t>(r)] : at::full({piece_numel(i, r, n)}, -99, dtype));
          ins.push_back(by_dest);
        }
        comm->reduce_scatter_pieces(outs, ins, op, /*async_op=*/true).wait();
        for (int i = 0; i < kExchanges; ++i) {
          at::Tensor want = value(piece_numel(i, r, n), i, 0, r, dtype);
          for (int q = 1; q < n; ++q) {
            const at::Tensor v = value(piece_numel(i, r, n), i, q, r, dtype);
            want = op == ReduceOp::Max ? at::maximum(want, v) : want + v;
          }
          if (op == ReduceOp::Avg) want = want / n;
          TORCH_CHECK(torch::allclose(outs[static_cast<size_t>(i)], want), "reduce_scatter_pieces ",
                      c10::toString(dtype), " op ", static_cast<int>(op), " in place ", in_place, ": exchange ", i,
                      " wrong");
        }
      }
    }
  }
  // The scratch is as large as the outputs, from the pool, and gone after wait().
  std::vector<at::Tensor> outs{at::empty({64 * 1024})};
  std::vector<std::vector<at::Tensor>> ins{std::vector<at::Tensor>(static_cast<size_t>(n), at::ones({64 * 1024}))};
  fsdp::reset_buffer_memory_peak();
  comm->reduce_scatter_pieces(outs, ins, ReduceOp::Sum);
  const auto st = fsdp::buffer_memory_stats();
  const int scratch = static_cast<int>(fsdp::BufferOwner::CommScratch);
  TORCH_CHECK(st.current[scratch] == 0, "scratch alive after wait()");
  TORCH_CHECK(st.at_peak[scratch] == static_cast<uint64_t>(outs[0].nbytes()), "scratch ", st.at_peak[scratch],
              " B, expected ", outs[0].nbytes());
  TORCH_CHECK(torch::equal(outs[0], at::full({64 * 1024}, static_cast<double>(n))), "sum of ones wrong");
}

FSDP_RANK_WORKER(pieces_two_in_flight) {
  // A gather and a reduce-scatter in flight together, waited in either order: tags keep them apart.
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  at::Tensor full = at::zeros({n * 3000});
  std::vector<at::Tensor> by_rank;
  for (int q = 0; q < n; ++q) by_rank.push_back(full.narrow(0, q * 3000, 3000));
  const std::vector<at::Tensor> mine{at::full({3000}, static_cast<double>(r + 1))};
  const std::vector<std::vector<at::Tensor>> gathered{by_rank};
  auto gather = comm->all_gather_pieces(mine, gathered, true);
  const std::vector<std::vector<at::Tensor>> to{
      std::vector<at::Tensor>(static_cast<size_t>(n), at::full({3000}, static_cast<double>(r)))};
  at::Tensor out = at::empty({3000});
  const std::vector<at::Tensor> outs{out};
  auto reduce = comm->reduce_scatter_pieces(outs, to, ReduceOp::Sum, true);
  if (r % 2) reduce.wait();
  gather.wait();
  reduce.wait();
  for (int q = 0; q < n; ++q)
    TORCH_CHECK(torch::equal(by_rank[static_cast<size_t>(q)], at::full({3000}, q + 1.0)), "gather mixed up");
  TORCH_CHECK(torch::equal(out, at::full({3000}, n * (n - 1) / 2.0)), "reduce mixed up");
}

FSDP_RANK_WORKER(pieces_bad_arguments) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size();
  const std::vector<at::Tensor> one_in{at::ones({2})};
  const std::vector<std::vector<at::Tensor>> one_piece{std::vector<at::Tensor>{at::empty({2})}};
  fsdp::testing::expect_error([&] { comm->all_gather_pieces(one_in, one_piece); },
                              "exchange 0 lists 1 pieces; give one per rank of the group");
  std::vector<at::Tensor> wrong(static_cast<size_t>(n), at::empty({3}));
  const std::vector<std::vector<at::Tensor>> wrong_pieces{wrong};
  fsdp::testing::expect_error([&] { comm->all_gather_pieces(one_in, wrong_pieces); },
                              "this rank's piece has 3 elements in the list but 2 alone");
  if (!comm->capabilities().bfloat16) {  // LibTorch 1.13's Gloo: no bf16 arithmetic
    const std::vector<at::Tensor> out{at::empty({2}, at::kBFloat16)};
    const std::vector<std::vector<at::Tensor>> in{
        std::vector<at::Tensor>(static_cast<size_t>(n), at::ones({2}, at::kBFloat16))};
    fsdp::testing::expect_error([&] { comm->reduce_scatter_pieces(out, in); }, "cannot add BFloat16");
  }
}

class PiecesTest : public ::testing::TestWithParam<int> {};

TEST_P(PiecesTest, AllGather) { EXPECT_RANKS_PASS(GetParam(), "pieces_all_gather"); }
TEST_P(PiecesTest, ReduceScatter) { EXPECT_RANKS_PASS(GetParam(), "pieces_reduce_scatter"); }
TEST_P(PiecesTest, TwoInFlight) { EXPECT_RANKS_PASS(GetParam(), "pieces_two_in_flight"); }

INSTANTIATE_TEST_SUITE_P(Ranks, PiecesTest, ::testing::Values(2, 3),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(Pieces, BadArgumentsAreNamed) { EXPECT_RANKS_PASS(2, "pieces_bad_arguments"); }

TEST(Pieces, BadLayoutSettingIsNamed) {
  // FSDP_CPU_COLLECTIVES is read at the first use (fsdp/debug/cpu_collectives.h).
  ::setenv("FSDP_CPU_COLLECTIVES", "ring", 1);
  fsdp::testing::expect_error([] { fsdp::cpu_collective_options(); },
                              "FSDP_CPU_COLLECTIVES='ring' is not a layout; use pieces (the default");
  ::setenv("FSDP_CPU_COLLECTIVES", "gather-pieces", 1);
  const auto o = fsdp::cpu_collective_options();
  EXPECT_TRUE(o.gather_per_parameter);
  EXPECT_FALSE(o.reduce_per_parameter);
  ::unsetenv("FSDP_CPU_COLLECTIVES");
}

// FSDP_CPU_PIECE_BYTES is read once per process, at the first use: each case is a fresh process.
FSDP_RANK_WORKER(piece_bytes_setting) {
  const std::string v = std::getenv("FSDP_CPU_PIECE_BYTES");
  if (v == "1M") {
    fsdp::testing::expect_error([] { fsdp::cpu_collective_options(); },
                                "FSDP_CPU_PIECE_BYTES='1M' is not a byte count; give a whole number of bytes");
    return;
  }
  const auto o = fsdp::cpu_collective_options();
  TORCH_CHECK(o.min_piece_bytes == std::stoull(v), "min_piece_bytes ", o.min_piece_bytes, " for ", v);
  TORCH_CHECK(o.gather_per_parameter && o.reduce_per_parameter, "per parameter both ways by default");
}

TEST(Pieces, PieceBytesSetting) {
  for (const char* v : {"0", "4096", "1M"}) {
    fsdp::testing::RanksOptions o;
    o.env = {{"FSDP_CPU_PIECE_BYTES", v}};
    EXPECT_RANKS_PASS(1, "piece_bytes_setting", o);
  }
}
