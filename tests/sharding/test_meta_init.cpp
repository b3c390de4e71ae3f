// Meta-device initialisation: a GPT built on torch::kMeta, sharded, then materialised shard by shard
// holds exactly the values of the same GPT built and initialised whole, and each rank's memory grows
// by about 1/N of the model while materialising.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdint>
#include <iostream>

#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "multiprocess.h"

using fsdp::models::GPT;

namespace {

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

fsdp::models::GPTConfig big_config() {
  fsdp::models::GPTConfig c;
  c.vocab_size = 4099;  // uneven on purpose
  c.block_size = 257;
  c.n_layer = 4;
  c.n_head = 8;
  c.n_embd = 512;
  c.init_seed = 1234;
  return c;
}

}  // namespace

FSDP_RANK_WORKER(meta_init) {
  const int n = fsdp::dist::world_size(), rank = fsdp::dist::rank();
  auto c = big_config();

  // 1. Build on meta and shard: no parameter memory at all.
  c.device = torch::kMeta;
  GPT model(c);
  double full_bytes = 0;
  for (const auto& p : model->parameters()) full_bytes += static_cast<double>(p.numel()) * 4;
  for (auto& b : model->blocks) fsdp::fully_shard(b);
  fsdp::fully_shard(model);
  for (const auto& p : model->parameters()) TORCH_CHECK(p.is_meta(), "sharding must not allocate");

  // 2. Materialise the shards and initialise them: peak memory grows by about 1/N of the model.
  const double before = peak_rss_bytes();
  fsdp::to_empty(*model, torch::kCPU);
  model->reset_parameters();
  const double grown = peak_rss_bytes() - before;
  double shard_bytes = 0;
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.device().is_cpu(), "materialised shards live on the CPU");
    shard_bytes += static_cast<double>(p.nbytes());
  }
  TORCH_CHECK(shard_bytes <= full_bytes / n * 1.02, "shards hold ", shard_bytes, " bytes of ", full_bytes);
  TORCH_CHECK(grown <= full_bytes / n * 1.25 + 8e6, "peak memory grew by ", grown / 1e6, " MB while materialising a ",
              full_bytes / 1e6, " MB model over ", n, " ranks");

  // 3. The same values as the model built whole (streams keyed by name and row, not by rank).
  c.device = torch::kCPU;
  GPT whole(c);
  auto want = whole->named_parameters();
  for (const auto& p : model->named_parameters()) {
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not a shard");
    at::Tensor full = want[p.key()];
    TORCH_CHECK(p.value().equal(full.narrow(0, info->dim0_offset, info->local_rows)), p.key(),
                ": shard differs from the whole model's rows");
  }

  // 4. And it trains.
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto tokens = torch::randint(c.vocab_size, {2, 9}, at::kLong);
  auto loss = fsdp::models::gpt_loss(fsdp::call(model, tokens.narrow(1, 0, 8)), tokens.narrow(1, 1, 8));
  loss.backward();
  opt.step();
  TORCH_CHECK(std::isfinite(loss.item<double>()));
  if (rank == 0) {
    std::cout << "model " << full_bytes / 1e6 << " MB; this rank's shards " << shard_bytes / 1e6
              << " MB; peak memory grew by " << grown / 1e6 << " MB while materialising" << std::endl;
  }
}

