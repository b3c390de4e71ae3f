// GPU tests: fully_shard on CUDA tensors, with the side streams of [Note: FSDP streams].
// Each test skips, with its reason, where no GPU is visible or LibTorch has no CUDA/NCCL, so the
// suite stays green on CPU machines; scripts/gpu-check.sh runs them on a GPU machine.
//
//   world of one on NCCL vs plain LibTorch training on the same GPU (fp32 and bf16)
//   2 and 3 ranks sharing one GPU through Gloo on CUDA tensors (NCCL refuses two ranks on one
//   device) vs one process: the stream/event ordering with real cross-rank collectives
//   CPU offload (pinned shards and gradients), meta init onto the GPU, and 50 steps of a model of
//   many small units compared at every step (a buffer freed too early across streams shows up
//   as drift or garbage), with the stream-race mode on (FSDP_STREAM_RACE_US: every side stream
//   spins before its copy or collective, so a missing wait reads unwritten memory).
//   A world of one through NCCL anyway (FSDP_NCCL_WORLD_OF_ONE=1): NCCL's kernels, stream waits,
//   AVG and bf16; completion seen on the device (flight recorder); a hung NCCL collective ends
//   with our message, the dump and exit code 3 within FSDP_COLLECTIVE_TIMEOUT_S; 3 training steps
//   with no host synchronisation (CUDA's sync-debug mode "error") but clip_grad_norm_'s one read
//   and the loss read; a rank on cuda:1 while the current device is 0 (two GPUs; skips on one).
//   Copy-in, copy-out and the reduce-scatter input issue one copy op per unit (op_counts.h).
//   The embeddings as a unit without a backward all-gather (set_unshard_in_backward(false)).
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <dlfcn.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <atomic>
#include <filesystem>
#include <thread>

#include "comm/async_watch.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/comm/backend.h"
#include "fsdp/debug/flight_recorder.h"
#include "fsdp/fsdp.h"
#include "fused_copy_checks.h"
#include "gpu_skip.h"
#include "models/gpt.h"
#include "multiprocess.h"
#include "op_counts.h"

#ifdef FSDP_HAS_CUDA
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#endif

using fsdp::models::GPT;
using fsdp::models::GPTConfig;
using fsdp::testing::run_ranks;
using fsdp::testing::RanksOptions;

namespace {

using fsdp_gpu_test::gpu_skip_reason;

#define SKIP_WITHOUT_GPU(needs_nccl)                      \
  do {                                                    \
    const std::string why_ = gpu_skip_reason(needs_nccl); \
    if (!why_.empty()) GTEST_SKIP() << why_;              \
  } while (0)

GPTConfig small_config() {
  GPTConfig c;  // uneven on purpose: 2 and 3 divide none of the row counts
  c.vocab_size = 67;
  c.block_size = 11;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 20;
  return c;
}

constexpr int64_t kBatch = 6;

at::Tensor batch_of(const GPTConfig& c, int step) {
  auto gen = at::detail::createCPUGenerator(1000 + 17 * step);
  return at::randint(c.vocab_size, {kBatch, c.block_size + 1}, gen, at::kLong);
}

torch::Device gpu() { return torch::Device(torch::kCUDA, 0); }

GPT fresh_model(const GPTConfig& c) {
  torch::manual_seed(42);
  GPT m(c);  // initialised on the CPU (same values everywhere), then moved
  m->to(gpu());
  return m;
}

torch::optim::AdamW optimizer_for(torch::nn::Module& m) {
  return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).eps(1e-3));
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, at::Tensor> params;  // plain runs: full parameters, on the CPU
  GPT model{nullptr};                        // sharded runs: the trained model
};

// Plain LibTorch on the GPU, the whole batch. bf16: fp32 master weights, a bf16 compute copy.
Run train_plain(const GPTConfig& c, int steps, bool bf16) {
  GPT master = fresh_model(c);
  GPT compute = fresh_model(c);
  if (bf16) compute->to(at::kBFloat16);
  auto opt = optimizer_for(*master);
  auto masters = master->parameters();
  auto computes = compute->parameters();
  Run r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    {
      torch::NoGradGuard g;
      for (size_t i = 0; i < masters.size(); ++i) computes[i].copy_(masters[i]);
    }
    for (auto& p : computes) p.mutable_grad().reset();
    auto data = batch_of(c, s).to(gpu());
    auto logits = compute->forward(data.narrow(1, 0, c.block_size)).to(at::kFloat);
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    for (size_t i = 0; i < masters.size(); ++i) masters[i].mutable_grad() = computes[i].grad().to(at::kFloat);
    opt.step();
    r.losses.push_back(loss.item<double>());
  }
  for (const auto& p : master->named_parameters()) r.params[p.key()] = p.value().detach().cpu().clone();
  return r;
}

// Largest relative difference (magnitudes below 1 count as 1) of this rank's shards against the
// reference's rows; throws naming the parameter above `tol`.
double check_shards(GPT& model, const std::map<std::string, at::Tensor>& ref, double tol) {
  double worst = 0;
  for (const auto& p : model->named_parameters()) {
    auto info = fsdp::shard_info(p.value());
    TORCH_CHECK(info, p.key(), " is not a shard");
    at::Tensor want = ref.at(p.key());
    if (want.dim() == 0) want = want.reshape({1});
    want = want.narrow(0, info->dim0_offset, info->local_rows);
    const at::Tensor got = p.value().detach().cpu();
    const double d = want.numel() ? ((got - want).abs() / want.abs().clamp_min(1.0)).max().item<double>() : 0.0;
    TORCH_CHECK(d <= tol, p.key(), " differs from plain training by ", d, " (relative), tolerance ", tol);
    worst = std::max(worst, d);
  }
  return worst;
}

void check_losses(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  TORCH_CHECK(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double rel = std::abs(got[i] - want[i]) / std::abs(want[i]);
    TORCH_CHECK(std::isfinite(got[i]) && rel <= tol, "step ", i, ": loss ", got[i], " vs plain ", want[i],
                " (relative ", rel, ", tolerance ", tol, ")");
  }
}

