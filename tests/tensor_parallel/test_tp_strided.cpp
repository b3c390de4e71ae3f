// The strided column-wise placement (ColwiseParallel{.fused = 3}, a fused [q | k | v]
// split by heads): rank r holds the r-th slice of each of the three blocks. Checked on a fused
// Linear(5 -> 3 x 6) at tp 2 alone and under fully_shard at dp 2 (4 ranks, where an FSDP shard of
// the TP-local rows cuts the blocks: ranks hold 2 pieces each):
//   - meta init gives each rank its pieces of the one-process values; the forward gives its
//     columns [q_r | k_r | v_r]; gather_full rebuilds the full weight;
//   - one AdamW step equals the one-process step's slices; the full state dict and the
//     safetensors export gather the full tensors, load_safetensors puts each piece back;
//   - a checkpoint (one chunk per piece) loads in one process equal to the one-process run, which
//     steps on, saves, and that checkpoint loads back into the strided layout.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <string>

#include "fsdp/fsdp.h"
#include "models/gpt.h"
#include "models/tensor_parallel.h"
#include "multiprocess.h"
#include "test_helpers.h"
#include "tp_model.h"

namespace {

namespace tp = fsdp::tp;
constexpr int64_t kIn = 5, kBlock = 6;  // out = 3 x 6: at tp 2, 3 rows of each block per rank
constexpr double kTol = 1e-6;

struct FusedNetImpl : torch::nn::Module {
  explicit FusedNetImpl(torch::Device device) {
    qkv = register_module("qkv", fsdp::models::Linear(kIn, 3 * kBlock, true, device));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fsdp::call(qkv, x); }
  void reset() {
    for (const auto& item : named_parameters())
      fsdp::init::normal_(item.value(), 0.0, 0.5, fsdp::init::param_seed(11, item.key()));
  }
  fsdp::models::Linear qkv{nullptr};
};
TORCH_MODULE(FusedNet);

at::Tensor input(int step) {
  auto gen = at::detail::createCPUGenerator(100 + static_cast<uint64_t>(step));
  return at::randn({4, kIn}, gen);
}

torch::optim::AdamW make_optimizer(torch::nn::Module& m) {
  return torch::optim::AdamW(m.parameters(), torch::optim::AdamWOptions(5e-2).weight_decay(0.1));
}

// The one-process run: `steps` AdamW steps on loss = sum(y^2).
FusedNet reference(int steps) {
  FusedNet net(torch::kCPU);
  net->reset();
  auto opt = make_optimizer(*net);
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    net->forward(input(s)).pow(2).sum().backward();
    opt.step();
  }
  return net;
}

double max_local_diff(FusedNet& net, FusedNet& ref) {
  double worst = 0;
  auto want_all = ref->named_parameters();
  for (const auto& item : net->named_parameters()) {
    if (auto placement = fsdp::testing::tp_placement_of(item.value())) {
      TORCH_CHECK(placement->blocks == 3 && placement->dim == 0, "expected a strided placement of 3 blocks on dim 0");
    }
    at::Tensor want = fsdp::testing::expected_local(item.value(), want_all[item.key()].detach());
    TORCH_CHECK(item.value().sizes() == want.sizes(), item.key(), ": local ", item.value().sizes(), " vs ",
                want.sizes());
    if (want.numel() > 0) worst = std::max(worst, (item.value().detach() - want).abs().max().item<double>());
  }
  return worst;
}

// The layout DP x TP (world = DP x TP), built on meta and initialised shard-locally.
FusedNet build(int dp, int tp_size) {
  fsdp::models::register_tp_module_types();
  auto mesh = fsdp::init_device_mesh({dp, tp_size}, {"dp", "tp"});
  FusedNet net(torch::kMeta);
  tp::parallelize_module(net, mesh["tp"], {{"qkv", tp::ColwiseParallel{.fused = 3}}});
  if (dp > 1) fsdp::fully_shard(net, fsdp::FullyShardOptions{.mesh = mesh["dp"]});
  fsdp::to_empty(*net, torch::kCPU);
  net->reset();
  return net;
}

