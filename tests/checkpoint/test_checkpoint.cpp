// Sharded checkpoints with real processes: save at N=2, load at N=1 and N=3 (exact bytes, and
// continued training equal to an uninterrupted single-process run), a save killed between its
// files leaves the previous checkpoint loadable, async save captures the state at the call, and
// damaged or mismatched checkpoints give clear errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/compat/optim.h"
#include "fsdp/debug/fault_injection.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
namespace ckpt = fsdp::checkpoint;
namespace fs = std::filesystem;
using fsdp::models::GPT;

namespace {

constexpr int kSaveStep = 5;    // the checkpoint holds the state after this many steps
constexpr int kSteps = 10;      // an uninterrupted run's length
constexpr int64_t kBatch = 12;  // divisible by 1, 2, 3 and 4
constexpr double kTolerance = 1e-6;

std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v, name, " is not set");
  return v;
}

// MODE (env): fsdp (default) | hsdp (MESH "RxS", default 2x2) | replicate. The checkpoint format
// does not depend on the mode, so any mode loads what any other saved.
void parallelize(GPT& model) {
  const char* m = std::getenv("MODE");
  const std::string mode = m ? m : "fsdp";
  if (mode == "replicate") {
    fsdp::replicate(model);
    return;
  }
  fsdp::FullyShardOptions options;
  if (mode == "hsdp") {
    const char* mesh = std::getenv("MESH");
    const std::string shape = mesh ? mesh : "2x2";
    const auto x = shape.find('x');
    options.mesh = fsdp::init_device_mesh({std::stoll(shape.substr(0, x)), std::stoll(shape.substr(x + 1))},
                                          {"replicate", "shard"});
  }
  for (auto& block : model->blocks) fsdp::fully_shard(block, options);
  fsdp::fully_shard(model, options);
}

// Like check_shards_match, for sharded (any mesh) and replicated (whole) parameters alike.
double check_params_match(GPT& model, const std::map<std::string, at::Tensor>& reference, double tolerance) {
  double worst = 0;
  for (const auto& p : model->named_parameters()) {
    at::Tensor want = reference.at(p.key());
    if (auto info = fsdp::shard_info(p.value())) want = want.narrow(0, info->dim0_offset, info->local_rows);
    if (want.numel() == 0) continue;
    const double diff = ((p.value().detach() - want).abs() / want.abs().clamp_min(1.0)).max().item<double>();
    TORCH_CHECK(diff <= tolerance, p.key(), " differs from the single-process run by ", diff);
    worst = std::max(worst, diff);
  }
  return worst;
}

// One optimizer step of the parity recipe on this rank's slice of the global batch; returns the
// global mean loss.
double train_step(GPT& model, torch::optim::AdamW& opt, const fsdp::models::GPTConfig& c, int step) {
  auto world = fsdp::dist::world_comm();
  const int64_t local = kBatch / world->size();
  opt.zero_grad();
  auto data = global_batch(c, kBatch, step, 0).narrow(0, world->rank() * local, local);
  auto loss =
      fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
  loss.backward();
  opt.step();
  auto global = at::tensor({loss.item<double>()}, at::kDouble);
  world->all_reduce(global, fsdp::comm::ReduceOp::Avg);
  return global.item<double>();
}

