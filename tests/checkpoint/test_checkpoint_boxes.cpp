// N-dimensional checkpoint chunks (index format 2): tensors split along any dims, saved and loaded
// at other world sizes and layouts, bitwise; format-1 checkpoints (dim-0 row chunks) still load.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint/state_items.h"  // src/checkpoint: detail::gather_along, the gather of sharded parameters
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "test_helpers.h"

using namespace fsdp::testing;
namespace ckpt = fsdp::checkpoint;
namespace fs = std::filesystem;

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v, name, " is not set");
  return v;
}

// ---- layouts: which box of a global tensor each rank holds ------------------------------------

// Even chunking (FSDP's and TP's): part i of n along a dim of size `size`.
std::pair<int64_t, int64_t> part(int64_t size, int64_t i, int64_t n) {
  const int64_t per = (size + n - 1) / n;
  const int64_t off = std::min(size, i * per);
  return {off, std::min(per, size - off)};
}

struct Box {
  std::vector<int64_t> offsets, sizes;
  bool write = true;
};

// LAYOUT at `world` ranks: "rows" (dim 0 over all ranks), "cols" (dim 1 over all ranks), "grid"
// (2 x (world/2): dim 0 over 2, dim 1 over world/2), "replicated_cols" (dim 1 over world/2, each
// box held by 2 ranks, the first writes), "last_dim" (the last dim over all ranks), "whole" (every rank holds
// everything, rank 0 writes).
Box box_for(const std::string& layout, int rank, int world, const std::vector<int64_t>& shape) {
  Box b{std::vector<int64_t>(shape.size(), 0), shape};
  if (shape.empty()) {  // a 0-d tensor: whole everywhere
    b.write = rank == 0;
    return b;
  }
  auto split = [&](size_t dim, int64_t i, int64_t n) {
    auto [off, size] = part(shape[dim], i, n);
    b.offsets[dim] = off;
    b.sizes[dim] = size;
  };
  if (layout == "rows") {
    split(0, rank, world);
  } else if (layout == "cols") {
    split(1, rank, world);
  } else if (layout == "last_dim") {
    split(shape.size() - 1, rank, world);
  } else if (layout == "grid") {
    TORCH_CHECK(world % 2 == 0, "grid needs an even world");
    split(0, rank / (world / 2), 2);
    split(1, rank % (world / 2), world / 2);
  } else if (layout == "replicated_cols") {
    TORCH_CHECK(world % 2 == 0, "replicated_cols needs an even world");
    split(1, rank % (world / 2), world / 2);
    b.write = rank < world / 2;
  } else if (layout == "whole") {
    b.write = rank == 0;
  } else {
    TORCH_CHECK(false, "unknown layout ", layout);
  }
  return b;
}

// The test tensors: 2-D even and uneven, 3-D, a scalar; values are their positions, so a box
// read from the wrong place cannot pass.
std::map<std::string, at::Tensor> full_tensors() {
  return {{"a", at::arange(12 * 10, at::kFloat).reshape({12, 10})},
          {"b", (at::arange(7 * 5, at::kDouble) * 0.5).reshape({7, 5})},
          {"c", at::arange(5 * 6 * 4, at::kLong).reshape({5, 6, 4})},
          {"s", at::scalar_tensor(42.5, at::kFloat)}};
}

at::Tensor crop(const at::Tensor& full, const Box& b) {
  at::Tensor v = full;
  for (size_t d = 0; d < b.offsets.size(); ++d) v = v.narrow(static_cast<int64_t>(d), b.offsets[d], b.sizes[d]);
  return v;
}

