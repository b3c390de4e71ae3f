// fully_shard parity: N sharded ranks (1, 2, 3) against one process on the same global batch,
// float32 AdamW for 10 steps, with dimensions the world size does not divide. Each variant
// checks the losses of every step and every final shard against the single-process run.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "cpu_layout.h"
#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kBatch = 6;  // divisible by 1, 2 and 3
constexpr double kTolerance = 1e-6;

std::string mode() {
  const char* m = std::getenv("PARITY_MODE");
  return m ? m : "default";
}

// Blocks first, then the root: FSDP2's recipe.
void shard_blocks_then_root(GPT& model, fsdp::FullyShardOptions options = {}) {
  for (auto& block : model->blocks) fsdp::fully_shard(block, options);
  fsdp::fully_shard(model, options);
}

// Block 0's attention and wpe frozen (units partly without gradients), block 1 frozen whole (a
// unit that reduces nothing).
void freeze_some(GPT& model) {
  for (auto& p : model->blocks[0]->attn->parameters()) p.set_requires_grad(false);
  for (auto& p : model->blocks[1]->parameters()) p.set_requires_grad(false);
  for (auto& p : model->wpe->parameters()) p.set_requires_grad(false);
}

void report(const std::string& what, const TrainResult& got, const TrainResult& want, double worst) {
  if (fsdp::dist::rank() != 0) return;
  std::cout << what << ": " << got.losses.size() << " steps, first loss " << got.losses.front() << " last "
            << got.losses.back() << " (single process " << want.losses.back() << "), worst shard difference " << worst
            << " relative" << std::endl;
}

}  // namespace