std::string env(const char* name) { return std::getenv(name); }

// PHASE=save: DP x TP; init, forward, one step, state dict / export checks, save DIR/a.
// PHASE=one: one process; load DIR/a (equal to 1 step), step on, save DIR/b.
// PHASE=load: DP x TP; load DIR/b, equal to the 2-step run.
void strided_worker() {
  const std::string phase = env("PHASE"), dir = env("DIR");
  const int dp = std::atoi(env("DP").c_str()), tp_size = std::atoi(env("TP").c_str());
  const int rank = fsdp::dist::rank();
  if (phase == "one") {
    FusedNet ref1 = reference(1), ref2 = reference(2);
    FusedNet net(torch::kCPU);
    auto opt = make_optimizer(*net);
    fsdp::checkpoint::load(dir + "/a", fsdp::checkpoint::State{net.ptr(), &opt, {}});
    TORCH_CHECK(max_local_diff(net, ref1) <= kTol, "one process: the loaded parameters differ from the 1-step run");
    opt.zero_grad();
    net->forward(input(1)).pow(2).sum().backward();
    opt.step();  // AdamW's state came from the strided save: a wrong piece shows here
    const double d = max_local_diff(net, ref2);
    std::cout << "one process: after step 2, largest difference " << d << std::endl;
    TORCH_CHECK(d <= kTol, "one process: step 2 after loading differs from the uninterrupted run by ", d);
    fsdp::checkpoint::save(dir + "/b", fsdp::checkpoint::State{net.ptr(), &opt, {}});
    return;
  }
  FusedNet net = build(dp, tp_size);
  if (phase == "load") {
    FusedNet ref2 = reference(2);
    auto opt = make_optimizer(*net);
    fsdp::checkpoint::load(dir + "/b", fsdp::checkpoint::State{net.ptr(), &opt, {}});
    const double d = max_local_diff(net, ref2);
    std::cout << "rank " << rank << ": loaded the one-process checkpoint, largest difference " << d << std::endl;
    TORCH_CHECK(d <= kTol, "the strided layout loaded a one-process checkpoint wrongly: ", d);
    return;
  }
  // PHASE=save
  FusedNet ref0 = reference(0), ref1 = reference(1);
  TORCH_CHECK(max_local_diff(net, ref0) == 0, "meta init did not give this rank its pieces of the full values");
  const at::Tensor x = input(0);
  if (dp == 1) {
    // The forward gives [q_r | k_r | v_r]; gather_full rebuilds the whole weight.
    const at::Tensor y = net->forward(x).detach(), full_y = ref0->forward(x).detach();
    const int r = static_cast<int>(fsdp::dist::rank()), s = kBlock / tp_size;
    at::Tensor want = at::cat(
        {full_y.narrow(1, r * s, s), full_y.narrow(1, kBlock + r * s, s), full_y.narrow(1, 2 * kBlock + r * s, s)}, 1);
    TORCH_CHECK(at::allclose(y, want, 1e-6, 1e-6), "the strided forward's columns are not [q_r | k_r | v_r]");
    TORCH_CHECK(at::equal(tp::gather_full(net->qkv->weight), ref0->qkv->weight.detach()),
                "gather_full != the full weight");
  }
  auto opt = make_optimizer(*net);
  opt.zero_grad();
  fsdp::call(net, x).pow(2).sum().backward();
  opt.step();
  const double d = max_local_diff(net, ref1);
  TORCH_CHECK(d <= kTol, "one strided AdamW step differs from the one-process step by ", d);
  // Full state dict and export: every piece in its place.
  fsdp::checkpoint::StateDictOptions full;
  full.full_state_dict = true;
  auto dict = fsdp::checkpoint::get_model_state_dict(*net, full);
  for (const auto& item : ref1->named_parameters())
    TORCH_CHECK(at::allclose(dict.at(item.key()), item.value().detach(), kTol, kTol), "full state dict: ", item.key(),
                " differs from the one-process tensor");
  fsdp::checkpoint::export_safetensors(*net, dir + "/net.safetensors");
  fsdp::dist::world_comm()->barrier();  // rank 0 wrote it: everyone reads it now
  FusedNet again = build(dp, tp_size);
  fsdp::checkpoint::load_safetensors(*again, dir + "/net.safetensors");
  TORCH_CHECK(max_local_diff(again, ref1) <= kTol, "load_safetensors put the strided pieces in the wrong places");
  fsdp::checkpoint::save(dir + "/a", fsdp::checkpoint::State{net.ptr(), &opt, {}});
  std::cout << "rank " << rank << ": dp " << dp << " x tp " << tp_size << ": init, step, state dict, export: ok"
            << std::endl;
}