std::string detail_text(const std::vector<int64_t>& v) {
  std::string s = "box at [";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

int rank() { return fsdp::dist::is_initialized() ? fsdp::dist::rank() : 0; }
int world() { return fsdp::dist::is_initialized() ? fsdp::dist::world_size() : 1; }

// This rank's entries for `layout`: zeros to load into, or the values to save.
std::map<std::string, ckpt::ShardedTensor> entries(const std::map<std::string, at::Tensor>& full,
                                                   const std::string& layout, bool with_values) {
  std::map<std::string, ckpt::ShardedTensor> out;
  for (const auto& [key, t] : full) {
    const Box b = box_for(layout, rank(), world(), t.sizes().vec());
    at::Tensor local = with_values ? crop(t, b).contiguous() : at::zeros(b.sizes, t.options());
    out[key] = ckpt::ShardedTensor{local, t.sizes().vec(), b.offsets, b.write};
  }
  return out;
}

// Every entry holds exactly its box of `full` (bitwise).
void check_entries(const std::map<std::string, ckpt::ShardedTensor>& got, const std::map<std::string, at::Tensor>& full,
                   const std::string& layout) {
  for (const auto& [key, t] : full) {
    const Box b = box_for(layout, rank(), world(), t.sizes().vec());
    TORCH_CHECK(at::equal(got.at(key).local, crop(t, b)), "rank ", rank(), ": '", key, "' (", layout,
                ") differs from the saved values");
  }
}

// The format-1 fixture's model: w [5, 3] (2 ranks: rows 3 + 2), v [3] (2 + 1), a buffer.
struct FixtureNetImpl : torch::nn::Module {
  at::Tensor w, v, buf;
  FixtureNetImpl() {
    w = register_parameter("w", at::zeros({5, 3}));
    v = register_parameter("v", at::zeros({3}));
    buf = register_buffer("buf", at::zeros({2}, at::kLong));
  }
};
TORCH_MODULE(FixtureNet);

at::Tensor fixture_w() { return at::arange(15, at::kFloat).reshape({5, 3}) * 0.5f + 1; }
at::Tensor fixture_v() { return at::arange(3, at::kFloat) - 7; }
at::Tensor fixture_buf() { return at::arange(2, at::kLong) + 40; }

}  // namespace

// How tests/checkpoint/data/v1 was made: this worker at 2 ranks, built from the format-1 code
// (commit b49336e), with FIXTURE_OUT=tests/checkpoint/data/v1 (see DISABLED_MakeV1Fixture).
FSDP_RANK_WORKER(make_v1_fixture) {
  FixtureNet net;
  {
    at::NoGradGuard g;
    net->w.copy_(fixture_w());
    net->v.copy_(fixture_v());
    net->buf.copy_(fixture_buf());
  }
  fsdp::fully_shard(net);
  ckpt::ScalarState progress;
  progress.ints["step"] = 7;
  ckpt::save(env("FIXTURE_OUT"), ckpt::State{net.ptr(), nullptr, {{"progress", &progress}}});
}

// SAVE_LAYOUT: save full_tensors() in that layout to CKPT_DIR.
FSDP_RANK_WORKER(boxes_save) {
  ckpt::State state;
  state.tensors = entries(full_tensors(), env("SAVE_LAYOUT"), true);
  ckpt::save(env("CKPT_DIR"), state);
}

// LOAD_LAYOUT: load CKPT_DIR in that layout and check every box; then, when RESAVE_DIR is set,
// save what was loaded there (in the load layout) for the next link of a chain.
FSDP_RANK_WORKER(boxes_load) {
  const std::string layout = env("LOAD_LAYOUT");
  ckpt::State state;
  state.tensors = entries(full_tensors(), layout, false);
  ckpt::load(env("CKPT_DIR"), state);
  check_entries(state.tensors, full_tensors(), layout);
  if (const char* resave = std::getenv("RESAVE_DIR")) ckpt::save(resave, state);
}

TEST(CheckpointBoxFixture, DISABLED_MakeV1Fixture) {
  RanksOptions o;
  o.env["FIXTURE_OUT"] = env("FIXTURE_OUT");
  EXPECT_RANKS_PASS(2, "make_v1_fixture", o);
}

// Like boxes_save, but replicated boxes are all written (write = true everywhere): the save must
// be refused, naming the overlap and the fix.
FSDP_RANK_WORKER(boxes_save_replicas_twice) {
  ckpt::State state;
  state.tensors = entries(full_tensors(), "replicated_cols", true);
  for (auto& [key, t] : state.tensors) t.write = true;
  if (rank() == 0)
    expect_error([&] { ckpt::save(env("CKPT_DIR"), state); }, "overlaps");
  else
    expect_error([&] { ckpt::save(env("CKPT_DIR"), state); }, "could not commit");
}