// FSDP: this rank's slice of every batch; `shard` applies fully_shard. Steps compared as they go
// when `want` is given (a drift shows at the step it starts).
Run train_fsdp(const GPTConfig& c, int steps, const std::function<void(GPT&)>& shard, bool bf16,
               const std::vector<double>* want = nullptr, double tol = 0) {
  auto world = fsdp::dist::world_comm();
  const int n = world->size(), rank = world->rank();
  const int64_t local = kBatch / n;
  GPT model = fresh_model(c);
  shard(model);
  auto opt = optimizer_for(*model);
  fsdp::check_optimizer_params(opt);
  Run r;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto data = batch_of(c, s).narrow(0, rank * local, local).to(gpu());
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    TORCH_CHECK(logits.is_cuda(), "forward must run on the GPU");
    if (bf16) TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "forward must compute in bf16");
    auto loss = fsdp::models::gpt_loss(logits.to(at::kFloat), data.narrow(1, 1, c.block_size));
    loss.backward();
    opt.step();
    auto l = at::tensor({loss.item<double>()}, at::kDouble).to(gpu());
    world->all_reduce(l, fsdp::comm::ReduceOp::Avg);
    r.losses.push_back(l.item<double>());
    if (want) {
      const double rel = std::abs(r.losses.back() - (*want)[s]) / std::abs((*want)[s]);
      TORCH_CHECK(rel <= tol, "step ", s, ": loss ", r.losses.back(), " vs plain ", (*want)[s], " (relative ", rel,
                  ")");
    }
  }
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.scalar_type() == at::kFloat, "the master shards stay fp32");
  }
  r.model = model;
  return r;
}

}  // namespace

namespace {

fsdp::FullyShardOptions gpu_options(bool bf16) {
  fsdp::FullyShardOptions o;
  if (bf16) {
    o.mp_policy.param_dtype = at::kBFloat16;
    o.mp_policy.reduce_dtype = at::kFloat;
  }
  return o;
}

void shard_blocks_then_root(GPT& model, const fsdp::FullyShardOptions& o) {
  for (auto& b : model->blocks) fsdp::fully_shard(b, o);
  fsdp::fully_shard(model, o);
}

void init_cuda_runtime(bool gloo) {
  fsdp::dist::InitOptions init;
  init.device_type = "cuda";
  if (gloo) init.backend = fsdp::comm::BackendKind::Gloo;
  fsdp::dist::init_distributed(init);
}

// fp32 within 1e-6 (relative); bf16 within the CPU bf16 test's bounds (losses 2e-3, shards 5e-3).
// embeddings_apart: wte and wpe a unit of their own that skips its backward all-gather ([Note:
// unshard_in_backward]: their gradients land on parameters without memory, on the current stream).
void parity_worker(bool gloo, bool bf16, bool embeddings_apart = false) {
  init_cuda_runtime(gloo);
  const auto c = small_config();
  const int steps = 10;
  const Run want = train_plain(c, steps, bf16);
  const double loss_tol = bf16 ? 2e-3 : 1e-6, param_tol = bf16 ? 5e-3 : 1e-6;
  const auto o = gpu_options(bf16);
  Run got = train_fsdp(
      c, steps,
      [&](GPT& m) {
        if (!embeddings_apart) return shard_blocks_then_root(m, o);
        for (auto& b : m->blocks) fsdp::fully_shard(b, o);
        fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{m->wte.ptr(), m->wpe.ptr()}, o)
            .set_unshard_in_backward(false);
        fsdp::fully_shard(m, o);
      },
      bf16);
  check_losses(got.losses, want.losses, loss_tol);
  const double worst = check_shards(got.model, want.params, param_tol);
  if (fsdp::dist::rank() == 0) {
    std::cout << "ranks " << fsdp::dist::world_size() << (gloo ? " (gloo on cuda)" : " (nccl)")
              << (bf16 ? " bf16" : " fp32") << (embeddings_apart ? ", embeddings without backward all-gather" : "")
              << ": last loss " << got.losses.back() << " vs plain " << want.losses.back()
              << ", worst shard difference " << worst << std::endl;
  }
}

RanksOptions gpu_ranks() {
  RanksOptions o;
  o.init_runtime = false;                         // the workers initialise a "cuda" runtime themselves
  o.timeout = std::chrono::milliseconds(120000);  // gpu-check.sh gives the whole binary 150 s
  return o;
}

}  // namespace

FSDP_RANK_WORKER(gpu_nccl_fp32) { parity_worker(/*gloo=*/false, /*bf16=*/false); }
FSDP_RANK_WORKER(gpu_nccl_bf16) { parity_worker(/*gloo=*/false, /*bf16=*/true); }
FSDP_RANK_WORKER(gpu_gloo_fp32) { parity_worker(/*gloo=*/true, /*bf16=*/false); }
FSDP_RANK_WORKER(gpu_nccl_bf16_embeddings_apart) {
  parity_worker(/*gloo=*/false, /*bf16=*/true, /*embeddings_apart=*/true);
}
FSDP_RANK_WORKER(gpu_gloo_fp32_embeddings_apart) {
  parity_worker(/*gloo=*/true, /*bf16=*/false, /*embeddings_apart=*/true);
}