FSDP_RANK_WORKER(gpt_parity) {
  const auto config = uneven_config();
  const std::string m = mode();
  ShardedRun run;
  int micro_batches = 1;
  std::vector<fsdp::FSDPModule> units;  // blocks, then root
  std::function<void(GPT&)> prepare;    // applied to the single process's model too
  if (m == "default") {
    run.shard = [](GPT& model) { shard_blocks_then_root(model); };
  } else if (m == "reshard_true" || m == "reshard_false") {
    run.shard = [m](GPT& model) {
      fsdp::FullyShardOptions o;
      o.reshard_after_forward = (m == "reshard_true");
      shard_blocks_then_root(model, o);
    };
  } else if (m == "list_group") {
    // The list form: final norm and head as one group (one all-gather, one reduce-scatter).
    run.shard = [](GPT& model) {
      for (auto& block : model->blocks) fsdp::fully_shard(block);
      fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->ln_f.ptr(), model->lm_head.ptr()});
      fsdp::fully_shard(model);
    };
  } else if (m == "root_only") {
    run.shard = [](GPT& model) { fsdp::fully_shard(model); };
  } else if (m == "grad_accumulation") {
    // 2 micro-batches without sync, then 1 synced: equals one step on all 3 (sum of gradients).
    micro_batches = 3;
    run.shard = [](GPT& model) { shard_blocks_then_root(model); };
    run.before_micro_batch = [](int micro, int total, GPT& model) {
      fsdp::fsdp_module(*model)->set_requires_gradient_sync(micro == total - 1);
    };
  } else if (m == "sync_every_micro_batch") {
    // Every micro-batch reduce-scatters, but only the last backward waits for the reductions
    // (set_is_last_backward(false) before): the pending ones land at the next forward.
    micro_batches = 3;
    run.shard = [](GPT& model) { shard_blocks_then_root(model); };
    run.before_micro_batch = [](int micro, int total, GPT& model) {
      if (micro > 0) fsdp::fsdp_module(*model)->set_is_last_backward(micro == total - 1);
    };
  } else if (m == "cpu_offload") {
    // On a CPU-only machine offloading changes no placement, but the policy must be accepted and
    // the run must still match (the CUDA path copies shards to the GPU for the all-gather).
    run.shard = [](GPT& model) {
      fsdp::FullyShardOptions o;
      o.offload_policy = fsdp::CPUOffloadPolicy{/*pin_memory=*/true};
      shard_blocks_then_root(model, o);
    };
  } else if (m == "explicit_unshard") {
    // The root unshards ahead of forward by hand (async), and reshards by hand after backward.
    run.shard = [](GPT& model) { shard_blocks_then_root(model); };
    run.forward = [](GPT& model, const at::Tensor& x) {
      auto root = *fsdp::fsdp_module(*model);
      auto handle = root.unshard(/*async_op=*/true);
      handle.wait();
      auto out = fsdp::call(model, x);
      // Explicit reshard/unshard of a block between uses is harmless.
      auto block = *fsdp::fsdp_module(*model->blocks[0]);
      block.unshard();
      block.reshard();
      return out;
    };
  } else if (m == "explicit_prefetch") {
    run.shard = [](GPT& model) {
      shard_blocks_then_root(model);
      std::vector<fsdp::FSDPModule> blocks;
      for (auto& b : model->blocks) blocks.push_back(*fsdp::fsdp_module(*b));
      for (size_t i = 0; i < blocks.size(); ++i) {
        if (i + 1 < blocks.size()) blocks[i].set_modules_to_forward_prefetch({blocks[i + 1]});
        if (i > 0) blocks[i].set_modules_to_backward_prefetch({blocks[i - 1]});
      }
    };
  } else if (m == "packed_pieces" || m == "per_unit") {
    // Per parameter (the default layout, fsdp/debug/cpu_collectives.h) with a min_piece_bytes this
    // model's shards straddle. packed_pieces, 1 KiB: every unit has weights of 2400 bytes or more
    // a rank (messages of their own) and biases and norms below (packed in one more message).
    // per_unit, 3000 bytes: the blocks' MLP weights (3200 bytes a rank) are above it, the root's
    // shards (2720 bytes at most) all below: blocks per parameter, the root flat.
    fsdp::CpuCollectiveOptions o;
    o.min_piece_bytes = m == "packed_pieces" ? 1024 : 3000;
    fsdp::set_cpu_collective_options(o);
    run.shard = [](GPT& model) { shard_blocks_then_root(model); };
  } else if (m == "flat" || m == "every_piece") {
    // The CPU collectives' two layouts (fsdp/debug/cpu_collectives.h): flat buffers for every
    // unit, or every parameter its own message.
    fsdp::CpuCollectiveOptions o;
    o.gather_per_parameter = o.reduce_per_parameter = (m == "every_piece");
    o.min_piece_bytes = 0;
    fsdp::set_cpu_collective_options(o);
    run.shard = [](GPT& model) { shard_blocks_then_root(model); };
  } else if (m == "frozen") {
    // Units partly without gradients (block 0's attention and wpe frozen) and one that reduces
    // nothing (block 1 frozen whole); the single process freezes the same.
    prepare = freeze_some;
    run.shard = [](GPT& model) {
      freeze_some(model);
      shard_blocks_then_root(model);
    };
  } else if (m == "tied") {
    // The head shares the token embedding; both sit in the root's group.
    run.shard = [](GPT& model) { shard_blocks_then_root(model); };
  } else if (m == "embeddings_apart" || m == "embeddings_apart_accumulation") {
    // The embeddings as a unit of their own that skips its backward all-gather (FSDP2's
    // set_unshard_in_backward(false)): their gradients need the indices, not the tables.
    // _accumulation: 2 micro-batches without sync, then 1 synced, the gradients accumulating on
    // parameters whose memory is freed.
    run.shard = [](GPT& model) {
      for (auto& block : model->blocks) fsdp::fully_shard(block);
      fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->wte.ptr(), model->wpe.ptr()})
          .set_unshard_in_backward(false);
      fsdp::fully_shard(model);
    };
    if (m == "embeddings_apart_accumulation") {
      micro_batches = 3;
      run.before_micro_batch = [](int micro, int total, GPT& model) {
        fsdp::fsdp_module(*model)->set_requires_gradient_sync(micro == total - 1);
      };
    }
  } else {
    TORCH_CHECK(false, "unknown PARITY_MODE ", m);
  }
  auto cfg = config;
  if (m == "tied") cfg.tie_weights = true;
  auto want = train_reference(cfg, kSteps, kBatch, micro_batches, prepare);
  auto got = train_sharded(cfg, kSteps, kBatch, micro_batches, run);
  check_losses_match(got.losses, want.losses, kTolerance);
  const double worst = check_shards_match(got.model, want.parameters, kTolerance);
  for (const auto& p : got.model->parameters()) {
    TORCH_CHECK(p.device().is_cpu() && (!p.grad().defined() || p.grad().device().is_cpu()),
                "shards and their gradients live on the CPU");
    TORCH_CHECK(p.grad().defined() == p.requires_grad(), "a gradient exactly where the parameter is trained");
  }
  if (fsdp::dist::world_size() > 1 &&
      (m == "default" || m == "flat" || m == "every_piece" || m == "packed_pieces" || m == "per_unit")) {
    // Which collectives moved the data (the flight recorder keeps their names). By default this
    // model's shards are all below min_piece_bytes (1 MiB), so every unit is flat.
    int gathers_flat = 0, gathers_pieces = 0, reduces_flat = 0, reduces_pieces = 0;
    for (const auto& r : fsdp::comm::FlightRecorder::process().snapshot()) {
      const std::string op = r.op;
      gathers_pieces += op == "all_gather_pieces";
      gathers_flat += op == "all_gather_into_tensor";
      reduces_pieces += op == "reduce_scatter_pieces";
      reduces_flat += op == "reduce_scatter_tensor";
    }
    // default under FSDP_CPU_PIECE_BYTES=0 (test_fully_shard_per_parameter, tests/README.md).
    const fsdp::CpuCollectiveOptions o = fsdp::cpu_collective_options();
    const bool every_piece_by_env =
        m == "default" && o.min_piece_bytes == 0 && o.gather_per_parameter && o.reduce_per_parameter;
    const bool per_parameter = m == "every_piece" || m == "packed_pieces" || every_piece_by_env;
    const bool ok = per_parameter ? (gathers_flat == 0 && gathers_pieces > 0 && reduces_flat == 0 && reduces_pieces > 0)
                    : m == "per_unit"
                        ? (gathers_flat > 0 && gathers_pieces > 0 && reduces_flat > 0 && reduces_pieces > 0)
                        : (gathers_flat > 0 && gathers_pieces == 0 && reduces_flat > 0 && reduces_pieces == 0);
    TORCH_CHECK(ok, m, ": the data moved in ", gathers_flat, " flat all-gathers, ", gathers_pieces,
                " all-gathers of pieces, ", reduces_flat, " flat reduce-scatters and ", reduces_pieces,
                " reduce-scatters of pieces");
    // Where the flat layout keeps them, a block's shards live side by side in one buffer, in the
    // order of its parameters, and the optimizer's parameters are those same tensors.
    const bool buffered = (m == "default" && !every_piece_by_env) || m == "flat";
    for (const auto& block : got.model->blocks) {
      std::set<const void*> storages;
      const at::Tensor* prev = nullptr;
      for (const auto& p : block->parameters()) {
        storages.insert(p.storage().unsafeGetStorageImpl());
        if (buffered && prev != nullptr) {
          TORCH_CHECK(p.storage_offset() >= prev->storage_offset() + prev->numel(),
                      "a block's shards lie side by side in its buffer, in order");
        }
        prev = &p;
      }
      const size_t want = buffered ? 1 : storages.size();
      TORCH_CHECK(storages.size() == want, m, ": a block's ", block->parameters().size(), " shards live in ",
                  storages.size(), " storages, expected ", want);
    }
  }
  report(m, got, want, worst);
}