// Full state dicts of box entries (LAYOUT): every rank gathers every tensor whole; with
// cpu_offload only rank 0 keeps them; set_tensor_state_dict gives each rank its box back.
FSDP_RANK_WORKER(boxes_state_dict) {
  const std::string layout = env("LOAD_LAYOUT");
  const auto full = full_tensors();
  auto mine = entries(full, layout, true);
  const auto gathered = ckpt::get_tensor_state_dict(mine, {.full_state_dict = true});
  for (const auto& [key, t] : full) TORCH_CHECK(at::equal(gathered.at(key), t), "gathered '", key, "' differs");
  const auto on_rank0 = ckpt::get_tensor_state_dict(mine, {.full_state_dict = true, .cpu_offload = true});
  TORCH_CHECK(rank() == 0 ? on_rank0.size() == full.size() : on_rank0.empty(), "cpu_offload kept ", on_rank0.size());
  auto zeros = entries(full, layout, false);
  ckpt::set_tensor_state_dict(zeros, gathered, {.full_state_dict = true});
  check_entries(zeros, full, layout);
  // A layout with a hole (the holders of the box at [0, 0] of 'a' hold nothing): a clear error on
  // every rank.
  auto holed = entries(full, layout, true);
  if (holed["a"].offsets == std::vector<int64_t>{0, 0}) holed["a"].local = holed["a"].local.narrow(0, 0, 0);
  expect_error([&] { ckpt::get_tensor_state_dict(holed, {.full_state_dict = true}); }, "leave elements uncovered");
}

// The gather used for sharded parameters (detail::gather_along, one step per sharded dim): a
// [12, 10] tensor split over a 2 x 2 mesh (dim 0 over "dp", dim 1 over "tp", as FSDP over TP
// will), gathered dim 0 first, then dim 1; and a [7, 5] tensor split along dim 1 over the world.
FSDP_RANK_WORKER(gather_steps) {
  const at::Tensor a = full_tensors().at("a"), b = full_tensors().at("b");
  if (world() == 4) {
    auto mesh = fsdp::init_device_mesh({2, 2}, {"dp", "tp"});
    const int dp = rank() / 2, tp = rank() % 2;
    auto [r0, n0] = part(12, dp, 2);
    auto [c0, m0] = part(10, tp, 2);
    at::Tensor local = a.narrow(0, r0, n0).narrow(1, c0, m0).contiguous();
    at::Tensor t = fsdp::checkpoint::detail::gather_along(local, {0, mesh["dp"].comm(), 6, 12});
    t = fsdp::checkpoint::detail::gather_along(t, {1, mesh["tp"].comm(), 5, 10});
    TORCH_CHECK(at::equal(t, a), "2-D gather differs");
  }
  // Uneven along dim 1: 5 columns over the world (per_rank 2 at 3 ranks: 2 + 2 + 1).
  const int64_t per = (5 + world() - 1) / world();
  auto [c, m] = part(5, rank(), world());
  at::Tensor local = b.narrow(1, c, m).contiguous();
  auto group = fsdp::dist::world_comm();
  TORCH_CHECK(at::equal(fsdp::checkpoint::detail::gather_along(local, {1, group, per, 5}), b), "dim-1 gather differs");
}

// ---- the format-1 fixture ------------------------------------------------------------------

std::string fixture_dir() { return std::string(FSDP_CHECKPOINT_DATA_DIR) + "/v1"; }

void check_fixture_net(FixtureNet& net, const ckpt::ScalarState& progress) {
  auto local = [&](const at::Tensor& p, const at::Tensor& full) {
    auto info = fsdp::shard_info(p);
    return info ? full.narrow(0, info->dim0_offset, info->local_rows) : full;
  };
  // By name: fully_shard replaces the registered parameters (the members keep the old tensors).
  const at::Tensor w = net->named_parameters()["w"], v = net->named_parameters()["v"];
  TORCH_CHECK(at::equal(w, local(w, fixture_w())), "w differs");
  TORCH_CHECK(at::equal(v, local(v, fixture_v())), "v differs");
  TORCH_CHECK(at::equal(net->buf, fixture_buf()), "buf differs");
  TORCH_CHECK(progress.ints.at("step") == 7, "step differs");
}

// The v1 fixture at any world size with fully_shard (dim-0 chunks of another size); then saved in
// format 2 to RESAVE_DIR.
FSDP_RANK_WORKER(v1_load_fsdp) {
  FixtureNet net;
  fsdp::fully_shard(net);
  ckpt::ScalarState progress;
  ckpt::State state{net.ptr(), nullptr, {{"progress", &progress}}};
  ckpt::load(fixture_dir(), state);
  check_fixture_net(net, progress);
  ckpt::save(env("RESAVE_DIR"), state);
}

