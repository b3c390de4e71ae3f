// HSDP (fully_shard on a 2-D replicate x shard mesh) and integer reshard_after_forward: N ranks
// against one process on the same global batch, float32 AdamW for 10 steps, with the uneven GPT
// (dimensions 2 and 4 do not divide). Losses of every step and every final shard must match.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "fsdp/debug.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "parity.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using fsdp::models::GPT;

namespace {

constexpr int kSteps = 10;
constexpr int64_t kBatch = 8;  // divisible by 2 and 4
constexpr double kTolerance = 1e-6;

void shard_blocks_then_root(GPT& model, const fsdp::FullyShardOptions& options) {
  for (auto& block : model->blocks) fsdp::fully_shard(block, options);
  fsdp::fully_shard(model, options);
}

// "RxS" -> init_device_mesh({R, S}, {"replicate", "shard"}).
fsdp::DeviceMesh hsdp_mesh(const std::string& shape) {
  const auto x = shape.find('x');
  return fsdp::init_device_mesh({std::stoll(shape.substr(0, x)), std::stoll(shape.substr(x + 1))},
                                {"replicate", "shard"});
}

}  // namespace

// PARITY_MODE: hsdp | hsdp_no_sync | hsdp_no_all_reduce | reshard_int | reshard_int_no_sync |
// hsdp_reshard_int (both, on a 1 x world mesh so the shard group is the world) |
// hook_replicas (1-D FSDP over mesh["shard"], the replicas averaged by an all-reduce hook: HSDP
// that FSDP does not manage; with a shard size of 1 the group of one, which otherwise reduces
// nothing, reduces for the hook) | hsdp_hook (native HSDP with a hook that checks it sees the
// replicas' all-reduced gradients) | hsdp_force_sum (set_force_sum_reduction_for_comms);
// MESH: "RxS" for HSDP and the hooks; RESHARD: the integer for reshard_int*.
FSDP_RANK_WORKER(hsdp_parity) {
  const auto config = uneven_config();
  const std::string m = env("PARITY_MODE", "hsdp");
  fsdp::FullyShardOptions options;
  if (m.rfind("hsdp", 0) == 0) options.mesh = hsdp_mesh(env("MESH", "2x2"));
  if (m.find("reshard_int") != std::string::npos) options.reshard_after_forward = std::stoi(env("RESHARD", "2"));
  ShardedRun run;
  run.shard = [options](GPT& model) { shard_blocks_then_root(model, options); };
  auto hook_calls = std::make_shared<int64_t>(0);
  if (m == "hook_replicas" || m == "hsdp_hook") {
    const auto mesh = hsdp_mesh(env("MESH", "2x2"));
    if (m == "hook_replicas") options.mesh = mesh["shard"];
    const auto replicas = mesh.get_group("replicate");
    const bool native = m == "hsdp_hook";
    run.shard = [options, replicas, native, hook_calls](GPT& model) {
      shard_blocks_then_root(model, options);
      const std::function<void(const at::Tensor&)> hook = [replicas, native, hook_calls](const at::Tensor& g) {
        ++*hook_calls;
        TORCH_CHECK(g.dim() == 1 && g.scalar_type() == at::kFloat, "the reduce output: flat float32, got ", g.sizes(),
                    " ", g.scalar_type());
        if (!native) {
          replicas->all_reduce(g, fsdp::comm::ReduceOp::Avg);
          return;
        }
        // Under native HSDP the replicas' all-reduce came first: every replica holds the same rows.
        at::Tensor most = g.clone();
        replicas->all_reduce(most, fsdp::comm::ReduceOp::Max);
        TORCH_CHECK(most.equal(g), "the hook ran before the all-reduce over the replicas");
      };
      for (auto& block : model->blocks) fsdp::fsdp_module(*block)->set_all_reduce_hook(hook);
      fsdp::fsdp_module(*model)->set_all_reduce_hook(hook);
    };
  }
  int micro_batches = 1;
  if (m == "hsdp_no_sync" || m == "reshard_int_no_sync") {
    // Accumulation without any communication: 2 micro-batches, then 1 synced.
    micro_batches = 3;
    run.before_micro_batch = [](int micro, int total, GPT& model) {
      fsdp::fsdp_module(*model)->set_requires_gradient_sync(micro == total - 1);
    };
  } else if (m == "hsdp_no_all_reduce") {
    // Reduce-scatter every micro-batch, all-reduce over the replicas only on the last.
    micro_batches = 3;
    run.before_micro_batch = [](int micro, int total, GPT& model) {
      fsdp::fsdp_module(*model)->set_requires_all_reduce(micro == total - 1);
    };
  } else if (m == "hsdp_force_sum") {
    // Sum over the shard group and over the replicas, then one divide by R * S.
    run.shard = [options](GPT& model) {
      shard_blocks_then_root(model, options);
      for (auto& block : model->blocks) fsdp::fsdp_module(*block)->set_force_sum_reduction_for_comms(true);
      fsdp::fsdp_module(*model)->set_force_sum_reduction_for_comms(true);
    };
  } else if (m != "hsdp" && m != "reshard_int" && m != "hsdp_reshard_int" && m != "hook_replicas" && m != "hsdp_hook") {
    TORCH_CHECK(false, "unknown PARITY_MODE ", m);
  }
  auto want = train_reference(config, kSteps, kBatch, micro_batches);
  const auto before = fsdp::dist::world_comm()->stats().snapshot();
  auto got = train_sharded(config, kSteps, kBatch, micro_batches, run);
  const auto world_ops = fsdp::dist::world_comm()->stats().snapshot() - before;
  check_losses_match(got.losses, want.losses, kTolerance);
  const double worst = check_shards_match(got.model, want.parameters, kTolerance);
  if (options.mesh && options.mesh->ndim() == 2) {
    // The checkpoint contract: rows within the shard group, the replica index alongside.
    for (const auto& p : got.model->parameters()) {
      auto info = fsdp::shard_info(p);
      TORCH_CHECK(info && info->num_replicas == options.mesh->size(0) &&
                      info->replica_rank == options.mesh->get_local_rank(0) && info->mesh.ndim() == 1 &&
                      info->mesh.size() == options.mesh->size(1),
                  "shard_info under HSDP");
    }
    // The save protocol the checkpoint relies on: replica 0 of each shard position contributes
    // its rows, and together they rebuild every full parameter exactly once.
    for (const auto& p : got.model->named_parameters()) {
      auto info = *fsdp::shard_info(p.value());
      at::Tensor full = at::zeros(info.global_shape, at::kFloat);
      at::Tensor rows = full.dim() == 0 ? full.view({1}) : full;
      if (info.replica_rank == 0) rows.narrow(0, info.dim0_offset, info.local_rows).copy_(p.value().detach());
      fsdp::dist::world_comm()->all_reduce(full);
      const at::Tensor& ref = want.parameters.at(p.key());
      TORCH_CHECK(((full - ref).abs() / ref.abs().clamp_min(1.0)).max().item<double>() <= kTolerance, p.key(),
                  ": rows written by replica 0 do not rebuild the parameter");
    }
  }
  if (m == "hook_replicas" || m == "hsdp_hook") {
    // Once per unit (2 blocks + root) and synced backward, on every rank.
    const int64_t want_calls = 3 * kSteps;
    TORCH_CHECK(*hook_calls == want_calls, "the all-reduce hook ran ", *hook_calls, " times; expected ", want_calls);
  }
  if (m.find("reshard_int") != std::string::npos) {
    // Backward gathers within the post-forward groups: the full shard group (here the world) only
    // gathers in forward, once per unit (2 blocks + root) per micro-batch.
    const uint64_t forward_gathers = static_cast<uint64_t>(3 * micro_batches * kSteps);
    TORCH_CHECK(world_ops[fsdp::comm::OpKind::AllGather].calls == forward_gathers, "expected ", forward_gathers,
                " all-gathers over the whole shard group, got ", world_ops[fsdp::comm::OpKind::AllGather].calls);
  }
  if (fsdp::dist::rank() == 0) {
    std::cout << m << ": " << kSteps << " steps, last loss " << got.losses.back() << " (single process "
              << want.losses.back() << "), worst shard difference " << worst << " relative; world comm "
              << world_ops.to_string() << std::endl;
  }
}