// Host tensors through NCCL ([Note: host tensors on NCCL], src/comm/comm.cpp): broadcast,
// all_reduce and all_gather_into_tensor of CPU tensors, then a checkpoint of a sharded model saved
// and loaded on the GPU (its save id and outcome are host tensors broadcast over the world; the
// first GPU run's train_gpt failed there).
FSDP_RANK_WORKER(gpu_nccl_host_tensors) {
  init_cuda_runtime(/*gloo=*/false);
  auto world = fsdp::dist::world_comm();
  at::Tensor ids = at::arange(5, at::kLong);
  world->broadcast(ids, 0);
  TORCH_CHECK(ids.is_cpu() && ids.equal(at::arange(5, at::kLong)), "broadcast of a host tensor");
  at::Tensor sum = at::full({3}, 2.0);
  world->all_reduce(sum, fsdp::comm::ReduceOp::Sum, /*async_op=*/true).wait();
  TORCH_CHECK(sum.is_cpu() && sum.eq(2.0 * world->size()).all().item<bool>(), "all_reduce of a host tensor");
  at::Tensor gathered = at::zeros({4 * world->size()}), mine = at::full({4}, 3.0);
  world->all_gather_into_tensor(gathered, mine);
  TORCH_CHECK(gathered.eq(3.0).all().item<bool>(), "all_gather_into_tensor of host tensors");

  namespace ckpt = fsdp::checkpoint;
  const auto c = small_config();
  Run trained = train_fsdp(
      c, 2, [&](GPT& m) { shard_blocks_then_root(m, gpu_options(/*bf16=*/false)); }, /*bf16=*/false);
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_gpu_ckpt_" + std::to_string(::getpid()));
  ckpt::save(dir.string(), ckpt::State{trained.model.ptr()});
  GPT fresh = fresh_model(c);
  shard_blocks_then_root(fresh, gpu_options(/*bf16=*/false));
  ckpt::load(dir.string(), ckpt::State{fresh.ptr()});
  std::map<std::string, at::Tensor> want;
  for (const auto& p : trained.model->named_parameters()) want[p.key()] = p.value().detach().cpu();
  for (const auto& p : fresh->named_parameters()) {
    TORCH_CHECK(p.value().is_cuda(), p.key(), " left the GPU on load");
    TORCH_CHECK(p.value().detach().cpu().equal(want.at(p.key())), p.key(), " differs after save and load");
  }
  std::filesystem::remove_all(dir);
  std::cout << "host tensors through NCCL and a checkpoint round trip: ok" << std::endl;
}

// A program that ends with exit() while its sharded model is alive and without
// destroy_distributed(): the FSDP states (their CUDA events) and the NCCL world outlive main, and
// must not be torn down after the CUDA runtime ([Note: NCCL at exit], src/dist/runtime.cpp). The
// first GPU run aborted here with "CUDA error: driver shutting down".
FSDP_RANK_WORKER(gpu_exit_without_destroy) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  Run got = train_fsdp(
      c, 3, [&](GPT& m) { shard_blocks_then_root(m, gpu_options(/*bf16=*/true)); }, /*bf16=*/true);
  std::cout << "trained; exiting without destroy_distributed" << std::endl;
  std::exit(0);
}

// CPU offload on a GPU: shards and their gradients in pinned host memory, the optimizer on the CPU.
FSDP_RANK_WORKER(gpu_cpu_offload) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  const int steps = 10;
  const Run want = train_plain(c, steps, /*bf16=*/false);
  fsdp::FullyShardOptions o;
  o.offload_policy = fsdp::CPUOffloadPolicy{};
  GPT model = fresh_model(c);
  shard_blocks_then_root(model, o);
  for (const auto& p : model->parameters()) {
    TORCH_CHECK(p.device().is_cpu() && p.is_pinned(), "offloaded shards must be pinned host memory");
  }
  auto opt = optimizer_for(*model);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    auto data = batch_of(c, s).to(gpu());
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    TORCH_CHECK(logits.is_cuda(), "forward must run on the GPU");
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    for (const auto& p : model->parameters()) {
      TORCH_CHECK(p.grad().defined() && p.grad().device().is_cpu() && p.grad().is_pinned(),
                  "offloaded gradients must land in pinned host memory");
    }
    opt.step();
    losses.push_back(loss.item<double>());
  }
  check_losses(losses, want.losses, 1e-6);
  check_shards(model, want.params, 1e-6);
}

// Meta init straight onto the GPU: the same values as the unsharded model built with the seed.
FSDP_RANK_WORKER(gpu_meta_init) {
  init_cuda_runtime(/*gloo=*/false);
  auto c = small_config();
  c.init_seed = 1234;
  GPTConfig full_c = c;
  full_c.device = gpu();
  GPT full(full_c);
  full->reset_parameters();
  std::map<std::string, at::Tensor> want;
  for (const auto& p : full->named_parameters()) want[p.key()] = p.value().detach().cpu();

  c.device = torch::kMeta;
  GPT model(c);
  shard_blocks_then_root(model, {});
  fsdp::to_empty(*model, gpu());
  model->reset_parameters();
  for (const auto& p : model->parameters()) TORCH_CHECK(p.is_cuda(), "materialised shards must be on the GPU");
  check_shards(model, want, 0.0);  // identical
  auto data = batch_of(c, 0).to(gpu());
  auto loss =
      fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
  loss.backward();
  TORCH_CHECK(std::isfinite(loss.item<double>()), "the materialised model must train");
}

// Many small units, 50 steps, compared at every step: 16 blocks, ln_f and lm_head are units of
// their own (plus the root's embeddings), so 19 all-gathers and reduce-scatters per step cross the
// streams, prefetched while the neighbouring unit computes.
FSDP_RANK_WORKER(gpu_many_units) {
  const bool gloo = std::getenv("FSDP_TEST_GLOO") != nullptr;
  init_cuda_runtime(gloo);
  auto c = small_config();
  c.n_layer = 16;
  const int steps = 50;
  const Run want = train_plain(c, steps, /*bf16=*/false);
  auto many_units = [](GPT& m) {
    for (auto& b : m->blocks) fsdp::fully_shard(b);
    fsdp::fully_shard(m->ln_f);
    fsdp::fully_shard(m->lm_head);
    fsdp::fully_shard(m);
  };
  Run got = train_fsdp(c, steps, many_units, /*bf16=*/false, &want.losses, 1e-5);
  check_shards(got.model, want.params, 1e-5);
}

#ifdef FSDP_HAS_CUDA