FSDP_RANK_WORKER(tp_strided) { strided_worker(); }

// Blocks of 5 features at tp 2, a count that does not split the features, a count below 1,
// fused on an Embedding, fused with a Replicate output: each refused before anything changes.
FSDP_RANK_WORKER(tp_strided_refusals) {
  fsdp::models::register_tp_module_types();
  auto mesh = fsdp::init_device_mesh({2}, {"tp"});
  struct Net : torch::nn::Module {
    Net() {
      a = register_module("a", fsdp::models::Linear(4, 15, true, torch::kMeta));
      e = register_module("e", fsdp::models::Embedding(8, 6, torch::kMeta));
    }
    fsdp::models::Linear a{nullptr};
    fsdp::models::Embedding e{nullptr};
  };
  auto net = std::make_shared<Net>();
  auto refused = [&](tp::ColwiseParallel style, const std::string& module, const std::string& needle) {
    fsdp::testing::expect_error([&] { tp::parallelize_module(net, mesh, {{module, style}}); }, needle);
  };
  refused(tp::ColwiseParallel{.fused = 3}, "a",
          "fused blocks of 5 output features, which the tp size 2 does not divide");
  refused(tp::ColwiseParallel{.fused = 4}, "a", "do not split into 4 fused blocks");
  refused(tp::ColwiseParallel{.fused = 0}, "a", "is not a block count");
  refused(tp::ColwiseParallel{.fused = 2}, "e", "fused applies to a Linear only");
  refused(tp::ColwiseParallel{.output_layouts = tp::Replicate(), .fused = 5}, "a",
          "with output_layouts Replicate() is not supported");
  TORCH_CHECK(!tp::tp_placement(net->a->weight), "a refused plan changed the module");
}

fsdp::testing::RanksOptions opts(const std::string& phase, int dp, int tp_size, const std::string& dir) {
  fsdp::testing::RanksOptions o;
  o.timeout = std::chrono::milliseconds(180000);
  o.env = {{"PHASE", phase}, {"DP", std::to_string(dp)}, {"TP", std::to_string(tp_size)}, {"DIR", dir}};
  return o;
}

}  // namespace

TEST(TensorParallelStrided, FusedColwiseAtTpTwoSavesLoadsAndGathers) {
  fsdp::testing::TempDir dir("fsdp_tp_strided");
  EXPECT_RANKS_PASS(2, "tp_strided", opts("save", 1, 2, dir.path));
  EXPECT_RANKS_PASS(1, "tp_strided", opts("one", 1, 1, dir.path));
  EXPECT_RANKS_PASS(2, "tp_strided", opts("load", 1, 2, dir.path));
}

TEST(TensorParallelStrided, FusedColwiseUnderFsdpTwoByTwoSavesLoadsAndGathers) {
  fsdp::testing::TempDir dir("fsdp_tp_strided");
  EXPECT_RANKS_PASS(4, "tp_strided", opts("save", 2, 2, dir.path));
  EXPECT_RANKS_PASS(1, "tp_strided", opts("one", 1, 1, dir.path));
  EXPECT_RANKS_PASS(4, "tp_strided", opts("load", 2, 2, dir.path));
}

TEST(TensorParallelStrided, BadFusedCountsAreRefusedWithOneLine) {
  EXPECT_RANKS_PASS(2, "tp_strided_refusals", opts("refuse", 1, 2, ""));
}