struct HsdpCase {
  std::string mode, mesh;
  int world;
  int reshard = 0;
};

class HsdpParity : public ::testing::TestWithParam<HsdpCase> {};

TEST_P(HsdpParity, MatchesSingleProcess) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(600000);  // 4 ranks on 2 shared cores
  o.env["PARITY_MODE"] = GetParam().mode;
  o.env["MESH"] = GetParam().mesh;
  o.env["RESHARD"] = std::to_string(GetParam().reshard);
  auto r = run_ranks(GetParam().world, "hsdp_parity", o);
  EXPECT_TRUE(r.all_ok()) << r.report();
  if (r.all_ok()) std::cout << r.ranks[0].output;
}

INSTANTIATE_TEST_SUITE_P(Hsdp, HsdpParity,
                         ::testing::Values(HsdpCase{"hsdp", "2x2", 4}, HsdpCase{"hsdp_no_sync", "2x2", 4},
                                           HsdpCase{"hsdp_no_all_reduce", "2x2", 4}, HsdpCase{"hsdp", "2x1", 2},
                                           HsdpCase{"reshard_int", "", 4, 2}, HsdpCase{"reshard_int_no_sync", "", 4, 2},
                                           HsdpCase{"reshard_int", "", 2, 1}, HsdpCase{"hsdp_reshard_int", "1x4", 4, 2},
                                           HsdpCase{"hook_replicas", "2x2", 4}, HsdpCase{"hook_replicas", "2x1", 2},
                                           HsdpCase{"hsdp_hook", "2x2", 4}, HsdpCase{"hsdp_force_sum", "2x2", 4}),
                         [](const auto& info) {
                           std::string mesh = info.param.mesh.empty() ? "" : "_" + info.param.mesh;
                           std::string k = info.param.reshard ? "_k" + std::to_string(info.param.reshard) : "";
                           return info.param.mode + mesh + k + "_" + std::to_string(info.param.world) + "ranks";
                         });