namespace {

// Queues a kernel that keeps the current stream busy for about `ms` milliseconds (2 GHz clocks).
void busy_current_stream(double ms) { at::cuda::sleep(static_cast<int64_t>(ms * 2e6)); }

fsdp::comm::FlightRecord last_record() {
  auto records = fsdp::comm::FlightRecorder::process().snapshot();
  TORCH_CHECK(!records.empty(), "the flight recorder holds no record (FSDP_FLIGHT_RECORDER_SIZE=0?)");
  return records.back();
}

void wait_until_unwatched() {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (fsdp::comm::detail::watched_collectives() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  TORCH_CHECK(fsdp::comm::detail::watched_collectives() == 0, "the watch still holds a completed collective");
}

// Counts CUDA's sync-debug warnings ("called a synchronizing CUDA operation") while alive.
class SyncCounter : public c10::WarningHandler {
 public:
  SyncCounter() : previous_(c10::WarningUtils::get_warning_handler()) {
    c10::WarningUtils::set_warning_handler(this);
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_WARN);
  }
  ~SyncCounter() override {
    c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_DISABLED);
    c10::WarningUtils::set_warning_handler(previous_);
  }
  void process(const c10::Warning& w) override {
    if (w.msg().find("synchroniz") != std::string::npos) ++count;
  }
  int count = 0;

 private:
  c10::WarningHandler* previous_;
};

void sync_debug(c10::cuda::SyncDebugMode mode) { c10::cuda::warning_state().set_sync_debug_mode(mode); }

}  // namespace

// FSDP_NCCL_WORLD_OF_ONE=1: the collectives of a world of one run NCCL's kernels (a local copy
// would be complete at once, and the flight recorder would call it completed when queued).
FSDP_RANK_WORKER(gpu_nccl_one_rank_collectives) {
  init_cuda_runtime(/*gloo=*/false);
  auto world = fsdp::dist::world_comm();
  TORCH_CHECK(world->backend_kind() == fsdp::comm::BackendKind::Nccl && world->backend(), "the world must be NCCL");
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(gpu());
  at::Tensor x = at::full({1000}, 3.0, bf16);
  busy_current_stream(300);  // the all-reduce queues behind 0.3 s of spinning
  auto work = world->all_reduce(x, fsdp::comm::ReduceOp::Avg, /*async_op=*/true);
  TORCH_CHECK(!work.is_completed(), "an NCCL all-reduce queued behind a busy stream cannot be complete yet");
  work.wait();  // a stream wait: the host goes on
  TORCH_CHECK(last_record().state != fsdp::comm::FlightState::Completed,
              "the flight recorder called a queued NCCL collective completed");
  torch::cuda::synchronize();
  wait_until_unwatched();
  TORCH_CHECK(last_record().state == fsdp::comm::FlightState::Completed, "the record never became completed");
  TORCH_CHECK(x.eq(3.0).all().item<bool>(), "AVG over one rank must keep the values");

  // all-gather in place (the input is the output's row), reduce-scatter and broadcast, bf16.
  at::Tensor out = at::zeros({64}, bf16);
  at::Tensor in = out.narrow(0, 0, 64);
  in.copy_(at::arange(64, at::TensorOptions().dtype(at::kFloat).device(gpu())).to(at::kBFloat16));
  world->all_gather_into_tensor(out, in);
  at::Tensor rs = at::empty({64}, bf16);
  world->reduce_scatter_tensor(rs, out, fsdp::comm::ReduceOp::Sum);
  world->broadcast(rs, 0);
  torch::cuda::synchronize();
  TORCH_CHECK(rs.to(at::kFloat).cpu().equal(at::arange(64, at::kFloat)), "reduce-scatter of one rank is a copy");
}

// A hung NCCL collective (here: queued behind 8 s of spinning, timeout 1 s) ends as a Gloo one:
// our message, the flight recorder's dump, exit code 3; never c10d's asynchronous abort.
FSDP_RANK_WORKER(gpu_nccl_timeout) {
  init_cuda_runtime(/*gloo=*/false);
  auto world = fsdp::dist::world_comm();
  at::Tensor x = at::ones({256}, at::TensorOptions().device(gpu()));
  busy_current_stream(8000);
  world->all_reduce(x, fsdp::comm::ReduceOp::Sum, /*async_op=*/true).wait();
  std::this_thread::sleep_for(std::chrono::seconds(20));  // the watch must end the process before this
}

// Three training steps with no host synchronisation: forward, backward and the optimizer under
// CUDA's sync-debug mode "error"; clip_grad_norm_ reads its result once; the loss read at the end
// of each step is the only other one.
FSDP_RANK_WORKER(gpu_sync_free_steps) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  GPT model = fresh_model(c);
  shard_blocks_then_root(model, gpu_options(/*bf16=*/true));
  auto opt = optimizer_for(*model);
  std::vector<at::Tensor> batches;
  for (int s = 0; s < 4; ++s) batches.push_back(batch_of(c, s).to(gpu()));
  auto step = [&](int s, bool checked) {
    if (checked) sync_debug(c10::cuda::SyncDebugMode::L_ERROR);
    opt.zero_grad();
    const at::Tensor& data = batches[static_cast<size_t>(s)];
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    auto loss = fsdp::models::gpt_loss(logits.to(at::kFloat), data.narrow(1, 1, c.block_size));
    loss.backward();
    int clip_syncs = 0;
    {
      SyncCounter counter;  // warn mode while it lives
      fsdp::clip_grad_norm_(model->parameters(), 1.0);
      clip_syncs = counter.count;
    }
    if (checked) sync_debug(c10::cuda::SyncDebugMode::L_ERROR);
    opt.step();
    sync_debug(c10::cuda::SyncDebugMode::L_DISABLED);
    TORCH_CHECK(!checked || clip_syncs <= 1, "clip_grad_norm_ synchronised the host ", clip_syncs,
                " times; at most once");
    return loss.item<double>();
  };
  step(0, /*checked=*/false);  // the first step's lazy initialisation may synchronise
  for (int s = 1; s < 4; ++s) {
    try {
      TORCH_CHECK(std::isfinite(step(s, /*checked=*/true)));
    } catch (...) {
      sync_debug(c10::cuda::SyncDebugMode::L_DISABLED);
      throw;
    }
  }
}