struct ParityCase {
  std::string mode;
  int world;
};

class GptParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(GptParity, MatchesSingleProcess) {
  RanksOptions o;
  o.env["PARITY_MODE"] = GetParam().mode;
  auto r = run_ranks(GetParam().world, "gpt_parity", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

INSTANTIATE_TEST_SUITE_P(
    Sharded, GptParity,
    ::testing::Values(ParityCase{"default", 1}, ParityCase{"default", 2}, ParityCase{"default", 3},
                      ParityCase{"reshard_true", 2}, ParityCase{"reshard_false", 3}, ParityCase{"root_only", 2},
                      ParityCase{"list_group", 3}, ParityCase{"grad_accumulation", 2},
                      ParityCase{"grad_accumulation", 3}, ParityCase{"sync_every_micro_batch", 2},
                      ParityCase{"cpu_offload", 2}, ParityCase{"explicit_unshard", 2},
                      ParityCase{"explicit_prefetch", 3}, ParityCase{"tied", 2}, ParityCase{"flat", 2},
                      ParityCase{"frozen", 3}, ParityCase{"every_piece", 2}, ParityCase{"every_piece", 3},
                      ParityCase{"packed_pieces", 2}, ParityCase{"per_unit", 2}, ParityCase{"embeddings_apart", 1},
                      ParityCase{"embeddings_apart", 2}, ParityCase{"embeddings_apart_accumulation", 3}),
    [](const auto& info) { return info.param.mode + "_" + std::to_string(info.param.world) + "ranks"; });

// Per-rank bytes of parameters + gradients + AdamW state at N=2 against one process.
FSDP_RANK_WORKER(memory_halves) {
  fsdp::models::GPTConfig c;
  c.vocab_size = 256;
  c.block_size = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 64;
  auto want = train_reference(c, 2, 4, 1);
  ShardedRun run;
  run.shard = [](GPT& model) { shard_blocks_then_root(model); };
  auto got = train_sharded(c, 2, 4, 1, run);
  const double ratio = got.state_bytes / want.state_bytes;
  if (fsdp::dist::rank() == 0) {
    std::cout << "training state per rank: " << got.state_bytes / 1e6 << " MB sharded vs " << want.state_bytes / 1e6
              << " MB in one process, ratio " << ratio << std::endl;
  }
  TORCH_CHECK(ratio <= 0.52, "per-rank training state is ", ratio, " of one process's (limit 0.52)");
}

TEST(FullyShardMemory, TwoRanksHoldAboutHalf) {
  auto r = run_ranks(2, "memory_halves");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

// set_gradient_divide_factor(1.0): gradients are summed over the ranks instead of averaged.
FSDP_RANK_WORKER(gradient_divide_factor) {
  const auto c = uneven_config();
  auto grads_with = [&](std::optional<double> factor) {
    torch::manual_seed(42);
    GPT model(c);
    shard_blocks_then_root(model);
    if (factor) {
      for (auto& b : model->blocks) fsdp::fsdp_module(*b)->set_gradient_divide_factor(*factor);
      fsdp::fsdp_module(*model)->set_gradient_divide_factor(*factor);
    }
    auto data = global_batch(c, 6, 0, 0).narrow(0, 3 * fsdp::dist::rank(), 3);
    fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size))
        .backward();
    std::vector<at::Tensor> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
    return grads;
  };
  auto averaged = grads_with(std::nullopt);
  auto summed = grads_with(1.0);
  const int n = fsdp::dist::world_size();
  for (size_t i = 0; i < averaged.size(); ++i) {
    TORCH_CHECK(summed[i].allclose(averaged[i] * n, 1e-5, 1e-7), "gradient ", i, " is not the sum over ranks");
  }
}

TEST(FullyShardSettings, GradientDivideFactorOneSums) {
  auto r = run_ranks(2, "gradient_divide_factor");
  EXPECT_TRUE(r.all_ok()) << r.report();
}

// set_unshard_in_backward(false) on the embeddings' unit: backward issues fewer all-gathers than
// with it on (the parity cases embeddings_apart* check the numbers). On a block, whose linears
// need their weights in backward, backward fails with LibTorch's error for a tensor without
// memory instead of reading freed memory ([Note: unshard_in_backward] in
// src/sharding/fsdp_param_group.h).
FSDP_RANK_WORKER(unshard_in_backward) {
  const auto c = uneven_config();
  const int rank = fsdp::dist::rank();
  // All-gathers issued by three backwards, the embeddings' unit (or block 0) gathering in
  // backward or not.
  auto backward_gathers = [&](bool unshard_in_backward, bool on_a_block) {
    torch::manual_seed(42);
    GPT model(c);
    for (auto& block : model->blocks) fsdp::fully_shard(block);
    auto embeddings =
        fsdp::fully_shard(std::vector<std::shared_ptr<torch::nn::Module>>{model->wte.ptr(), model->wpe.ptr()});
    fsdp::fully_shard(model);
    (on_a_block ? *fsdp::fsdp_module(*model->blocks[0]) : embeddings).set_unshard_in_backward(unshard_in_backward);
    uint64_t gathers = 0;
    for (int step = 0; step < 3; ++step) {
      const auto data = global_batch(c, 6, step, 0).narrow(0, 3 * rank, 3);
      auto loss =
          fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size));
      const auto before = fsdp::comm::process_comm_stats().snapshot();
      loss.backward();
      gathers += (fsdp::comm::process_comm_stats().snapshot() - before)[fsdp::comm::OpKind::AllGather].calls;
      model->zero_grad();
    }
    return gathers;
  };
  const uint64_t with = backward_gathers(true, false), without = backward_gathers(false, false);
  if (rank == 0)
    std::cout << "backward all-gathers in 3 steps: " << with << " gathering the embeddings, " << without << " without"
              << std::endl;
  TORCH_CHECK(without < with, "set_unshard_in_backward(false) left backward's all-gathers at ", without, " (", with,
              " with it on)");
  try {
    backward_gathers(false, true);
    TORCH_CHECK(false, "backward read a block's parameters after set_unshard_in_backward(false) without an error");
  } catch (const c10::Error& e) {
    const std::string what = e.what();
    TORCH_CHECK(what.find("storage of size 0") != std::string::npos ||
                    what.find("data is not allocated yet") != std::string::npos,
                "backward needing a block's parameters failed otherwise: ", what.substr(0, 300));
    if (rank == 0) std::cout << "on a block: " << what.substr(0, what.find('\n')) << std::endl;
  }
}