// Bad input on 4 ranks (2x2 possible): clear errors that name the problem and the fix.
FSDP_RANK_WORKER(hsdp_errors) {
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
    } catch (const std::exception& e) {
      TORCH_CHECK(std::string(e.what()).find(needle) != std::string::npos, "error '", e.what(), "' lacks '", needle,
                  "'");
      return;
    }
    TORCH_CHECK(false, "no error; expected one mentioning '", needle, "'");
  };
  const auto c = uneven_config();
  // Swapped names: dim 0 must replicate.
  auto swapped = fsdp::init_device_mesh({2, 2}, {"shard", "replicate"});
  expect_error(
      [&] {
        GPT m(c);
        fsdp::FullyShardOptions o;
        o.mesh = swapped;
        fsdp::fully_shard(m, o);
      },
      "dim 0 must be the replicate dimension");
  // Unnamed dimensions.
  auto unnamed = fsdp::init_device_mesh({2, 2});
  expect_error(
      [&] {
        GPT m(c);
        fsdp::FullyShardOptions o;
        o.mesh = unnamed;
        fsdp::fully_shard(m, o);
      },
      "{\"replicate\", \"shard\"}");
  // Sizes that do not fit the world.
  expect_error([] { fsdp::init_device_mesh({3, 2}, {"replicate", "shard"}); }, "holds 6 ranks but the world has 4");
  // A 3-D mesh.
  auto three = fsdp::init_device_mesh({1, 2, 2}, {"pp", "replicate", "shard"});
  expect_error(
      [&] {
        GPT m(c);
        fsdp::FullyShardOptions o;
        o.mesh = three;
        fsdp::fully_shard(m, o);
      },
      "3-D mesh");
  // An integer that does not divide the shard size (4 on the 1-D mesh, 2 under 2x2 HSDP).
  expect_error(
      [] {
        GPT m(uneven_config());
        fsdp::FullyShardOptions o;
        o.reshard_after_forward = 3;
        fsdp::fully_shard(m, o);
      },
      "reshard_after_forward = 3 does not divide the shard size 4; use a divisor of it (1, 2, 4)");
  auto hsdp = fsdp::init_device_mesh({2, 2}, {"replicate", "shard"});
  expect_error(
      [&] {
        GPT m(c);
        fsdp::FullyShardOptions o;
        o.mesh = hsdp;
        o.reshard_after_forward = 4;
        fsdp::fully_shard(m, o);
      },
      "does not divide the shard size 2");
  expect_error(
      [] {
        GPT m(uneven_config());
        fsdp::FullyShardOptions o;
        o.reshard_after_forward = 0;
        fsdp::fully_shard(m, o);
      },
      "does not divide");
  // The all-reduce hook's stream: none under HSDP (FSDP2's rule), none on the CPU.
  {
    GPT m(c);
    fsdp::FullyShardOptions o;
    o.mesh = hsdp;
    fsdp::fully_shard(m, o);
    const c10::Stream cpu_stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU));
    expect_error([&] { fsdp::fsdp_module(*m)->set_all_reduce_hook([](const at::Tensor&) {}, cpu_stream); },
                 "no stream under HSDP");
    GPT flat(c);
    fsdp::fully_shard(flat);
    expect_error([&] { fsdp::fsdp_module(*flat)->set_all_reduce_hook([](const at::Tensor&) {}, cpu_stream); },
                 "streams are for GPUs");
  }
  // replicate takes a 1-D mesh.
  expect_error(
      [&] {
        GPT m(c);
        fsdp::replicate(m, fsdp::ReplicateOptions{hsdp});
      },
      "replicate takes the 1-D mesh");
  // A refused call changed nothing: the model still shards afterwards.
  GPT ok(c);
  fsdp::FullyShardOptions o;
  o.mesh = hsdp;
  fsdp::fully_shard(ok, o);
  // A module is either sharded or replicated.
  expect_error([&] { fsdp::replicate(ok); }, "either replicated or sharded");
  GPT ddp(c);
  fsdp::replicate(ddp);
  expect_error([&] { fsdp::fully_shard(ddp->blocks[0]); }, "either replicated or sharded");
}