// [Note: one copy kernel per unit] inside FSDP on CUDA, counted from the operators each range
// issues (tests/support/op_counts.h): per unit and all-gather, copy-in is one copy_ of the unit's
// shard buffer (the bf16 cast inside; [Note: the shards in one buffer]) and nothing else, and
// copy-out one split_with_sizes_copy; per unit and backward, the
// reduce-scatter input is one _chunk_cat (the bf16 gradients cast to the float32 reduction inside).
// A world of one goes through the side streams as more ranks would.
FSDP_RANK_WORKER(gpu_one_op_copies) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  GPT model = fresh_model(c);
  shard_blocks_then_root(model, gpu_options(/*bf16=*/true));
  auto opt = optimizer_for(*model);
  auto step = [&](int s) {
    opt.zero_grad();
    const at::Tensor data = batch_of(c, s).to(gpu());
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    fsdp::models::gpt_loss(logits.to(at::kFloat), data.narrow(1, 1, c.block_size)).backward();
    opt.step();
  };
  step(0);
  fsdp::testing::RangeOpCounter counter;
  step(1);
  torch::cuda::synchronize();
  std::cout << counter.describe_all() << std::flush;
  fsdp::testing::check_one_copy_op_per_unit(counter, c.n_layer + 1, /*copy_in_from_buffer=*/true,
                                            /*fused_reduce_input=*/true);
}

// The rank's model on cuda:1 while the current device stays 0: FSDP must allocate (and the
// collectives run) on the parameters' device, not the current one.
FSDP_RANK_WORKER(gpu_second_device) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  const torch::Device dev1(torch::kCUDA, 1);
  c10::cuda::set_device(0);
  torch::manual_seed(42);
  GPT model(c);
  model->to(dev1);
  shard_blocks_then_root(model, {});
  auto opt = optimizer_for(*model);
  const auto on0 = [] { return c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current; };
  at::zeros({1}, at::TensorOptions().device(gpu()));  // device 0's context exists either way
  const int64_t before = on0();
  for (int s = 0; s < 3; ++s) {
    opt.zero_grad();
    auto data = batch_of(c, s).to(dev1);
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    TORCH_CHECK(logits.device() == dev1, "forward ran on ", logits.device(), ", not cuda:1");
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    loss.backward();
    fsdp::clip_grad_norm_(model->parameters(), 1.0);
    opt.step();
    TORCH_CHECK(std::isfinite(loss.item<double>()));
  }
  for (const auto& p : model->parameters()) TORCH_CHECK(p.device() == dev1, "a shard left cuda:1");
  TORCH_CHECK(on0() == before, "FSDP allocated ", on0() - before, " bytes on cuda:0 for a model on cuda:1");
  TORCH_CHECK(c10::cuda::current_device() == 0, "FSDP changed the current device");
}

namespace {

// Counts CUDA's sync-debug warnings on every thread that installed it (backward's hooks run on the
// autograd engine's device thread, whose warning handler is its own); lives as long as the process.
class GlobalSyncCounter : public c10::WarningHandler {
 public:
  void process(const c10::Warning& w) override {
    if (active.load() && w.msg().find("synchroniz") != std::string::npos) ++count;
  }
  std::atomic<bool> active{false};
  std::atomic<int> count{0};
};
GlobalSyncCounter& global_sync_counter() {
  static auto* counter = new GlobalSyncCounter();  // never destroyed: device threads keep a pointer
  return *counter;
}

}  // namespace

// CPU offload: the reduced gradients go to pinned host memory with non-blocking copies on the
// side stream, and the host waits once, at the end of backward (FSDP2's finalize_backward), not
// at every unit (before: a whole-stream synchronisation per unit). Counted with CUDA's sync-debug
// mode on the calling thread and on the autograd device thread; values checked against plain
// training, with gradients set to none (fresh buffers that become the gradients) and zeroed in
// place (the persistent staging buffer, added to them) on alternate steps.
FSDP_RANK_WORKER(gpu_offload_waits_once) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  const int steps = 6;
  const Run want = train_plain(c, steps, /*bf16=*/false);
  fsdp::FullyShardOptions o;
  o.offload_policy = fsdp::CPUOffloadPolicy{};
  GPT model = fresh_model(c);
  shard_blocks_then_root(model, o);
  auto opt = optimizer_for(*model);
  auto& counter = global_sync_counter();
  c10::WarningHandler* previous = c10::WarningUtils::get_warning_handler();
  c10::WarningUtils::set_warning_handler(&counter);
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    for (const auto& p : model->parameters()) {
      if (s % 2 == 0 || !p.grad().defined()) {
        p.mutable_grad().reset();
      } else {
        torch::NoGradGuard no_grad;
        p.mutable_grad().zero_();
      }
    }
    auto data = batch_of(c, s).to(gpu());
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    logits.register_hook([&counter](const at::Tensor& g) {
      c10::WarningUtils::set_warning_handler(&counter);  // the autograd device thread's handler
      return g;
    });
    auto loss = fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size));
    counter.count = 0;
    counter.active = true;
    sync_debug(c10::cuda::SyncDebugMode::L_WARN);
    loss.backward();
    sync_debug(c10::cuda::SyncDebugMode::L_DISABLED);
    counter.active = false;
    TORCH_CHECK(counter.count <= 1, "step ", s, ": backward with CPU offload synchronised the host ",
                counter.count.load(), " times; once, at its end");
    for (const auto& p : model->parameters()) {
      TORCH_CHECK(p.grad().defined() && p.grad().is_cpu() && p.grad().is_pinned(),
                  "offloaded gradients must land in pinned host memory");
    }
    opt.step();
    losses.push_back(loss.item<double>());
  }
  c10::WarningUtils::set_warning_handler(previous);
  check_losses(losses, want.losses, 1e-6);
  check_shards(model, want.params, 1e-6);
}