// The v1 fixture's row chunks read as boxes along dim 1 (ShardedTensor entries, no model).
FSDP_RANK_WORKER(v1_load_cols) {
  ckpt::State state;
  state.tensors = entries({{"model.w", fixture_w()}, {"model.v", fixture_v()}}, "last_dim", false);
  ckpt::LoadOptions o;
  o.strict = false;  // the buffer and the extras stay unread
  ckpt::load(fixture_dir(), state, o);
  check_entries(state.tensors, {{"model.w", fixture_w()}, {"model.v", fixture_v()}}, "last_dim");
}

// ---- bytes read stay bounded ---------------------------------------------------------------

constexpr int64_t kBigRows = 4000, kBigCols = 700;  // 11.2 MB of float: chunks span many 1 MiB blocks
at::Tensor big() { return at::arange(kBigRows * kBigCols, at::kFloat).reshape({kBigRows, kBigCols}); }

FSDP_RANK_WORKER(big_boxes_save) {
  ckpt::State state;
  state.tensors = entries({{"big", big()}}, env("SAVE_LAYOUT"), true);
  ckpt::save(env("CKPT_DIR"), state);
}

// Loads "big" in LOAD_LAYOUT from a save in SAVE_LAYOUT at SAVE_WORLD ranks. Bytes read: of each
// overlapping chunk, a region spanning whole rows of the chunk is one contiguous run (its bytes
// plus at most one 1 MiB checksum block at each end); any other region costs at most the chunk.
// A chunk inside the box is read exactly.
FSDP_RANK_WORKER(big_boxes_load) {
  const std::string layout = env("LOAD_LAYOUT"), saved = env("SAVE_LAYOUT");
  const int saved_world = std::stoi(env("SAVE_WORLD"));
  ckpt::State state;
  state.tensors = entries({{"big", big()}}, layout, false);
  const auto stats = ckpt::load(env("CKPT_DIR"), state);
  check_entries(state.tensors, {{"big", big()}}, layout);
  const Box mine = box_for(layout, rank(), world(), {kBigRows, kBigCols});
  uint64_t bound = 0, exact = 0;
  bool all_inside = true;
  for (int r = 0; r < saved_world; ++r) {
    const Box chunk = box_for(saved, r, saved_world, {kBigRows, kBigCols});
    if (!chunk.write) continue;
    const int64_t r0 = std::max(mine.offsets[0], chunk.offsets[0]);
    const int64_t r1 = std::min(mine.offsets[0] + mine.sizes[0], chunk.offsets[0] + chunk.sizes[0]);
    const int64_t c0 = std::max(mine.offsets[1], chunk.offsets[1]);
    const int64_t c1 = std::min(mine.offsets[1] + mine.sizes[1], chunk.offsets[1] + chunk.sizes[1]);
    if (r0 >= r1 || c0 >= c1) continue;
    const uint64_t region = static_cast<uint64_t>((r1 - r0) * (c1 - c0)) * 4;
    const uint64_t whole_chunk = static_cast<uint64_t>(chunk.sizes[0] * chunk.sizes[1]) * 4;
    const bool whole_rows = c1 - c0 == chunk.sizes[1];
    bound += whole_rows ? std::min(whole_chunk, region + 2 * (1u << 20)) : whole_chunk;
    exact += region;
    all_inside = all_inside && region == whole_chunk;
  }
  const uint64_t local = static_cast<uint64_t>(mine.sizes[0] * mine.sizes[1]) * 4;
  TORCH_CHECK(exact == local, "the chunks cover ", exact, " of ", local, " bytes");
  TORCH_CHECK(stats.bytes_read >= local && stats.bytes_read <= bound, "rank ", rank(), " read ", stats.bytes_read,
              " bytes for ", local, " (bound ", bound, ")");
  if (all_inside) TORCH_CHECK(stats.bytes_read == local, "read ", stats.bytes_read, " for ", local, " in whole chunks");
  std::printf("rank %d (%s from %s@%d): read %llu bytes for %llu (bound %llu)\n", rank(), layout.c_str(), saved.c_str(),
              saved_world, static_cast<unsigned long long>(stats.bytes_read), static_cast<unsigned long long>(local),
              static_cast<unsigned long long>(bound));
}