struct Trainer {
  GPT model{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  ckpt::ScalarState progress;
  ckpt::State state() { return ckpt::State{model.ptr(), opt.get(), {{"progress", &progress}}}; }
};

Trainer sharded_trainer(int seed = 42) {
  Trainer t;
  t.model = parity_model(uneven_config());
  if (seed != 42) {  // a different start, so that a load that did nothing cannot pass
    torch::manual_seed(seed);
    t.model = GPT(uneven_config());
  }
  parallelize(t.model);
  t.opt = std::make_unique<torch::optim::AdamW>(parity_optimizer(*t.model));
  return t;
}

// An unsharded model + optimizer in the test process (a world of one, no process group).
Trainer local_trainer() {
  torch::manual_seed(3);
  Trainer t;
  t.model = GPT(uneven_config());
  t.opt = std::make_unique<torch::optim::AdamW>(parity_optimizer(*t.model));
  return t;
}

void expect_same_state(Trainer& a, Trainer& b) {
  auto pa = a.model->named_parameters(), pb = b.model->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    const at::Tensor& q = pb[p.key()];
    EXPECT_TRUE(at::equal(p.value(), q)) << p.key();
    auto& sa =
        static_cast<torch::optim::AdamWParamState&>(*a.opt->state().at(fsdp::compat::optimizer_state_key(p.value())));
    auto& sb = static_cast<torch::optim::AdamWParamState&>(*b.opt->state().at(fsdp::compat::optimizer_state_key(q)));
    EXPECT_TRUE(at::equal(sa.exp_avg(), sb.exp_avg())) << p.key();
    EXPECT_TRUE(at::equal(sa.exp_avg_sq(), sb.exp_avg_sq())) << p.key();
    EXPECT_EQ(sa.step(), sb.step()) << p.key();
  }
  EXPECT_EQ(a.progress.ints, b.progress.ints);
}

}  // namespace

// ---- rank workers ------------------------------------------------------------------------

FSDP_RANK_WORKER(train_then_save) {
  auto t = sharded_trainer();
  for (int s = 0; s < kSaveStep; ++s) train_step(t.model, *t.opt, uneven_config(), s);
  t.progress.ints["step"] = kSaveStep;
  ckpt::save(env("CKPT_DIR"), t.state());
}

// Loads at this world size, checks the loaded shards against the single-process run, re-saves
// (for the exact comparison in the test process), then trains on: losses and final shards must
// equal an uninterrupted single-process run.
FSDP_RANK_WORKER(load_resave_continue) {
  const auto c = uneven_config();
  auto t = sharded_trainer(/*seed=*/7);
  ckpt::load(env("CKPT_DIR"), t.state());
  TORCH_CHECK(t.progress.ints.at("step") == kSaveStep, "progress not restored");
  const auto at_save = train_reference(c, kSaveStep, kBatch, 1);
  check_params_match(t.model, at_save.parameters, kTolerance);
  ckpt::save(env("RESAVE_DIR"), t.state());

  const auto uninterrupted = train_reference(c, kSteps, kBatch, 1);
  std::vector<double> losses, want;
  for (int s = kSaveStep; s < kSteps; ++s) {
    losses.push_back(train_step(t.model, *t.opt, c, s));
    want.push_back(uninterrupted.losses[s]);
  }
  check_losses_match(losses, want, kTolerance);
  const double worst = check_params_match(t.model, uninterrupted.parameters, kTolerance);
  if (fsdp::dist::rank() == 0)
    std::cout << "resumed at " << fsdp::dist::world_size() << " ranks: losses " << losses.front() << " .. "
              << losses.back() << ", worst shard difference " << worst << std::endl;
}

// Saves at step 5, trains one more step, then saves again into the same directory with one rank
// aborting right after writing its data file: the index of the first save must survive.
FSDP_RANK_WORKER(save_then_die_mid_save) {
  auto t = sharded_trainer();
  for (int s = 0; s < kSaveStep; ++s) train_step(t.model, *t.opt, uneven_config(), s);
  t.progress.ints["step"] = kSaveStep;
  ckpt::save(env("CKPT_DIR"), t.state());
  train_step(t.model, *t.opt, uneven_config(), kSaveStep);
  t.progress.ints["step"] = kSaveStep + 1;
  if (fsdp::dist::rank() == std::atoi(env("DYING_RANK").c_str())) ckpt::set_save_faults({.abort_after_files = 1});
  ckpt::save(env("CKPT_DIR"), t.state());
  throw std::runtime_error("the second save should not have completed");
}