// set_post_optim_event: the root's first all-gather of a step waits on the user's event only.
// A tensor of exactly the all-gather output's size is allocated after the event, read by a kernel
// queued behind 50 ms of spinning, and freed: were the output allocated from the current stream's
// pool (it would get that block), copy-in would overwrite it before the reader ran.
FSDP_RANK_WORKER(gpu_post_optim_event_allocation) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  GPT model = fresh_model(c);
  auto root = fsdp::fully_shard(model);  // one unit: its all-gather output holds every parameter
  auto opt = optimizer_for(*model);
  int64_t total = 0;
  for (const auto& p : model->parameters()) total += p.numel();
  for (int s = 0; s < 4; ++s) {
    opt.zero_grad();
    auto data = batch_of(c, s).to(gpu());
    auto logits = fsdp::call(model, data.narrow(1, 0, c.block_size));
    fsdp::models::gpt_loss(logits, data.narrow(1, 1, c.block_size)).backward();
    opt.step();
    auto event = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    event->record(c10::cuda::getCurrentCUDAStream());
    root.set_post_optim_event(event);
    at::Tensor freed = at::full({total}, 7.0, at::TensorOptions().device(gpu()));
    busy_current_stream(50);
    at::Tensor read = freed.clone();  // queued behind the spinning
    freed = at::Tensor();             // its block is free for the current stream's next allocation
    auto next = fsdp::call(model, data.narrow(1, 0, c.block_size));  // the all-gather after the event
    TORCH_CHECK(read.eq(7.0).all().item<bool>(), "step ", s,
                ": the all-gather after the post-optim event wrote into a block a queued kernel still read");
    TORCH_CHECK(std::isfinite(next.sum().item<double>()));
  }
}

// HSDP on a 1x1 mesh through NCCL: each unit's all-reduce over the replicas is queued right after
// its reduce-scatter and waited for at the end of backward; with the stream-race mode on, a missing
// wait shows as a difference from plain training.
FSDP_RANK_WORKER(gpu_hsdp_one_by_one) {
  init_cuda_runtime(/*gloo=*/false);
  fsdp::FullyShardOptions o;
  o.mesh = fsdp::init_device_mesh({1, 1}, {"replicate", "shard"});
  const auto c = small_config();
  const int steps = 8;
  const Run want = train_plain(c, steps, /*bf16=*/false);
  Run got = train_fsdp(
      c, steps, [&](GPT& m) { shard_blocks_then_root(m, o); }, /*bf16=*/false, &want.losses, 1e-5);
  check_shards(got.model, want.params, 1e-5);
}

// [Note: the all-reduce hook] on the side streams, a world of one through NCCL: every unit's hook
// runs on a stream of the test's own, which must wait for the reduce-scatter (it copies what it is
// given), then spins 20 ms and doubles the gradients in place; the current stream must wait for it
// before .grad is read. Per step the gradients' squared norm must be 4x the copies', and the hook
// must have run once per unit.
FSDP_RANK_WORKER(gpu_all_reduce_hook) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  GPT model = fresh_model(c);
  const c10::Stream hook_stream = c10::cuda::getStreamFromPool();
  auto seen = std::make_shared<std::vector<at::Tensor>>();
  const std::function<void(const at::Tensor&)> hook = [seen, hook_stream](const at::Tensor& g) {
    TORCH_CHECK(c10::Stream(c10::cuda::getCurrentCUDAStream()) == hook_stream, "the hook ran on ",
                c10::cuda::getCurrentCUDAStream(), ", not on the stream it was given");
    seen->push_back(g.clone());
    at::cuda::sleep(40000000);  // about 20 ms of spinning before the gradients change
    g.mul_(2);
  };
  const auto o = gpu_options(/*bf16=*/false);
  for (auto& b : model->blocks) fsdp::fully_shard(b, o).set_all_reduce_hook(hook, hook_stream);
  fsdp::fully_shard(model, o).set_all_reduce_hook(hook, hook_stream);
  const int steps = 3;
  for (int s = 0; s < steps; ++s) {
    seen->clear();
    for (auto& p : model->parameters()) p.mutable_grad() = at::Tensor();
    auto data = batch_of(c, s).to(gpu());
    auto loss =
        fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
    loss.backward();
    const int64_t units = static_cast<int64_t>(model->blocks.size()) + 1;
    TORCH_CHECK(static_cast<int64_t>(seen->size()) == units, "step ", s, ": the hook ran ", seen->size(),
                " times; expected once per unit (", units, ")");
    at::Tensor grads = at::zeros({}, at::TensorOptions().device(gpu()).dtype(at::kDouble)), copies = grads.clone();
    for (const auto& p : model->parameters()) grads += p.grad().to(at::kDouble).pow(2).sum();
    for (const auto& g : *seen) copies += g.to(at::kDouble).pow(2).sum();
    const double ratio = (grads / copies).item<double>();  // waits on the current stream only
    TORCH_CHECK(std::abs(ratio - 4.0) < 1e-6, "step ", s, ": the gradients' squared norm is ", ratio,
                "x the reduce outputs' the hook copied; expected 4x (a stream that did not wait)");
  }
}

// FSDP2's custom collectives on the side streams (bf16, a world of one through NCCL, the race mode
// on): the objects allocate the buffers and call the group's own collectives, on the stream FSDP
// calls them on; training must match plain training, every unit's all-gathers and reduce-scatters
// going through them, with the dtypes of mixed precision (bf16 gathered, float32 reduced).
struct PassThroughGather : fsdp::AllGather {
  at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) override {
    TORCH_CHECK(dtype == at::kBFloat16 && device.is_cuda(), "all-gather buffer asked in ", dtype, " on ", device);
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  }
  fsdp::comm::Work operator()(const at::Tensor& output, const at::Tensor& input, fsdp::comm::Comm& group,
                              bool async_op) override {
    ++calls;
    return group.all_gather_into_tensor(output, input, async_op);
  }
  int64_t calls = 0;
};
struct PassThroughReduceScatter : fsdp::ReduceScatter {
  at::Tensor allocate(at::IntArrayRef sizes, at::ScalarType dtype, c10::Device device) override {
    TORCH_CHECK(dtype == at::kFloat && device.is_cuda(), "reduce-scatter buffer asked in ", dtype, " on ", device);
    return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  }
  fsdp::comm::Work operator()(const at::Tensor& output, const at::Tensor& input, fsdp::comm::Comm& group,
                              fsdp::comm::ReduceOp op, bool async_op) override {
    ++calls;
    return group.reduce_scatter_tensor(output, input, op, async_op);
  }
  int64_t calls = 0;
};