// ---- tests ---------------------------------------------------------------------------------

class CheckpointBoxes : public ::testing::Test {
 protected:
  RanksOptions with(std::map<std::string, std::string> vars) {
    RanksOptions o;
    o.timeout = std::chrono::seconds(240);
    o.env = std::move(vars);
    return o;
  }
  void save(int world, const std::string& layout, const std::string& dir) {
    EXPECT_RANKS_PASS(world, "boxes_save", with({{"SAVE_LAYOUT", layout}, {"CKPT_DIR", dir}}));
  }
  void load(int world, const std::string& layout, const std::string& dir, const std::string& resave = "") {
    auto o = with({{"LOAD_LAYOUT", layout}, {"CKPT_DIR", dir}});
    if (!resave.empty()) o.env["RESAVE_DIR"] = resave;
    EXPECT_RANKS_PASS(world, "boxes_load", o);
  }
  static nlohmann::json index_of(const std::string& dir) {
    std::ifstream in(fs::path(dir) / "index.json");
    return nlohmann::json::parse(in);
  }
  TempDir tmp_{"ckpt_boxes"};
};

TEST_F(CheckpointBoxes, SplitAlongDim1AtTwoRanksLoadsInAnyLayout) {
  const std::string dir = tmp_ / "cols2";
  save(2, "cols", dir);
  // Format 2: each chunk is a box in every dimension.
  const auto index = index_of(dir);
  EXPECT_EQ(index.at("version"), 2);
  const auto& chunks = index.at("tensors").at("a").at("chunks");
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[1].at("offsets"), nlohmann::json({0, 5}));
  EXPECT_EQ(chunks[1].at("sizes"), nlohmann::json({12, 5}));
  EXPECT_EQ(index.at("tensors").at("c").at("chunks")[0].at("sizes"), nlohmann::json({5, 3, 4}));
  EXPECT_EQ(index.at("tensors").at("s").at("chunks")[0].at("sizes"), nlohmann::json::array());
  load(3, "rows", dir);
  load(1, "whole", dir);
  load(4, "grid", dir);
  load(2, "cols", dir);
}

// 2 x 2 -> 3 ranks along dim 0 -> one process -> 2 ranks along dim 1 -> 2 x 2: every link loads
// the previous link's save bitwise and saves it again in its own layout.
TEST_F(CheckpointBoxes, TwoDimsAtFourRanksChainThroughEveryLayout) {
  const std::string grid = tmp_ / "grid4", rows = tmp_ / "rows3", one = tmp_ / "one", cols = tmp_ / "cols2";
  save(4, "grid", grid);
  EXPECT_EQ(index_of(grid).at("tensors").at("a").at("chunks").size(), 4u);
  load(3, "rows", grid, rows);
  load(1, "whole", rows, one);
  load(2, "cols", one, cols);
  load(4, "grid", cols);
  load(4, "grid", grid);
}

TEST_F(CheckpointBoxes, ReplicatedBoxesAreWrittenOnce) {
  const std::string dir = tmp_ / "replicated";
  save(4, "replicated_cols", dir);
  const auto index = index_of(dir);
  EXPECT_EQ(index.at("tensors").at("a").at("chunks").size(), 2u);  // 2 boxes, each held by 2 ranks
  EXPECT_EQ(index.at("tensors").at("s").at("chunks").size(), 1u);
  load(3, "rows", dir);
  load(2, "replicated_cols", dir);
  // Written by every holder, the same boxes overlap: refused before anything is committed.
  const std::string twice = tmp_ / "twice";
  EXPECT_RANKS_PASS(4, "boxes_save_replicas_twice", with({{"CKPT_DIR", twice}}));
  EXPECT_FALSE(ckpt::is_committed(twice));
}

TEST_F(CheckpointBoxes, FullStateDictsGatherAnyLayout) {
  EXPECT_RANKS_PASS(2, "boxes_state_dict", with({{"LOAD_LAYOUT", "cols"}}));
  EXPECT_RANKS_PASS(4, "boxes_state_dict", with({{"LOAD_LAYOUT", "grid"}}));
  EXPECT_RANKS_PASS(4, "boxes_state_dict", with({{"LOAD_LAYOUT", "replicated_cols"}}));
}