FSDP_RANK_WORKER(async_save_then_train_on) {
  auto t = sharded_trainer();
  for (int s = 0; s < kSaveStep; ++s) train_step(t.model, *t.opt, uneven_config(), s);
  t.progress.ints["step"] = kSaveStep;
  auto pending = ckpt::async_save(env("CKPT_DIR"), t.state());
  // Training changes the parameters while the files are written; the save holds step 5's state.
  for (int s = kSaveStep; s < kSaveStep + 2; ++s) train_step(t.model, *t.opt, uneven_config(), s);
  pending.wait();
  TORCH_CHECK(pending.ready());
  TORCH_CHECK(ckpt::is_committed(env("CKPT_DIR")));
}

// A [4000, 700] float parameter: 11.2 MB, so each rank's chunk spans several 1 MiB checksum blocks
// and a reader at another world size starts and ends inside blocks and chunks.
constexpr int64_t kBigRows = 4000, kBigCols = 700;
struct BigImpl : torch::nn::Module {
  at::Tensor w;
  BigImpl() { w = register_parameter("w", at::zeros({kBigRows, kBigCols})); }
  at::Tensor forward(const at::Tensor& x) { return x.matmul(w.t()); }
};
TORCH_MODULE(Big);

at::Tensor big_values() { return at::arange(kBigRows * kBigCols, at::kFloat).reshape({kBigRows, kBigCols}); }

FSDP_RANK_WORKER(big_save) {
  Big big;
  {
    at::NoGradGuard g;
    big->w.copy_(big_values());
  }
  fsdp::fully_shard(big);
  ckpt::save(env("CKPT_DIR"), ckpt::State{big.ptr()});
}

FSDP_RANK_WORKER(big_load) {
  Big big;
  fsdp::fully_shard(big);
  const auto stats = ckpt::load(env("CKPT_DIR"), ckpt::State{big.ptr()});
  const at::Tensor shard = big->parameters()[0];
  auto info = *fsdp::shard_info(shard);
  TORCH_CHECK(at::equal(shard, big_values().narrow(0, info.dim0_offset, info.local_rows)), "rows differ");
  // Only the overlapping rows were read, rounded out to whole 1 MiB checksum blocks: at most one
  // extra block at each end of each of the (at most 2, saved at N=2) overlapping chunks.
  const uint64_t local = static_cast<uint64_t>(shard.nbytes()), total = kBigRows * kBigCols * 4;
  if (info.local_rows < kBigRows) {
    TORCH_CHECK(stats.bytes_read <= local + 4 * (1u << 20), "read ", stats.bytes_read, " bytes for ", local);
    TORCH_CHECK(stats.bytes_read < total, "read the whole tensor (", stats.bytes_read, " bytes) for ", local);
  } else {
    TORCH_CHECK(stats.bytes_read == total, "read ", stats.bytes_read, " of ", total);
  }
}

// ---- tests ---------------------------------------------------------------------------------

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("fsdp_ckpt_" + std::to_string(::getpid()) + "_" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  RanksOptions with_dirs(const fs::path& dir, const fs::path& resave = {}) {
    RanksOptions o;
    o.timeout = std::chrono::seconds(240);
    o.env["CKPT_DIR"] = dir.string();
    if (!resave.empty()) o.env["RESAVE_DIR"] = resave.string();
    return o;
  }
  fs::path root_;
};

TEST_F(CheckpointTest, SaveAtTwoLoadsAtOneAndThreeAndTrainsOnIdentically) {
  const fs::path saved = root_ / "n2", resaved1 = root_ / "n1", resaved3 = root_ / "n3";
  EXPECT_RANKS_PASS(2, "train_then_save", with_dirs(saved));
  ASSERT_TRUE(ckpt::is_committed(saved.string()));
  EXPECT_RANKS_PASS(3, "load_resave_continue", with_dirs(saved, resaved3));
  EXPECT_RANKS_PASS(1, "load_resave_continue", with_dirs(saved, resaved1));
  EXPECT_RANKS_PASS(2, "load_resave_continue", with_dirs(saved, root_ / "n2again"));

  // Exact bytes: every parameter and AdamW state as saved at N=2 equals what N=1 and N=3 loaded.
  auto original = local_trainer(), from3 = local_trainer(), from1 = local_trainer();
  ckpt::load(saved.string(), original.state());
  ckpt::load(resaved3.string(), from3.state());
  ckpt::load(resaved1.string(), from1.state());
  expect_same_state(original, from3);
  expect_same_state(original, from1);
  EXPECT_EQ(original.progress.ints.at("step"), kSaveStep);
}