FSDP_RANK_WORKER(gpu_custom_collectives) {
  init_cuda_runtime(/*gloo=*/false);
  const auto c = small_config();
  const int steps = 6;
  const Run want = train_plain(c, steps, /*bf16=*/true);
  auto gathers = std::make_shared<PassThroughGather>();
  auto reduces = std::make_shared<PassThroughReduceScatter>();
  const auto o = gpu_options(/*bf16=*/true);
  Run got = train_fsdp(
      c, steps,
      [&](GPT& m) {
        for (auto& b : m->blocks) {
          fsdp::fully_shard(b, o).set_custom_all_gather(gathers);
          fsdp::fsdp_module(*b)->set_custom_reduce_scatter(reduces);
        }
        auto root = fsdp::fully_shard(m, o);
        root.set_custom_all_gather(gathers);
        root.set_custom_reduce_scatter(reduces);
      },
      /*bf16=*/true, &want.losses, 2e-3);
  check_shards(got.model, want.params, 5e-3);
  const int64_t blocks = static_cast<int64_t>(got.model->blocks.size());
  TORCH_CHECK(gathers->calls == (2 * blocks + 1) * steps, "custom all-gathers: ", gathers->calls);
  TORCH_CHECK(reduces->calls == (blocks + 1) * steps, "custom reduce-scatters: ", reduces->calls);
}

#endif  // FSDP_HAS_CUDA

namespace {

RanksOptions through_nccl(RanksOptions o = gpu_ranks()) {
  o.env["FSDP_NCCL_WORLD_OF_ONE"] = "1";
  return o;
}

}  // namespace

// Runs without a GPU too (in the CUDA build's dry run and the CPU suite). The Python registry's
// torch exports a copy of std::filesystem from libtorch.so whose remove_all calls through null
// weak references: a program that bound its calls there crashed in remove_all on the first GPU
// run. src/CMakeLists.txt lists libstdc++ first; this checks where the call lands, then makes one.
TEST(GpuBuild, StdFilesystemBindsToTheCxxRuntimeNotTorch) {
  using RemoveAll = std::uintmax_t (*)(const std::filesystem::path&);
  const RemoveAll remove_all = &std::filesystem::remove_all;
  Dl_info info{};
  ASSERT_NE(dladdr(reinterpret_cast<void*>(remove_all), &info), 0);
  const std::string from = info.dli_fname != nullptr ? info.dli_fname : "?";
  EXPECT_EQ(from.find("libtorch"), std::string::npos)
      << "std::filesystem::remove_all resolves to " << from << ": link libstdc++ ahead of torch (src/CMakeLists.txt)";
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_fs_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "a" / "b");
  std::ofstream(dir / "a" / "b" / "f") << "x";
  EXPECT_EQ(remove_all(dir), 4u);  // dir, a, b, f
  EXPECT_FALSE(std::filesystem::exists(dir));
}

// [Note: one copy kernel per unit]: CUDA's kernels for the one-op copies (split_with_sizes_copy,
// _chunk_cat with its bf16-to-float32 cast, _foreach_copy_ with a cast) lay out the rows as the
// CPU's checks say (tests/support/fused_copy_checks.h); the parity tests run them inside FSDP.
TEST(Gpu, OneOpCopiesLayRowsOutOnTheDevice) {
  SKIP_WITHOUT_GPU(false);
  fsdp::testing::expect_split_copy_layout(gpu());
  if (fsdp::compat::kHasChunkCat) fsdp::testing::expect_chunk_cat_layout(gpu());
  if (fsdp::compat::kHasForeachCopy) fsdp::testing::expect_foreach_copy_cast(gpu());
  EXPECT_TRUE(fsdp::compat::kHasChunkCat && fsdp::compat::kHasForeachCopy)
      << "LibTorch " << TORCH_VERSION << " lacks a one-op copy: the GPU path copies per parameter";
}

TEST(Gpu, CopiesAreOneOpPerUnitAndPhase) {
  SKIP_WITHOUT_GPU(true);
  if (!fsdp::compat::kHasChunkCat || !fsdp::compat::kHasForeachCopy)
    GTEST_SKIP() << "LibTorch " << TORCH_VERSION << " lacks _chunk_cat or _foreach_copy_: copies per parameter";
  EXPECT_RANKS_PASS(1, "gpu_one_op_copies", gpu_ranks());
}

TEST(Gpu, WorldOfOneThroughNcclRunsNcclCollectives) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_one_rank_collectives", through_nccl());
}

TEST(Gpu, WorldOfOneThroughNcclMatchesPlainTrainingFp32) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_fp32", through_nccl());
}

TEST(Gpu, WorldOfOneThroughNcclMatchesPlainTrainingBf16) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_bf16", through_nccl());
}

TEST(Gpu, ExitWithoutDestroyWhileShardedModelLivesIsClean) {
  SKIP_WITHOUT_GPU(true);
  auto r = run_ranks(1, "gpu_exit_without_destroy", through_nccl());
  ASSERT_EQ(r.ranks.size(), 1u);
  const auto& rank0 = r.ranks[0];
  EXPECT_EQ(rank0.term_signal, 0) << r.report();
  EXPECT_EQ(rank0.exit_code, 0) << r.report();
  EXPECT_NE(rank0.output.find("trained; exiting"), std::string::npos) << r.report();
  EXPECT_EQ(rank0.output.find("driver shutting down"), std::string::npos) << r.report();
  EXPECT_EQ(rank0.output.find("terminate called"), std::string::npos) << r.report();
}