TEST(HsdpErrors, BadMeshesAndIntegersAreRefusedClearly) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  EXPECT_RANKS_PASS(4, "hsdp_errors", o);
}

// set_gradient_divide_factor(1.0) under HSDP: the gradients are the sum over all R x S ranks
// (reduce-scatter and all-reduce both sum), the default their average.
FSDP_RANK_WORKER(hsdp_divide_factor) {
  const auto c = uneven_config();
  auto mesh = hsdp_mesh("2x2");
  auto grads_with = [&](std::optional<double> factor) {
    torch::manual_seed(42);
    GPT model(c);
    fsdp::FullyShardOptions o;
    o.mesh = mesh;
    shard_blocks_then_root(model, o);
    if (factor) fsdp::fsdp_module(*model)->set_gradient_divide_factor(*factor);  // only the root's group
    auto data = global_batch(c, kBatch, 0, 0).narrow(0, 2 * fsdp::dist::rank(), 2);
    fsdp::models::gpt_loss(fsdp::call(model, data.narrow(1, 0, c.block_size)), data.narrow(1, 1, c.block_size))
        .backward();
    std::map<std::string, at::Tensor> grads;
    for (const auto& p : model->named_parameters()) grads[p.key()] = p.value().grad().clone();
    return grads;
  };
  auto averaged = grads_with(std::nullopt);
  auto summed = grads_with(1.0);
  for (const auto& [name, g] : averaged) {
    const bool root_group = name.rfind("h.", 0) != 0;  // blocks are "h.<i>.*"
    const at::Tensor want = root_group ? g * 4 : g;
    TORCH_CHECK(summed.at(name).allclose(want, 1e-5, 1e-7), name, ": expected ",
                root_group ? "the sum" : "the average");
  }
}

TEST(HsdpSettings, GradientDivideFactorOneSumsOverReplicasAndShards) {
  RanksOptions o;
  o.timeout = std::chrono::milliseconds(300000);
  EXPECT_RANKS_PASS(4, "hsdp_divide_factor", o);
}