TEST_F(CheckpointBoxes, GatherStepsRebuildTensorsSplitAlongTwoDims) {
  EXPECT_RANKS_PASS(4, "gather_steps", with({}));
  EXPECT_RANKS_PASS(3, "gather_steps", with({}));
}

TEST_F(CheckpointBoxes, BytesReadStayBounded) {
  const std::string grid = tmp_ / "big_grid", cols = tmp_ / "big_cols";
  EXPECT_RANKS_PASS(4, "big_boxes_save", with({{"SAVE_LAYOUT", "grid"}, {"CKPT_DIR", grid}}));
  auto load = [&](int world, const std::string& layout, const std::string& dir, const std::string& saved,
                  int saved_world) {
    EXPECT_RANKS_PASS(world, "big_boxes_load",
                      with({{"LOAD_LAYOUT", layout},
                            {"CKPT_DIR", dir},
                            {"SAVE_LAYOUT", saved},
                            {"SAVE_WORLD", std::to_string(saved_world)}}));
  };
  load(3, "rows", grid, "grid", 4);  // whole rows of each chunk: bytes + at most a block per end
  load(2, "cols", grid, "grid", 4);  // chunks inside the box: read exactly
  EXPECT_RANKS_PASS(2, "big_boxes_save", with({{"SAVE_LAYOUT", "cols"}, {"CKPT_DIR", cols}}));
  load(3, "rows", cols, "cols", 2);
  load(1, "whole", cols, "cols", 2);  // everything, exactly once
}

// A checkpoint written by the format-1 code (tests/checkpoint/data/v1: dim-0 row chunks saved at
// 2 ranks) loads in one process, at 3 ranks with fully_shard, and into boxes along dim 1; saved
// again it is format 2 and loads the same.
TEST_F(CheckpointBoxes, FormatOneCheckpointStillLoads) {
  const auto old_index = index_of(fixture_dir());
  ASSERT_EQ(old_index.at("version"), 1);
  ASSERT_TRUE(old_index.at("tensors").at("model.w").at("chunks")[0].contains("row_offset"));
  {
    FixtureNet net;
    ckpt::ScalarState progress;
    ckpt::load(fixture_dir(), ckpt::State{net.ptr(), nullptr, {{"progress", &progress}}});
    check_fixture_net(net, progress);
  }
  const std::string resaved = tmp_ / "resaved_v2";
  EXPECT_RANKS_PASS(3, "v1_load_fsdp", with({{"RESAVE_DIR", resaved}}));
  EXPECT_RANKS_PASS(2, "v1_load_cols", with({}));
  EXPECT_EQ(index_of(resaved).at("version"), 2);
  FixtureNet net;
  ckpt::ScalarState progress;
  ckpt::load(resaved, ckpt::State{net.ptr(), nullptr, {{"progress", &progress}}});
  check_fixture_net(net, progress);
}

// ---- errors (one process) ------------------------------------------------------------------

namespace {
std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}
}  // namespace

TEST_F(CheckpointBoxes, BoxesThatDoNotTileAreRefused) {
  const auto a = full_tensors().at("a");
  ckpt::State half;  // the left half of 'a' only: nobody holds the rest
  half.tensors["a"] = ckpt::ShardedTensor{a.narrow(1, 0, 5).contiguous(), {12, 10}, {0, 0}};
  const std::string dir = tmp_ / "half";
  EXPECT_ERROR_CONTAINS(
      ckpt::save(dir, half),
      "the chunks of 'a' (shape [12, 10]) do not tile it exactly: the chunks cover 60 of its 120 elements");
  EXPECT_FALSE(ckpt::is_committed(dir));

  ckpt::State outside;
  outside.tensors["a"] = ckpt::ShardedTensor{a.narrow(0, 0, 4).contiguous(), {12, 10}, {10, 0}};
  EXPECT_ERROR_CONTAINS(ckpt::save(dir, outside),
                        "State::tensors['a'] is a box at [10, 0] of size [4, 10] that does not fit");
  ckpt::State flat;
  flat.tensors["a"] = ckpt::ShardedTensor{a, {120}, {0}};
  EXPECT_ERROR_CONTAINS(ckpt::save(dir, flat), "give one offset and one global size per dimension");
  EXPECT_ERROR_CONTAINS(ckpt::save(dir, ckpt::State{}), "State::model is null and State::tensors empty");
}