// HSDP (2x2, only replica 0 writes), replicate (whole tensors from rank 0) and FSDP load each
// other's checkpoints, and training continues as if uninterrupted.
TEST_F(CheckpointTest, HsdpReplicateAndFsdpLoadEachOthersCheckpoints) {
  const fs::path from_hsdp = root_ / "hsdp", from_replicate = root_ / "replicate";
  auto mode = [&](const char* m, const fs::path& dir, const fs::path& resave) {
    auto o = with_dirs(dir, resave);
    o.env["MODE"] = m;
    return o;
  };
  EXPECT_RANKS_PASS(4, "train_then_save", mode("hsdp", from_hsdp, {}));
  EXPECT_RANKS_PASS(2, "load_resave_continue", mode("fsdp", from_hsdp, root_ / "hsdp_to_fsdp"));
  EXPECT_RANKS_PASS(2, "load_resave_continue", mode("replicate", from_hsdp, root_ / "hsdp_to_replicate"));
  EXPECT_RANKS_PASS(2, "train_then_save", mode("replicate", from_replicate, {}));
  EXPECT_RANKS_PASS(4, "load_resave_continue", mode("hsdp", from_replicate, root_ / "replicate_to_hsdp"));
  EXPECT_RANKS_PASS(3, "load_resave_continue", mode("fsdp", from_replicate, root_ / "replicate_to_fsdp"));
  // Exact bytes through each mode's load + save.
  auto original = local_trainer(), via_fsdp = local_trainer(), via_replicate = local_trainer();
  ckpt::load(from_hsdp.string(), original.state());
  ckpt::load((root_ / "hsdp_to_fsdp").string(), via_fsdp.state());
  ckpt::load((root_ / "hsdp_to_replicate").string(), via_replicate.state());
  expect_same_state(original, via_fsdp);
  expect_same_state(original, via_replicate);
  auto original_r = local_trainer(), via_hsdp = local_trainer();
  ckpt::load(from_replicate.string(), original_r.state());
  ckpt::load((root_ / "replicate_to_hsdp").string(), via_hsdp.state());
  expect_same_state(original_r, via_hsdp);
}

TEST_F(CheckpointTest, SaveKilledBetweenFilesKeepsThePreviousCheckpoint) {
  for (const char* dying : {"0", "1"}) {
    const fs::path dir = root_ / (std::string("dying") + dying);
    auto options = with_dirs(dir);
    options.env["DYING_RANK"] = dying;
    options.env["FSDP_COLLECTIVE_TIMEOUT_S"] = "20";
    auto result = run_ranks(2, "save_then_die_mid_save", options);
    EXPECT_FALSE(result.all_ok()) << "a rank aborted; the job must fail";
    // The first save is still the committed one, whole and loadable.
    auto loaded = local_trainer();
    ckpt::load(dir.string(), loaded.state());
    EXPECT_EQ(loaded.progress.ints.at("step"), kSaveStep) << "dying rank " << dying;
    const auto at_save = train_reference(uneven_config(), kSaveStep, kBatch, 1);
    for (const auto& p : loaded.model->named_parameters())
      EXPECT_TRUE(at::allclose(p.value(), at_save.parameters.at(p.key()), 1e-6, 1e-6)) << p.key();
  }
}

TEST_F(CheckpointTest, AsyncSaveHoldsTheStateAtTheCall) {
  const fs::path dir = root_ / "async";
  EXPECT_RANKS_PASS(2, "async_save_then_train_on", with_dirs(dir));
  auto loaded = local_trainer();
  ckpt::load(dir.string(), loaded.state());
  const auto at_save = train_reference(uneven_config(), kSaveStep, kBatch, 1);
  for (const auto& p : loaded.model->named_parameters())
    EXPECT_TRUE(at::allclose(p.value(), at_save.parameters.at(p.key()), 1e-6, 1e-6)) << p.key();
}