TEST(FullyShardSettings, UnshardInBackwardFalseSkipsTheGatherAndFailsWhereBackwardNeedsIt) {
  auto r = run_ranks(2, "unshard_in_backward");
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

// Gradients that do not exist yet (the first step, or zero_grad setting them to none) become this
// rank's rows of one buffer per unit, as FSDP2's are views of its reduce-scatter output, instead
// of a copy each: a unit's gradients share that buffer, are not autograd views (LibTorch 1.13's
// zero_grad detach_()s them), equal the one-process gradient's rows, stay independent when one is
// zeroed in place, and accumulate over a second backward.
FSDP_RANK_WORKER(grads_share_unit_buffer) {
  const fsdp::testing::FlatCpuCollectives flat;  // whatever the environment says
  const auto c = uneven_config();
  const int rank = fsdp::dist::rank();
  const auto data = global_batch(c, 6, 0, 0);
  torch::manual_seed(42);
  GPT full(c);
  fsdp::models::gpt_loss(full->forward(data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size)).backward();
  std::map<std::string, at::Tensor> want;
  for (const auto& p : full->named_parameters()) want[p.key()] = p.value().grad().clone();

  torch::manual_seed(42);
  GPT model(c);
  shard_blocks_then_root(model);
  const auto mine = data.narrow(0, 3 * rank, 3);
  auto backward = [&] {
    fsdp::models::gpt_loss(fsdp::call(model, mine.narrow(1, 0, c.block_size)), mine.narrow(1, 1, c.block_size))
        .backward();
  };
  // Each gradient against `scale` times the one-process gradient's rows (`skip`: the one zeroed).
  auto check = [&](double scale, const at::Tensor& skip) {
    for (const auto& p : model->named_parameters()) {
      if (p.value().is_same(skip)) continue;
      const auto info = fsdp::shard_info(p.value());
      at::Tensor rows = want.at(p.key());
      rows = (rows.dim() == 0 ? rows.reshape({1}) : rows).narrow(0, info->dim0_offset, info->local_rows);
      TORCH_CHECK(p.value().grad().defined(), p.key(), " has no gradient");
      TORCH_CHECK(p.value().grad().allclose(rows * scale, 1e-4, 1e-6), p.key(), ": gradient differs from ", scale,
                  " x the one-process gradient's rows");
    }
  };
  backward();
  std::vector<at::Tensor> block = model->blocks[0]->parameters();
  for (const auto& p : block) {
    TORCH_CHECK(!p.grad().is_view(), "a gradient must not be an autograd view (optimizers detach_() it)");
    TORCH_CHECK(p.grad().is_alias_of(block[0].grad()), "a unit's new gradients must share one buffer");
  }
  check(1.0, {});
  {
    torch::NoGradGuard no_grad;
    block[0].grad().detach_();  // what LibTorch 1.13's Optimizer::zero_grad does
    block[0].grad().zero_();
  }
  check(1.0, block[0]);
  TORCH_CHECK(block[0].grad().abs().sum().item<double>() == 0.0, "the zeroed gradient must stay zero");
  backward();
  check(2.0, block[0]);
}

TEST(FullyShardGradients, NewGradientsShareOneBufferPerUnit) {
  auto r = run_ranks(2, "grads_share_unit_buffer");
  EXPECT_TRUE(r.all_ok()) << r.report();
}