// Meta-device init under CPUOffloadPolicy (FSDP2: the shards stay meta until materialised, then
// live on the CPU): sharding allocates nothing, to_empty + reset_parameters give the whole model's
// rows, and a step trains.
FSDP_RANK_WORKER(meta_init_offload) {
  auto c = big_config();
  c.n_layer = 2;
  c.n_embd = 64;
  c.device = torch::kMeta;
  GPT model(c);
  fsdp::FullyShardOptions o;
  o.offload_policy = fsdp::CPUOffloadPolicy{/*pin_memory=*/true};
  for (auto& b : model->blocks) fsdp::fully_shard(b, o);
  fsdp::fully_shard(model, o);
  for (const auto& p : model->parameters()) TORCH_CHECK(p.is_meta(), "sharding must not allocate");
  fsdp::to_empty(*model, torch::kCPU);
  model->reset_parameters();
  c.device = torch::kCPU;
  GPT whole(c);
  auto want = whole->named_parameters();
  for (const auto& p : model->named_parameters()) {
    TORCH_CHECK(p.value().device().is_cpu(), p.key(), " is not on the CPU");
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not a shard");
    TORCH_CHECK(p.value().equal(want[p.key()].narrow(0, info->dim0_offset, info->local_rows)), p.key(),
                ": shard differs from the whole model's rows");
  }
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-3));
  auto tokens = torch::randint(c.vocab_size, {2, 9}, at::kLong);
  auto loss = fsdp::models::gpt_loss(fsdp::call(model, tokens.narrow(1, 0, 8)), tokens.narrow(1, 1, 8));
  loss.backward();
  opt.step();
  TORCH_CHECK(std::isfinite(loss.item<double>()));
}

TEST(MetaInit, ShardsMatchTheWholeModelAndMemoryIsOneNth) {
  for (int world : {2, 3}) {
    auto r = fsdp::testing::run_ranks(world, "meta_init");
    EXPECT_TRUE(r.all_ok()) << r.report();
    if (r.all_ok()) std::cout << world << " ranks: " << r.ranks[0].output;
  }
}

TEST(MetaInit, OffloadedShardsStayMetaUntilMaterialised) {
  auto r = fsdp::testing::run_ranks(2, "meta_init_offload");
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(MetaInit, ForwardBeforeMaterialisingIsRefused) {
  auto c = big_config();
  c.n_layer = 1;
  c.n_embd = 16;
  c.n_head = 2;
  c.device = torch::kMeta;
  GPT model(c);
  fsdp::fully_shard(model);
  try {
    fsdp::call(model, torch::zeros({1, 4}, at::kLong));
    ADD_FAILURE() << "forward on meta parameters must fail";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("fsdp::to_empty"), std::string::npos) << e.what();
  }
  fsdp::dist::destroy_distributed();
}

// On the CPU, fsdp::init's values are pinned: row r of a parameter holds what a CPU generator
// seeded with splitmix64(seed + r) draws for one full row (values drawn in float, then cast), so
// models initialised before stay bit-identical. Rows of 300 values make the [5000, 300] tensor
// cross the drawing chunks (1M values) at row 3495; rows of one value take the unvectorised path.
TEST(MetaInit, CpuValuesAreEachRowsOwnStream) {
  auto splitmix64 = [](uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  const uint64_t seed = fsdp::init::param_seed(99, "layer.weight");
  auto expected = [&](at::IntArrayRef shape, bool normal, at::ScalarType dtype) {
    const int64_t rows = shape[0];
    int64_t row_numel = 1;
    for (size_t d = 1; d < shape.size(); ++d) row_numel *= shape[d];
    std::vector<at::Tensor> out;
    for (int64_t r = 0; r < rows; ++r) {
      auto gen = at::detail::createCPUGenerator(splitmix64(seed + static_cast<uint64_t>(r)));
      at::Tensor v = normal ? at::normal(0.5, 2.0, {row_numel}, gen, at::TensorOptions().dtype(at::kFloat))
                            : at::empty({row_numel}, at::kFloat).uniform_(-3.0, 1.0, gen);
      out.push_back(v.to(dtype));
    }
    return at::stack(out).view(shape);
  };
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (std::vector<int64_t> shape : {std::vector<int64_t>{5000, 300}, std::vector<int64_t>{3000}}) {
      at::Tensor p = at::empty(shape, dtype);
      fsdp::init::normal_(p, 0.5, 2.0, seed);
      EXPECT_TRUE(p.equal(expected(shape, true, dtype))) << "normal_ " << p.sizes() << " " << dtype;
      fsdp::init::uniform_(p, -3.0, 1.0, seed);
      EXPECT_TRUE(p.equal(expected(shape, false, dtype))) << "uniform_ " << p.sizes() << " " << dtype;
    }
  }
}