TEST_F(CheckpointTest, LargeTensorReshardsAcrossChecksumBlocks) {
  const fs::path dir = root_ / "big";
  EXPECT_RANKS_PASS(2, "big_save", with_dirs(dir));
  EXPECT_RANKS_PASS(3, "big_load", with_dirs(dir));
  EXPECT_RANKS_PASS(1, "big_load", with_dirs(dir));
}

// ---- damaged and mismatched checkpoints (one process) --------------------------------------

namespace {

// The message of the CheckpointError that `fn` throws ("" when it does not throw).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const ckpt::CheckpointError& e) {
    return e.what();
  }
  return "";
}

fs::path only_data_file(const fs::path& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("data-", 0) == 0) return e.path();
  throw std::runtime_error("no data file in " + dir.string());
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void write_text(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
}

}  // namespace

class CheckpointErrors : public CheckpointTest {
 protected:
  void SetUp() override {
    CheckpointTest::SetUp();
    good_ = root_ / "good";
    auto t = local_trainer();
    const auto c = uneven_config();
    auto data = global_batch(c, kBatch, 0, 0);
    fsdp::models::gpt_loss(t.model->forward(data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size))
        .backward();
    t.opt->step();
    t.progress.ints["step"] = 1;
    ckpt::save(good_.string(), t.state());
  }
  fs::path good_;
};

TEST_F(CheckpointErrors, DirectoryWithoutCommittedCheckpoint) {
  fs::create_directories(root_ / "empty");
  auto t = local_trainer();
  EXPECT_NE(error_of([&] { ckpt::load((root_ / "empty").string(), t.state()); }).find("no committed checkpoint"),
            std::string::npos);
  EXPECT_NE(error_of([&] { ckpt::load((root_ / "absent").string(), t.state()); }).find("does not exist"),
            std::string::npos);
  EXPECT_FALSE(ckpt::is_committed((root_ / "empty").string()));
  EXPECT_EQ(ckpt::latest_checkpoint(root_.string()), good_.string());
}

TEST_F(CheckpointErrors, FlippedByteFailsTheChecksum) {
  const auto file = only_data_file(good_);
  std::string bytes = read_text(file);
  bytes[bytes.size() - 100] ^= 0x10;
  write_text(file, bytes);
  auto t = local_trainer();
  EXPECT_NE(error_of([&] { ckpt::load(good_.string(), t.state()); }).find("checksum mismatch"), std::string::npos);
}

TEST_F(CheckpointErrors, TruncatedOrOversizedHeaderFile) {
  const auto file = only_data_file(good_);
  const std::string bytes = read_text(file);
  write_text(file, bytes.substr(0, bytes.size() - 10));
  auto t = local_trainer();
  std::string message = error_of([&] { ckpt::load(good_.string(), t.state()); });
  EXPECT_NE(message.find(file.filename().string()), std::string::npos) << message;

  std::string huge = bytes;
  const uint64_t n = 1ull << 40;  // header "longer" than the file
  std::memcpy(huge.data(), &n, 8);
  write_text(file, huge);
  message = error_of([&] { ckpt::load(good_.string(), t.state()); });
  EXPECT_NE(message.find(file.filename().string()), std::string::npos) << message;
}

