// Full state dicts and safetensors export/import with real processes: consolidated weights on
// rank 0, broadcast-from-rank-0 loading, optimizer state round trips, and an exported Hugging Face
// layout read back by an independent reader and loaded shard-locally at another world size.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "fsdp/fsdp.h"
#include "minimal_safetensors_reader.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
namespace ckpt = fsdp::checkpoint;
namespace fs = std::filesystem;
using fsdp::models::GPT;

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v, name, " is not set");
  return v;
}

GPT model_with_seed(int seed) {
  torch::manual_seed(seed);
  return GPT(uneven_config());
}

void shard(GPT& model) {
  for (auto& block : model->blocks) fsdp::fully_shard(block);
  fsdp::fully_shard(model);
}

std::map<std::string, at::Tensor> full_params(GPT& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// Every shard of `model` equals the rows of `want` exactly.
void check_shards_equal(GPT& model, const std::map<std::string, at::Tensor>& want) {
  TORCH_CHECK(check_shards_match(model, want, 0.0) == 0.0);
}

}  // namespace

FSDP_RANK_WORKER(full_state_dict_on_rank0) {
  auto model = model_with_seed(11);
  const auto want = full_params(model);
  shard(model);
  auto sd = ckpt::get_model_state_dict(*model, {.full_state_dict = true, .cpu_offload = true});
  if (fsdp::dist::rank() == 0) {
    TORCH_CHECK(sd.size() == want.size(), "rank 0 got ", sd.size(), " tensors");
    for (const auto& [name, t] : want) TORCH_CHECK(at::equal(sd.at(name), t), name, " differs");
  } else {
    TORCH_CHECK(sd.empty(), "cpu_offload: only rank 0 keeps the full tensors");
  }
  // Sharded (default): this rank's shards, sharing storage with parameters() (no copy).
  auto local = ckpt::get_model_state_dict(*model);
  for (const auto& p : model->named_parameters()) {
    const at::Tensor& t = local.at(p.key());
    TORCH_CHECK(t.sizes() == p.value().sizes() && (t.numel() == 0 || t.data_ptr() == p.value().data_ptr()), p.key());
  }
}

FSDP_RANK_WORKER(broadcast_from_rank0) {
  auto source = model_with_seed(12);
  const auto want = full_params(source);
  auto model = model_with_seed(13);
  shard(model);
  ckpt::StateDict sd;
  if (fsdp::dist::rank() == 0) sd = want;
  auto result = ckpt::set_model_state_dict(*model, sd, {.broadcast_from_rank0 = true});
  TORCH_CHECK(result.missing_keys.empty() && result.unexpected_keys.empty());
  check_shards_equal(model, want);

  // Strict: an extra key on rank 0 fails on every rank.
  if (fsdp::dist::rank() == 0) sd["not.a.parameter"] = at::zeros({1});
  bool threw = false;
  try {
    ckpt::set_model_state_dict(*model, sd, {.broadcast_from_rank0 = true});
  } catch (const ckpt::CheckpointError& e) {
    threw = std::string(e.what()).find("unexpected") != std::string::npos;
  }
  TORCH_CHECK(threw, "strict load with an unexpected key did not fail on rank ", fsdp::dist::rank());

  // Each rank passing the full dict (no broadcast) takes its rows; a shard-shaped dict round trips.
  auto other = model_with_seed(14);
  shard(other);
  ckpt::set_model_state_dict(*other, want, {.full_state_dict = true});
  check_shards_equal(other, want);
  auto local = ckpt::get_model_state_dict(*model);
  ckpt::set_model_state_dict(*other, local);
  check_shards_equal(other, want);
}

FSDP_RANK_WORKER(optimizer_state_round_trip) {
  const auto c = uneven_config();
  auto model = parity_model(c);
  shard(model);
  auto opt = parity_optimizer(*model);
  const int world = fsdp::dist::world_size(), rank = fsdp::dist::rank();
  for (int s = 0; s < 2; ++s) {
    opt.zero_grad();
    auto data = global_batch(c, 6, s, 0).narrow(0, rank * (6 / world), 6 / world);
    fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size))
        .backward();
    opt.step();
  }
  auto full = ckpt::get_optimizer_state_dict(*model, opt, {.full_state_dict = true});
  TORCH_CHECK(!full.empty(), "no optimizer state");
  for (const auto& [name, t] : full)
    if (name.size() > 4 && name.substr(name.size() - 4) == "step") TORCH_CHECK(t.item<int64_t>() == 2, name);

  // A fresh model + optimizer at the same world size: set from rank 0's full dict, get back equal.
  auto fresh = parity_model(c);
  shard(fresh);
  auto fresh_opt = parity_optimizer(*fresh);
  ckpt::StateDict from_rank0;
  if (rank == 0) from_rank0 = full;
  ckpt::set_optimizer_state_dict(*fresh, fresh_opt, from_rank0, {.broadcast_from_rank0 = true});
  auto again = ckpt::get_optimizer_state_dict(*fresh, fresh_opt, {.full_state_dict = true});
  TORCH_CHECK(again.size() == full.size(), again.size(), " vs ", full.size());
  for (const auto& [name, t] : full) TORCH_CHECK(at::equal(again.at(name), t), name, " differs after the round trip");
}

