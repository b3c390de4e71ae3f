// Comm::all_to_all with uneven split sizes (expert parallelism's token exchange): every rank's rows
// arrive where the splits say, at 2 and 3 ranks, with splits of zero rows and ranks that send or
// receive nothing; 16-bit floats as their bytes; async; the byte counters count the rows sent to
// other ranks; the flight record holds this rank's sizes; the desync check lets splits differ but
// catches a different row shape; bad splits fail in one line before any collective; a rank that
// never joins makes the other fail within the timeout.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <iostream>

#include "fsdp/debug/comm_stats.h"
#include "fsdp/debug/desync.h"
#include "fsdp/debug/flight_recorder.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"

using fsdp::comm::OpKind;

namespace {

// Rows rank `src` sends to rank `dst`: 0 to 3, zero for some pairs at 2 and 3 ranks.
int64_t rows(int src, int dst) { return (src * 3 + dst * 2 + 1) % 4; }

// Row i that `src` sends to `dst`: values naming the pair and the row, of shape `row`.
at::Tensor block(int src, int dst, int64_t count, at::IntArrayRef row, at::ScalarType dtype) {
  std::vector<int64_t> shape{count};
  shape.insert(shape.end(), row.begin(), row.end());
  const int64_t numel = c10::multiply_integers(shape);
  return (at::arange(numel, at::kDouble) + src * 1000 + dst * 100).reshape(shape).to(dtype);
}

struct Exchange {
  at::Tensor in, out, want;
  std::vector<int64_t> in_splits, out_splits;
  int64_t sent_bytes = 0;
};

// This rank's side of the exchange where rank s sends count(s, d) rows to rank d.
template <typename Count>
Exchange make_exchange(int n, int r, at::IntArrayRef row, at::ScalarType dtype, Count count) {
  Exchange x;
  std::vector<at::Tensor> ins, wants;
  for (int j = 0; j < n; ++j) {
    x.in_splits.push_back(count(r, j));
    x.out_splits.push_back(count(j, r));
    ins.push_back(block(r, j, count(r, j), row, dtype));
    wants.push_back(block(j, r, count(j, r), row, dtype));
    if (j != r) x.sent_bytes += ins.back().nbytes();
  }
  x.in = at::cat(ins);
  x.want = at::cat(wants);
  x.out = at::full_like(x.want, -7);
  return x;
}

void expect_exchanged(const Exchange& x, const std::string& what) {
  TORCH_CHECK(torch::equal(x.out, x.want), what, ": received ", x.out, " expected ", x.want);
}

void expect_throw(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK(std::string(e.what()).find(needle) != std::string::npos, "message '", e.what(), "' lacks '", needle,
                "'");
    return;
  }
  TORCH_CHECK(false, "no error for a call that should fail with '", needle, "'");
}

}  // namespace

FSDP_RANK_WORKER(uneven_exchange) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  for (auto dtype : {at::kFloat, at::kLong, at::kBFloat16}) {
    for (std::vector<int64_t> row : {std::vector<int64_t>{3}, std::vector<int64_t>{2, 2}}) {
      Exchange x = make_exchange(n, r, row, dtype, rows);
      const auto before = comm->stats().snapshot();
      comm->all_to_all(x.out, x.in, x.out_splits, x.in_splits);
      const auto moved = comm->stats().snapshot() - before;
      expect_exchanged(x, std::string("all_to_all ") + c10::toString(dtype));
      TORCH_CHECK(moved[OpKind::AllToAll].calls == 1, "calls ", moved[OpKind::AllToAll].calls);
      TORCH_CHECK(moved[OpKind::AllToAll].bytes_sent == static_cast<uint64_t>(x.sent_bytes), "bytes counted ",
                  moved[OpKind::AllToAll].bytes_sent, ", rows sent to the other ranks are ", x.sent_bytes, " bytes");
      const auto records = fsdp::comm::FlightRecorder::process().snapshot();
      TORCH_CHECK(!records.empty() && std::string(records.back().op) == "all_to_all_uneven", "flight record op");
      TORCH_CHECK(records.back().in_numel == x.in.numel() && records.back().out_numel == x.out.numel(),
                  "flight record sizes ", records.back().in_numel, " -> ", records.back().out_numel);
      TORCH_CHECK(records.back().state == fsdp::comm::FlightState::Completed, "flight record not completed");
    }
  }
  // Two in flight, waited in the reverse order.
  Exchange a = make_exchange(n, r, {5}, at::kFloat, rows);
  Exchange b = make_exchange(n, r, {4}, at::kDouble, [](int s, int d) { return rows(d, s) + 1; });
  auto wa = comm->all_to_all(a.out, a.in, a.out_splits, a.in_splits, /*async_op=*/true);
  auto wb = comm->all_to_all(b.out, b.in, b.out_splits, b.in_splits, /*async_op=*/true);
  wb.wait();
  wa.wait();
  expect_exchanged(a, "first async all_to_all");
  expect_exchanged(b, "second async all_to_all");
  std::cout << "rank " << r << " of " << n << ": uneven all_to_all exchanged, " << a.sent_bytes
            << " bytes sent to other ranks in the first async one" << std::endl;
}

// Rank 0 sends and receives nothing; then nobody sends anything at all.
FSDP_RANK_WORKER(zero_rows) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  Exchange x = make_exchange(n, r, {6}, at::kFloat, [](int s, int d) { return s == 0 || d == 0 ? 0 : s + d; });
  TORCH_CHECK(r != 0 || (x.in.size(0) == 0 && x.out.size(0) == 0), "rank 0 should have no rows");
  const auto before = comm->stats().snapshot();
  comm->all_to_all(x.out, x.in, x.out_splits, x.in_splits);
  expect_exchanged(x, "all_to_all with an empty rank");
  TORCH_CHECK((comm->stats().snapshot() - before)[OpKind::AllToAll].bytes_sent == static_cast<uint64_t>(x.sent_bytes),
              "bytes");
  Exchange none = make_exchange(n, r, {6}, at::kFloat, [](int, int) { return 0; });
  comm->all_to_all(none.out, none.in, none.out_splits, none.in_splits);
  TORCH_CHECK(none.out.size(0) == 0, "nothing to receive");
  comm->barrier();
}

