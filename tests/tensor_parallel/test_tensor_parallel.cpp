// Tensor parallelism with real processes: TP alone at 2 ranks and FSDP + TP at dp=2 x tp=2, with
// and without sequence parallelism and loss_parallel, trained 10 AdamW steps against one process
// on the global batch (losses, gradient norms and every parameter within 1e-5); meta-device init
// equal to the unsharded model's values; loss_parallel against the gathered cross-entropy.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "tp_model.h"

namespace {

using fsdp::testing::global_batch;
using fsdp::testing::make_optimizer;
using fsdp::testing::max_param_diff;
using fsdp::testing::rel_diff;
using fsdp::testing::snapshot;
using fsdp::testing::TPModel;
using fsdp::testing::TPModelConfig;
namespace F = torch::nn::functional;
namespace tp = fsdp::tp;

constexpr int kSteps = 10;
constexpr int64_t kBatch = 4;
constexpr double kTol = 1e-5;

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == "1";
}

// TP_SIZE, TP_SP, TP_LOSS_PARALLEL, TP_META, TP_HSDP from the environment; dp = world / tp.
// TP_HSDP: a 3-D {"replicate", "shard", "tp"} mesh with shard size 1 (HSDP over the replicas).
void train_and_compare() {
  const int world = fsdp::dist::world_size();
  const int tp_size = std::atoi(std::getenv("TP_SIZE"));
  const bool sp = env_flag("TP_SP"), lp = env_flag("TP_LOSS_PARALLEL"), meta = env_flag("TP_META");
  const bool hsdp = env_flag("TP_HSDP"), act = env_flag("TP_ACT"), last_dim = env_flag("TP_SHARD_LAST_DIM");
  const int dp = world / tp_size;
  TPModelConfig c;

  TPModel ref(c);
  auto ref_opt = make_optimizer(*ref);

  auto mesh = hsdp ? fsdp::init_device_mesh({dp, 1, tp_size}, {"replicate", "shard", "tp"})
                   : fsdp::init_device_mesh({dp, tp_size}, {"dp", "tp"});
  // The data-parallel part: what fully_shard takes, and flattened, the ranks that split the batch.
  auto fsdp_mesh = hsdp ? mesh[{"replicate", "shard"}] : mesh["dp"];
  auto dp_mesh = fsdp_mesh.flatten("dp");
  TORCH_CHECK(dp_mesh.size() == dp);
  TPModelConfig pc = c;
  if (meta) pc.device = torch::kMeta;
  TPModel model(pc);
  tp::parallelize_module(model, mesh["tp"], fsdp::testing::tp_plan(sp, lp));
  if (dp > 1) {
    fsdp::FullyShardOptions opts{.mesh = fsdp_mesh};
    // TP_SHARD_LAST_DIM: FSDP splits the (TP-local) matrices along their last dim.
    if (last_dim) {
      opts.shard_placement_fn = [](const std::string&, const at::Tensor& p) -> std::optional<int64_t> {
        return p.dim() >= 2 ? std::optional<int64_t>(p.dim() - 1) : std::nullopt;
      };
    }
    for (auto& b : model->typed_blocks) fsdp::fully_shard(b, opts);
    fsdp::fully_shard(model, opts);
  }
  if (act) {  // every block recomputed in backward: its TP collectives run again, on every rank
    TORCH_CHECK(fsdp::activation::apply_activation_checkpointing(
                    *model, fsdp::activation::every_kth<fsdp::testing::TPBlockImpl>(1)) == 2);
  }
  if (meta) {
    fsdp::to_empty(*model, torch::kCPU);
    model->reset_parameters();
  }
  // Initial values: exactly the unsharded model's, whatever the (dp, tp) layout and init path.
  TORCH_CHECK(max_param_diff(model, snapshot(ref), kTol, dp == 1) == 0.0, "initial parameters differ");
  auto opt = make_optimizer(*model);
  auto dp_comm = dp_mesh.comm();
  auto tp_comm = mesh["tp"].comm();
  std::vector<double> step_seconds;
  const int dp_rank = dp_mesh.get_local_rank(0);

  for (int s = 0; s < kSteps; ++s) {
    at::Tensor batch = global_batch(c, s, kBatch, 1000);
    at::Tensor x = batch.narrow(1, 0, c.seq), y = batch.narrow(1, 1, c.seq);
    ref_opt.zero_grad();
    at::Tensor ref_loss = F::cross_entropy(ref->forward(x).view({-1, c.vocab}), y.reshape(-1));
    ref_loss.backward();
    const double ref_norm = fsdp::clip_grad_norm_(ref->parameters(), 0.5);
    ref_opt.step();

    auto t0 = std::chrono::steady_clock::now();
    auto tp_before = tp_comm->stats().snapshot();
    auto dp_before = dp_comm->stats().snapshot();
    opt.zero_grad();
    const int64_t b = kBatch / dp;
    at::Tensor lx = x.narrow(0, dp_rank * b, b), ly = y.narrow(0, dp_rank * b, b).contiguous();
    at::Tensor logits = fsdp::call(model, lx);
    at::Tensor loss =
        lp ? tp::loss_parallel(logits, ly, mesh["tp"]) : F::cross_entropy(logits.view({-1, c.vocab}), ly.reshape(-1));
    loss.backward();
    const double norm = fsdp::clip_grad_norm_(model->parameters(), 0.5);
    opt.step();
    step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    auto tp_bytes = tp_comm->stats().snapshot() - tp_before;
    auto dp_bytes = dp_comm->stats().snapshot() - dp_before;
    if (s == 0) {
      std::cout << "step 0 bytes sent, tp group: " << tp_bytes.to_string() << "; dp group: " << dp_bytes.to_string()
                << std::endl;
      if (!sp && !lp && tp_size > 1) {
        // Counted like FSDP's: every TP collective of a step, exactly. Per step (no sequence
        // parallelism): all-reduces of a [b, T, C] activation, 1 + 2 per layer in forward (the
        // embedding's and each row-wise output) and 1 + 4 per layer in backward (each column-wise
        // input's gradient: the head, q, k, v, fc), the clip norm's 8-byte double; one all-gather
        // of the [b, T, V] logits.
        const double n = tp_size, act = static_cast<double>(b * c.seq * c.dim * 4);
        const double want_ar = (2 + 6 * c.layers) * 2 * (n - 1) / n * act + 2 * (n - 1) / n * 8;
        const double want_ag = (n - 1) / n * static_cast<double>(b * c.seq * c.vocab * 4);
        const auto& ar = tp_bytes[fsdp::comm::OpKind::AllReduce];
        const auto& ag = tp_bytes[fsdp::comm::OpKind::AllGather];
        std::cout << "tp all-reduce bytes " << ar.bytes_sent << " (expected " << want_ar << "), all-gather "
                  << ag.bytes_sent << " (expected " << want_ag << ")" << std::endl;
        TORCH_CHECK(static_cast<double>(ar.bytes_sent) == want_ar && static_cast<double>(ag.bytes_sent) == want_ag,
                    "tp bytes differ from the expected ones");
        TORCH_CHECK(tp_bytes[fsdp::comm::OpKind::ReduceScatter].calls == 0);
      }
    }
    at::Tensor global_loss = loss.detach().clone().reshape({1});
    dp_comm->all_reduce(global_loss, fsdp::comm::ReduceOp::Avg);
    const double l = global_loss.item<double>(), rl = ref_loss.item<double>();
    std::cout << "step " << s << " loss " << l << " (one process " << rl << ") grad norm " << norm << " (" << ref_norm
              << ")" << std::endl;
    TORCH_CHECK(rel_diff(l, rl) <= kTol, "step ", s, ": loss ", l, " vs one process ", rl);
    TORCH_CHECK(rel_diff(norm, ref_norm) <= kTol, "step ", s, ": grad norm ", norm, " vs one process ", ref_norm);
  }
  const double worst = max_param_diff(model, snapshot(ref), kTol, dp == 1);
  if (last_dim) {
    // The full state dict undoes both splits (FSDP's along the last dim, then TP's).
    int64_t along_last = 0;
    for (const auto& p : model->parameters()) along_last += fsdp::shard_info(p) && fsdp::shard_info(p)->shard_dim > 0;
    TORCH_CHECK(along_last > 0, "no parameter was sharded along its last dim");
    const auto want = snapshot(ref);
    for (const auto& [key, value] : fsdp::checkpoint::get_model_state_dict(*model, {.full_state_dict = true})) {
      TORCH_CHECK(value.sizes() == want.at(key).sizes(), key, ": full state dict shape ", value.sizes());
      TORCH_CHECK((value - want.at(key)).abs().max().item<double>() <= kTol, key, ": full state dict differs");
    }
  }
  std::cout << "largest parameter difference after " << kSteps << " steps: " << worst << std::endl;
  std::sort(step_seconds.begin(), step_seconds.end());
  std::cout << "median step time " << step_seconds[step_seconds.size() / 2] << " s" << std::endl;
  auto bytes = fsdp::comm::process_comm_stats().snapshot();
  std::cout << "bytes sent by this rank: " << bytes.to_string() << std::endl;
  TORCH_CHECK(bytes.total_bytes() > 0);
}