// Damaged chunk records in index.json: overlapping, out of range, missing a part, of the wrong
// rank, a chunk's data corrupted, a format from the future: one clear error each.
TEST_F(CheckpointBoxes, DamagedChunksGiveClearErrors) {
  const std::string dir = tmp_ / "good";
  {
    ckpt::State state;
    state.tensors = entries(full_tensors(), "whole", true);
    ckpt::save(dir, state);
  }
  const fs::path index_path = fs::path(dir) / "index.json";
  const std::string good = read_text(index_path);
  auto load_error = [&](const std::function<void(nlohmann::json&)>& damage, const std::string& needle) {
    auto j = nlohmann::json::parse(good);
    damage(j);
    write_text(index_path, j.dump(1));
    ckpt::State state;
    state.tensors = entries(full_tensors(), "whole", false);
    EXPECT_ERROR_CONTAINS(ckpt::load(dir, state), needle);
  };
  auto chunks = [](nlohmann::json& j) -> nlohmann::json& { return j.at("tensors").at("a").at("chunks"); };
  load_error(
      [&](auto& j) { chunks(j).push_back(chunks(j)[0]); },
      "the chunks of 'a' (shape [12, 10]) do not tile it exactly: the chunk at [0, 0] of size [12, 10] overlaps");
  load_error([&](auto& j) { chunks(j)[0]["offsets"] = {1, 0}; }, "of size [12, 10] lies outside the tensor");
  load_error([&](auto& j) { chunks(j)[0]["sizes"] = {12, 9}; }, "the chunks cover 108 of its 120 elements");
  load_error([&](auto& j) { chunks(j)[0]["sizes"] = {120}; },
             "has offsets of 2 and sizes of 1 dimensions, the tensor 2");
  load_error([&](auto& j) { j["version"] = 3; }, "reads versions 1 to 2; load it with a newer build");
  // Chunk sizes that tile but disagree with the data file's tensor.
  load_error(
      [&](auto& j) {
        chunks(j)[0]["sizes"] = {6, 10};
        chunks(j).push_back(chunks(j)[0]);
        chunks(j)[1]["offsets"] = {6, 0};
      },
      "bytes but the index describes");

  // A flipped byte in the data file: the box read verifies its blocks.
  write_text(index_path, good);
  fs::path data;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("data-", 0) == 0) data = e.path();
  std::string bytes = read_text(data);
  bytes[bytes.size() - 3] ^= 0x5a;
  write_text(data, bytes);
  ckpt::State state;
  state.tensors = entries(full_tensors(), "whole", false);
  ckpt::LoadOptions o;
  EXPECT_ERROR_CONTAINS(ckpt::load(dir, state, o), "checksum mismatch");
}

// One 18 MB chunk (18 checksum blocks: read in more than one window) loaded into part boxes in
// one process: a column box (a run per row, runs crossing window ends) and a row box (one run
// across windows); loads need not tile, only saves.
TEST_F(CheckpointBoxes, LargeChunkReadsInWindows) {
  const at::Tensor big = at::arange(4500 * 1000, at::kFloat).reshape({4500, 1000});
  const std::string dir = tmp_ / "large";
  ckpt::State whole;
  whole.tensors["big"] = ckpt::ShardedTensor{big, {4500, 1000}, {0, 0}};
  ckpt::save(dir, whole);
  const uint64_t total = 4500ull * 1000 * 4;
  for (const auto& [offsets, sizes] : std::vector<std::pair<std::vector<int64_t>, std::vector<int64_t>>>{
           {{0, 250}, {4500, 500}}, {{100, 0}, {4300, 1000}}, {{4499, 999}, {1, 1}}}) {
    ckpt::State part;
    part.tensors["big"] = ckpt::ShardedTensor{at::zeros(sizes, at::kFloat), {4500, 1000}, offsets};
    const auto stats = ckpt::load(dir, part);
    EXPECT_TRUE(
        at::equal(part.tensors["big"].local, big.narrow(0, offsets[0], sizes[0]).narrow(1, offsets[1], sizes[1])))
        << detail_text(offsets);
    const uint64_t local = static_cast<uint64_t>(sizes[0] * sizes[1]) * 4;
    EXPECT_LE(stats.bytes_read, sizes[1] == 1000 ? local + 2 * (1u << 20) : total) << detail_text(offsets);
    EXPECT_GE(stats.bytes_read, local);
  }
}