// TORCH_DISTRIBUTED_DEBUG=DETAIL: the splits differ from rank to rank (no error), a row shape that
// differs is caught on every rank before the exchange, and the group stays usable.
FSDP_RANK_WORKER(desync_row_shape) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size(), r = comm->rank();
  TORCH_CHECK(fsdp::comm::desync_detection_enabled(), "TORCH_DISTRIBUTED_DEBUG=DETAIL not seen");
  Exchange x = make_exchange(n, r, {3}, at::kFloat, rows);
  comm->all_to_all(x.out, x.in, x.out_splits, x.in_splits);
  expect_exchanged(x, "all_to_all under the desync check");
  Exchange wrong = make_exchange(n, r, {r == 1 ? 4 : 3}, at::kFloat, rows);
  std::string message;
  try {
    comm->all_to_all(wrong.out, wrong.in, wrong.out_splits, wrong.in_splits);
  } catch (const fsdp::comm::CommError& e) {
    message = e.what();
  }
  TORCH_CHECK(message.find("collective desync in group 'world'") != std::string::npos &&
                  message.find("all_to_all float32 [0, 4]") != std::string::npos,
              "rank ", r, ": expected a desync naming the row shapes, got '", message, "'");
  comm->barrier();
}

FSDP_RANK_WORKER(bad_splits) {
  auto comm = fsdp::dist::world_comm();
  const int n = comm->size();
  const at::Tensor in = at::zeros({4, 2}), out = at::zeros({4, 2});
  std::vector<int64_t> even(static_cast<size_t>(n), 0);
  even[0] = 4;
  expect_throw([&] { comm->all_to_all(out, in, even, {4}); }, "in_splits has 1 entries; give one per rank");
  std::vector<int64_t> negative = even;
  negative[0] = 5;
  negative[1] = -1;
  expect_throw([&] { comm->all_to_all(out, in, even, negative); }, "negative entry -1");
  std::vector<int64_t> three = even;
  three[0] = 3;
  expect_throw([&] { comm->all_to_all(out, in, three, even); }, "out_splits sum to 3 rows but the tensor has 4");
  expect_throw([&] { comm->all_to_all(at::zeros({4, 3}), in, even, even); }, "rows of one shape");
  expect_throw([&] { comm->all_to_all(out, in.to(at::kDouble), even, even); }, "same dtype");
  comm->barrier();  // nobody issued a collective above: the group is still in step
}

// Rank 1 never joins: rank 0 fails within the timeout, naming the operation.
FSDP_RANK_WORKER(uneven_timeout) {
  auto comm = fsdp::dist::world_comm();
  auto store = fsdp::dist::store();
  if (comm->rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      Exchange x = make_exchange(comm->size(), 0, {3}, at::kFloat, rows);
      comm->all_to_all(x.out, x.in, x.out_splits, x.in_splits);
    } catch (const fsdp::comm::CommError& e) {
      message = e.what();
    }
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    store->set("test/rank0_done", std::vector<uint8_t>{1});
    TORCH_CHECK(message.find("all_to_all_uneven on group 'world'") != std::string::npos, "message: ", message);
    TORCH_CHECK(waited < 20.0, "the timeout took ", waited, " s");
    std::cout << "rank 0 failed after " << waited << " s: " << message << std::endl;
    store->wait({"test/rank1_done"}, std::chrono::seconds(60));
  } else {
    store->wait({"test/rank0_done"}, std::chrono::seconds(60));
    store->set("test/rank1_done", std::vector<uint8_t>{1});
  }
  std::_Exit(0);  // the world group is poisoned: skip its orderly teardown
}

TEST(AllToAllUneven, TwoRanks) { EXPECT_RANKS_PASS(2, "uneven_exchange"); }
TEST(AllToAllUneven, ThreeRanks) { EXPECT_RANKS_PASS(3, "uneven_exchange"); }
TEST(AllToAllUneven, ZeroRowsTwoRanks) { EXPECT_RANKS_PASS(2, "zero_rows"); }
TEST(AllToAllUneven, ZeroRowsThreeRanks) { EXPECT_RANKS_PASS(3, "zero_rows"); }

TEST(AllToAllUneven, DesyncCheckTakesSplitsCatchesRowShape) {
  fsdp::testing::RanksOptions opts;
  opts.env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL";
  EXPECT_RANKS_PASS(3, "desync_row_shape", opts);
}

TEST(AllToAllUneven, BadSplitsFailBeforeTheCollective) { EXPECT_RANKS_PASS(2, "bad_splits"); }

TEST(AllToAllUneven, Timeout) {
  fsdp::testing::RanksOptions opts;
  opts.env["FSDP_COLLECTIVE_TIMEOUT_S"] = "3";
  EXPECT_RANKS_PASS(2, "uneven_timeout", opts);
}

// A group of one: a copy, no bytes.
TEST(AllToAllUneven, GroupOfOne) {
  auto comm = fsdp::comm::Comm::single_process();
  const at::Tensor in = at::randn({5, 3}), out = at::empty({5, 3});
  comm->all_to_all(out, in, {5}, {5});
  EXPECT_TRUE(torch::equal(out, in));
  EXPECT_EQ(comm->stats().snapshot()[OpKind::AllToAll].bytes_sent, 0U);
}