FSDP_RANK_WORKER(tp_train) { train_and_compare(); }

fsdp::testing::RanksOptions opts(const std::string& tp_size, bool sp, bool lp, bool meta, bool hsdp = false,
                                 bool act = false, bool last_dim = false) {
  fsdp::testing::RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  o.env = {{"TP_SIZE", tp_size},
           {"TP_SP", sp ? "1" : "0"},
           {"TP_LOSS_PARALLEL", lp ? "1" : "0"},
           {"TP_META", meta ? "1" : "0"},
           {"TP_HSDP", hsdp ? "1" : "0"},
           {"TP_ACT", act ? "1" : "0"},
           {"TP_SHARD_LAST_DIM", last_dim ? "1" : "0"}};
  return o;
}

}  // namespace

TEST(TensorParallel, TpTwoRanksMatchesOneProcess) { EXPECT_RANKS_PASS(2, "tp_train", opts("2", false, false, false)); }

TEST(TensorParallel, TpTwoRanksSequenceParallelLossParallelMetaInit) {
  EXPECT_RANKS_PASS(2, "tp_train", opts("2", true, true, true));
}

TEST(TensorParallel, DpTwoTpTwoMatchesOneProcess) { EXPECT_RANKS_PASS(4, "tp_train", opts("2", false, false, false)); }