TEST_F(CheckpointErrors, DamagedIndex) {
  const auto index = good_ / "index.json";
  const std::string text = read_text(index);
  write_text(index, text.substr(0, text.size() / 2));
  auto t = local_trainer();
  EXPECT_NE(error_of([&] { ckpt::load(good_.string(), t.state()); }).find("damaged"), std::string::npos);
  // Chunks that no longer tile the tensor (an overlapping / out-of-range offset).
  // (Format 2: the first chunk whose offsets start with 0, "offsets": [ 0, ... ], gets 1.)
  std::string shifted = text;
  size_t zero = std::string::npos;
  for (auto at = shifted.find("\"offsets\": ["); at != std::string::npos && zero == std::string::npos;
       at = shifted.find("\"offsets\": [", at + 1)) {
    const auto first = shifted.find_first_not_of(" \n", at + 12);
    if (shifted[first] == '0' && (shifted[first + 1] == ',' || shifted[first + 1] == '\n')) zero = first;
  }
  ASSERT_NE(zero, std::string::npos);
  shifted[zero] = '1';
  write_text(index, shifted);
  EXPECT_NE(error_of([&] { ckpt::load(good_.string(), t.state()); }).find("do not tile it exactly"), std::string::npos);
}

TEST_F(CheckpointErrors, AnotherModelIsRefused) {
  auto c = uneven_config();
  c.n_layer = 3;
  torch::manual_seed(0);
  GPT deeper(c);
  std::string message = error_of([&] { ckpt::load(good_.string(), ckpt::State{deeper.ptr()}); });
  EXPECT_NE(message.find("does not match the model"), std::string::npos) << message;
  EXPECT_NE(message.find("model.h.2"), std::string::npos) << message;

  c = uneven_config();
  c.n_embd = 24;
  GPT wider(c);
  message = error_of([&] { ckpt::load(good_.string(), ckpt::State{wider.ptr()}); });
  EXPECT_NE(message.find("another model configuration"), std::string::npos) << message;

  auto doubled = local_trainer();
  doubled.model->to(at::kDouble);
  message = error_of([&] { ckpt::load(good_.string(), ckpt::State{doubled.model.ptr()}); });
  EXPECT_NE(message.find("is F32"), std::string::npos) << message;
}

TEST_F(CheckpointErrors, NonStrictLoadsTheCommonKeys) {
  auto c = uneven_config();
  c.n_layer = 1;
  torch::manual_seed(0);
  GPT shallower(c);
  ckpt::LoadOptions options;
  options.strict = false;
  ckpt::load(good_.string(), ckpt::State{shallower.ptr()}, options);
  auto full = local_trainer();
  ckpt::load(good_.string(), full.state());
  for (const auto& p : shallower->named_parameters())
    EXPECT_TRUE(at::equal(p.value(), full.model->named_parameters()[p.key()])) << p.key();
}

TEST_F(CheckpointErrors, FailedSaveLeavesTheLastGoodCheckpoint) {
  // Rank 0 cannot write the new index (a directory sits where its temporary file goes).
  fs::create_directories(good_ / "index.json.tmp");
  auto t = local_trainer();
  t.progress.ints["step"] = 99;
  const std::string message = error_of([&] { ckpt::save(good_.string(), t.state()); });
  EXPECT_NE(message.find("index.json.tmp"), std::string::npos) << message;
  fs::remove_all(good_ / "index.json.tmp");
  auto loaded = local_trainer();
  ckpt::load(good_.string(), loaded.state());
  EXPECT_EQ(loaded.progress.ints.at("step"), 1);

  // An async save's failure surfaces on wait(): the target is a regular file, not a directory.
  std::ofstream(root_ / "not_a_directory") << "x";
  auto pending = ckpt::async_save((root_ / "not_a_directory").string(), t.state());
  EXPECT_NE(error_of([&] { pending.wait(); }).find("failed"), std::string::npos);
}

TEST_F(CheckpointErrors, CpuRngStateContinuesTheStream) {
  torch::manual_seed(123);
  at::randn({5});
  ckpt::CpuRngState rng;
  auto t = local_trainer();
  ckpt::State state = t.state();
  state.extras["rng"] = &rng;
  ckpt::save((root_ / "rng").string(), state);
  const at::Tensor expected = at::randn({7});
  torch::manual_seed(999);
  ckpt::load((root_ / "rng").string(), state);
  EXPECT_TRUE(at::equal(at::randn({7}), expected));
}