TEST(Gpu, HostTensorsAndACheckpointThroughNccl) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_host_tensors", through_nccl());
}

TEST(Gpu, HungNcclCollectiveEndsWithOurMessageAndTheDump) {
  SKIP_WITHOUT_GPU(true);
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp_gpu_fr_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto o = through_nccl();
  o.env["FSDP_COLLECTIVE_TIMEOUT_S"] = "1";
  o.env["FSDP_FLIGHT_RECORDER_DIR"] = dir.string();
  o.timeout = std::chrono::milliseconds(60000);
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_ranks(1, "gpu_nccl_timeout", o);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(r.ranks.size(), 1u);
  const auto& rank0 = r.ranks[0];
  EXPECT_FALSE(rank0.timed_out) << r.report();
  EXPECT_EQ(rank0.term_signal, 0) << "c10d's abort, not our exit\n" << r.report();
  EXPECT_EQ(rank0.exit_code, fsdp::comm::detail::kAsyncCollectiveExitCode) << r.report();
  EXPECT_NE(rank0.output.find("all_reduce on group 'world' (nccl"), std::string::npos) << r.report();
  EXPECT_NE(rank0.output.find("failed: timed out after 1.0 s"), std::string::npos) << r.report();
  EXPECT_NE(rank0.output.find("FSDP_COLLECTIVE_TIMEOUT_S"), std::string::npos) << r.report();
  EXPECT_TRUE(std::filesystem::exists(dir / "rank_0.jsonl")) << "no flight recorder dump in " << dir;
  EXPECT_LT(took, 15.0) << "the timeout is 1 s; the rank ended after " << took << " s";
  std::filesystem::remove_all(dir);
}

TEST(Gpu, ThreeStepsWithoutHostSyncBeyondClipAndLossRead) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_sync_free_steps", through_nccl());
}

TEST(Gpu, RankOnSecondGpuAllocatesNothingOnTheFirst) {
  SKIP_WITHOUT_GPU(true);
  if (torch::cuda::device_count() < 2) {
    GTEST_SKIP() << "needs two GPUs (a rank on cuda:1 while the current device is 0); " << torch::cuda::device_count()
                 << " visible";
  }
  EXPECT_RANKS_PASS(1, "gpu_second_device", gpu_ranks());
}

TEST(Gpu, WorldOfOneOnNcclMatchesPlainTrainingFp32) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_fp32", gpu_ranks());
}

TEST(Gpu, WorldOfOneOnNcclMatchesPlainTrainingBf16) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_bf16", gpu_ranks());
}

// set_unshard_in_backward(false) on the embeddings' unit, on the side streams.
TEST(Gpu, EmbeddingsWithoutBackwardGatherMatchPlainTraining) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_nccl_bf16_embeddings_apart", gpu_ranks());
  EXPECT_RANKS_PASS(2, "gpu_gloo_fp32_embeddings_apart", gpu_ranks());
}

TEST(Gpu, TwoRanksSharingOneGpuMatchOneProcess) {
  SKIP_WITHOUT_GPU(false);
  EXPECT_RANKS_PASS(2, "gpu_gloo_fp32", gpu_ranks());
}

TEST(Gpu, ThreeRanksSharingOneGpuMatchOneProcess) {
  SKIP_WITHOUT_GPU(false);
  EXPECT_RANKS_PASS(3, "gpu_gloo_fp32", gpu_ranks());
}

TEST(Gpu, CpuOffloadUsesPinnedMemoryAndMatches) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_cpu_offload", gpu_ranks());
}

TEST(Gpu, MetaInitOntoTheGpuMatchesTheUnshardedInit) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_meta_init", gpu_ranks());
}

// With the stream-race mode on: each side stream spins 200 us before every copy and collective.
TEST(Gpu, FiftyStepsOfManySmallUnitsMatchEveryStep) {
  SKIP_WITHOUT_GPU(true);
  auto o = through_nccl();
  o.env["FSDP_STREAM_RACE_US"] = "200";
  EXPECT_RANKS_PASS(1, "gpu_many_units", o);
}

TEST(Gpu, FiftyStepsOfManySmallUnitsTwoRanksSharingOneGpu) {
  SKIP_WITHOUT_GPU(false);
  auto o = gpu_ranks();
  o.env["FSDP_TEST_GLOO"] = "1";
  o.env["FSDP_STREAM_RACE_US"] = "200";
  EXPECT_RANKS_PASS(2, "gpu_many_units", o);
}

TEST(Gpu, CpuOffloadWaitsOnceAtTheEndOfBackward) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_offload_waits_once", through_nccl());
}

TEST(Gpu, PostOptimEventAllGatherDoesNotReuseTheComputeStreamsBlocks) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_post_optim_event_allocation", through_nccl());
}

TEST(Gpu, AllReduceHookRunsOnItsStreamBetweenTheReductionAndTheGradients) {
  SKIP_WITHOUT_GPU(true);
  EXPECT_RANKS_PASS(1, "gpu_all_reduce_hook", through_nccl());
}

TEST(Gpu, CustomCollectivesOnTheSideStreamsMatchPlainTraining) {
  SKIP_WITHOUT_GPU(true);
  auto o = through_nccl();
  o.env["FSDP_STREAM_RACE_US"] = "200";
  EXPECT_RANKS_PASS(1, "gpu_custom_collectives", o);
}

TEST(Gpu, HsdpAllReduceQueuedAfterTheReduceScatterMatchesPlainTraining) {
  SKIP_WITHOUT_GPU(true);
  auto o = through_nccl();
  o.env["FSDP_STREAM_RACE_US"] = "200";
  EXPECT_RANKS_PASS(1, "gpu_hsdp_one_by_one", o);
}