TEST(TensorParallel, DpTwoTpTwoSequenceParallelLossParallelMetaInit) {
  EXPECT_RANKS_PASS(4, "tp_train", opts("2", true, true, true));
}

// FSDP's shard_placement_fn on TP-local parameters: matrices split along their last dim (the
// column-wise layers' other dim, the row-wise layers' TP dim), from the meta device.
TEST(TensorParallel, DpTwoTpTwoShardAlongLastDimMetaInit) {
  EXPECT_RANKS_PASS(4, "tp_train", opts("2", true, true, true, false, false, /*last_dim=*/true));
}

// HSDP + TP on a 3-D {"replicate", "shard", "tp"} mesh (sequence parallel, no loss_parallel):
// fully_shard over mesh[{"replicate", "shard"}].
TEST(TensorParallel, HsdpTimesTpThreeDimMeshMatchesOneProcess) {
  EXPECT_RANKS_PASS(4, "tp_train", opts("2", true, false, false, /*hsdp=*/true));
}

TEST(TensorParallel, TpTwoRanksLossParallelOnly) { EXPECT_RANKS_PASS(2, "tp_train", opts("2", false, true, false)); }

// Activation checkpointing on every block, sequence parallel, FSDP + TP.
TEST(TensorParallel, DpTwoTpTwoSequenceParallelActivationCheckpointing) {
  EXPECT_RANKS_PASS(4, "tp_train", opts("2", true, false, false, false, /*act=*/true));
}