FSDP_RANK_WORKER(export_split_files) {
  auto model = model_with_seed(15);
  shard(model);
  // ~4 KB per file: the GPT splits into several files plus the index.
  auto files = ckpt::export_safetensors(*model, env("EXPORT_DIR") + "/model.safetensors", {.max_file_bytes = 4096});
  if (fsdp::dist::rank() == 0) TORCH_CHECK(files.size() > 2, "expected a split export, got ", files.size(), " files");
  // And the default: one file.
  files = ckpt::export_safetensors(*model, env("EXPORT_DIR") + "/single/model.safetensors");
  if (fsdp::dist::rank() == 0) TORCH_CHECK(files.size() == 1, "expected one file, got ", files.size());
}

FSDP_RANK_WORKER(import_exported) {
  auto model = model_with_seed(16);
  shard(model);
  auto result = ckpt::load_safetensors(*model, env("EXPORT_DIR") + "/model.safetensors.index.json");
  TORCH_CHECK(result.missing_keys.empty() && result.unexpected_keys.empty());
  auto source = model_with_seed(15);
  check_shards_equal(model, full_params(source));
}

namespace {

class StateDictTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fsdp_sd_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  RanksOptions options() {
    RanksOptions o;
    o.timeout = std::chrono::seconds(180);
    o.env["EXPORT_DIR"] = dir_.string();
    return o;
  }
  fs::path dir_;
};

}  // namespace

TEST_F(StateDictTest, FullStateDictOnRankZero) { EXPECT_RANKS_PASS(2, "full_state_dict_on_rank0", options()); }
TEST_F(StateDictTest, BroadcastFromRankZeroAndStrictKeys) {
  EXPECT_RANKS_PASS(2, "broadcast_from_rank0", options());
  EXPECT_RANKS_PASS(3, "broadcast_from_rank0", options());
}
TEST_F(StateDictTest, OptimizerStateRoundTrip) { EXPECT_RANKS_PASS(3, "optimizer_state_round_trip", options()); }

TEST_F(StateDictTest, ExportReadByAnIndependentReaderAndImportedAtAnotherWorldSize) {
  EXPECT_RANKS_PASS(2, "export_split_files", options());
  // The Hugging Face layout: every tensor in exactly one listed file, bytes equal to the model.
  auto want = model_with_seed(15);
  std::map<std::string, MinimalTensor> seen;
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    if (e.path().extension() != ".safetensors") continue;
    ++files;
    for (auto& [name, t] : minimal_read_safetensors(e.path().string())) {
      EXPECT_TRUE(seen.emplace(name, t).second) << name << " in two files";
    }
  }
  EXPECT_GT(files, 2);
  EXPECT_TRUE(fs::exists(dir_ / "model.safetensors.index.json"));
  for (const auto& p : want->named_parameters()) {
    ASSERT_TRUE(seen.count(p.key())) << p.key();
    const auto& t = seen.at(p.key());
    EXPECT_EQ(t.dtype, "F32");
    EXPECT_EQ(t.shape, p.value().sizes().vec());
    ASSERT_EQ(t.bytes.size(), static_cast<size_t>(p.value().nbytes()));
    EXPECT_EQ(std::memcmp(t.bytes.data(), p.value().data_ptr(), t.bytes.size()), 0) << p.key();
  }
  // The single-file export holds the same tensors.
  auto single = minimal_read_safetensors((dir_ / "single" / "model.safetensors").string());
  EXPECT_EQ(single.size(), seen.size());
  for (const auto& [name, t] : single) EXPECT_EQ(t.bytes, seen.at(name).bytes) << name;
  EXPECT_RANKS_PASS(3, "import_exported", options());
  EXPECT_RANKS_PASS(1, "import_exported", options());
}
