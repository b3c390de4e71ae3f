// train_gpt --model moe / --init-from a mixture-of-experts folder (Mixtral, Qwen3-MoE fixtures of
// tests/models/fixtures, made by scripts/make-moe-fixtures.py): one process and FSDP 2 ranks train
// alike on the same global batch (the router's auxiliary loss is computed per forward, so the
// single process runs the two ranks' halves as --grad-accum 2 micro-batches), each progress line
// and metrics line carries the auxiliary loss and the expert load, a MoE from scratch trains,
// --export-hf and fsdp-ckpt export-hf write the trained weights (re-read by load_moe_weights), a
// resume refuses another model, and MoE options with another model exit 2 in one line.
// Expert parallelism (--ep-size): EP 2 x dp 2 at 4 ranks trains as FSDP 4 and one process (losses,
// auxiliary loss, load; gradients clipped), its all-to-all bytes per step equal the formula of
// fsdp::ep::all_to_all_bytes, a checkpoint it writes holds every expert once (boxes from the ranks
// holding it) and resumes at FSDP 3 and in one process with the uninterrupted losses, --export-hf
// and fsdp-ckpt export-hf of an EP run write every expert, and bad --ep-size values exit 2.
#include <torch/torch.h>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/safetensors.h"
#include "models/moe/hf_moe.h"
#include "train_gpt_harness.h"

using namespace train_gpt_test;
using fsdp::models::MoECausalLM;

namespace {

const std::string kFsdpCkpt = FSDP_CKPT_PATH;

struct RouterLine {
  double loss, aux;
  int64_t load_min, load_max;
};

std::vector<RouterLine> router_lines(const std::string& metrics) {
  std::vector<RouterLine> out;
  for (const auto& j : read_metrics(metrics)) {
    if (j.value("summary", false) || !j.contains("loss")) continue;
    EXPECT_TRUE(j.contains("aux_loss") && j.contains("expert_load_min") && j.contains("expert_load_max")) << j.dump();
    out.push_back({j["loss"].get<double>(), j.value("aux_loss", -1.0), j.value("expert_load_min", int64_t{-1}),
                   j.value("expert_load_max", int64_t{-1})});
  }
  return out;
}

MoECausalLM load_folder(const std::string& dir) {
  MoECausalLM model(fsdp::models::read_moe_config(dir));
  fsdp::models::load_moe_weights(*model, dir);
  return model;
}

// Tokens routed per step: batch 8 x 16 tokens, top 2, over `sparse_layers` layers.
constexpr int64_t kRouted = 8 * 16 * 2;

}  // namespace

// 3 steps from each fixture at 1 rank (--grad-accum 2) and at FSDP 2 ranks: losses, auxiliary
// losses within 1e-5 and the same expert load; the progress lines show "aux" and "load".
TEST(TrainGptMoE, OneRankAndTwoRanksTrainAlikeAndReportTheRouter) {
  for (const char* name : {"mixtral_tied", "qwen3_moe_untied"}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const std::string dir = fixture(name), m1 = tmp.path + "/m1.jsonl", m2 = tmp.path + "/m2.jsonl";
    const auto a = alone(from_folder(dir, m1, {"--grad-accum", "2"}, 3));
    ASSERT_TRUE(a.ok()) << a.output;
    const auto b = ranks(2, from_folder(dir, m2, {}, 3));
    ASSERT_TRUE(b.ok()) << b.output;
    EXPECT_NE(b.output.find("  aux "), std::string::npos) << b.output;
    EXPECT_NE(b.output.find("  load "), std::string::npos) << b.output;
    const auto ra = router_lines(m1), rb = router_lines(m2);
    ASSERT_EQ(ra.size(), 3u);
    ASSERT_EQ(rb.size(), 3u);
    const auto c = fsdp::models::read_moe_config(dir);
    int64_t sparse = 0;
    for (int64_t l = 0; l < c.base.num_hidden_layers; ++l) sparse += c.is_sparse_layer(l) ? 1 : 0;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(ra[i].loss, rb[i].loss, 1e-5 * std::abs(ra[i].loss)) << "step " << i + 1;
      EXPECT_NEAR(ra[i].aux, rb[i].aux, 1e-5 * std::abs(ra[i].aux)) << "step " << i + 1;
      EXPECT_GT(ra[i].aux, 0);
      EXPECT_EQ(ra[i].load_min, rb[i].load_min);
      EXPECT_EQ(ra[i].load_max, rb[i].load_max);
      // min x E <= the routed tokens <= max x E
      EXPECT_LE(ra[i].load_min * c.num_experts, kRouted * sparse);
      EXPECT_GE(ra[i].load_max * c.num_experts, kRouted * sparse);
    }
  }
}

// --model moe from scratch (a Mixtral of --experts 4 --top-k 2) trains and reports the router;
// its experts' load sums to top-k x tokens x layers.
TEST(TrainGptMoE, FromScratchTrains) {
  TempDir tmp;
  const std::string m = tmp.path + "/m.jsonl";
  const auto r = ranks(2, tiny(m, {"--model", "moe", "--heads", "4", "--experts", "4", "--top-k", "2", "--ffn-dim",
                                   "32", "--steps", "3"}));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("4 experts top 2"), std::string::npos) << r.output;
  const auto lines = router_lines(m);
  ASSERT_EQ(lines.size(), 3u);
  for (const auto& l : lines) {
    EXPECT_TRUE(std::isfinite(l.loss));
    EXPECT_GT(l.aux, 0);
    EXPECT_LE(l.load_min * 4, kRouted * 2);
    EXPECT_GE(l.load_max * 4, kRouted * 2);
  }
}

// --export-hf at 2 ranks and fsdp-ckpt export-hf of the checkpoint: the same tensors, which
// load_moe_weights reads back as the checkpoint's (trained) weights, unlike the fixture's.
TEST(TrainGptMoE, ExportHfRoundTripGivesTheTrainedWeights) {
  TempDir tmp;
  const std::string dir = fixture("qwen3_moe_untied"), out = tmp.path + "/hf", ck = tmp.path + "/ck";
  const auto r = ranks(2, from_folder(dir, tmp.path + "/m.jsonl", {"--checkpoint-dir", ck, "--export-hf", out}, 3));
  ASSERT_TRUE(r.ok()) << r.output;
  const std::string step = ck + "/step_000003", out2 = tmp.path + "/hf2";
  const auto e = run_process(spec_of({kFsdpCkpt, "export-hf", step, out2}, 60s));
  ASSERT_TRUE(e.ok()) << e.output;

  MoECausalLM checkpointed(fsdp::models::read_moe_config(dir));
  fsdp::checkpoint::LoadOptions lo;
  lo.load_optimizer = false;
  fsdp::checkpoint::load(step, fsdp::checkpoint::State{checkpointed.ptr(), nullptr, {}, {}}, lo);
  MoECausalLM reloaded = load_folder(out), reloaded2 = load_folder(out2), original = load_folder(dir);
  const auto want = checkpointed->named_parameters();
  const auto got = reloaded->named_parameters(), got2 = reloaded2->named_parameters(),
             orig = original->named_parameters();
  ASSERT_EQ(want.size(), got.size());
  double changed = 0;
  for (const auto& p : want) {
    EXPECT_TRUE(got[p.key()].equal(p.value())) << p.key();
    EXPECT_TRUE(got2[p.key()].equal(p.value())) << p.key();
    changed = std::max(changed, (orig[p.key()] - p.value()).abs().max().item<double>());
  }
  EXPECT_GT(changed, 1e-4) << "training did not change the model";

  // A resume with another model (the Mixtral fixture) is refused before work.
  const auto other =
      alone(from_folder(fixture("mixtral_tied"), tmp.path + "/m2.jsonl", {"--resume-from", step, "--steps", "4"}));
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_FALSE(trained(other.output)) << other.output;
}

// MoE options with another model, or with --init-from, exit 2 in one line naming the option.
TEST(TrainGptMoE, BadOptionsExitTwo) {
  TempDir tmp;
  const std::string m = tmp.path + "/m.jsonl";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {tiny(m, {"--model", "llama", "--experts", "4"}), "--experts sizes --model moe only"},
      {tiny(m, {"--top-k", "2"}), "--top-k sizes --model moe only"},
      {tiny(m, {"--model", "moe", "--experts", "2", "--top-k", "3"}), "--top-k 3 exceeds --experts 2"},
      {from_folder(fixture("mixtral_tied"), m, {"--experts", "2"}), "drop --experts"},
  };
  for (const auto& [args, text] : cases) {
    const auto r = alone(args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find(text), std::string::npos) << r.output;
    EXPECT_FALSE(trained(r.output)) << r.output;
  }
}

// ---- expert parallelism -------------------------------------------------------------------------

namespace {

// A Mixtral from scratch of 4 experts, 2 layers of hidden 32, global batch `batch` x 16 tokens;
// --clip 0.05 so that the gradient norm (about 0.6) is clipped every step.
std::vector<std::string> moe_tiny(const std::string& metrics, const std::vector<std::string>& extra) {
  auto a = tiny(metrics, {"--model", "moe", "--heads", "4", "--experts", "4", "--top-k", "2", "--ffn-dim", "32",
                          "--clip", "0.05", "--steps", "3"});
  return apply(a, extra);
}

void expect_same_router(const std::vector<RouterLine>& a, const std::vector<RouterLine>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i].loss, b[i].loss, 1e-5 * std::abs(b[i].loss)) << "step " << i + 1;
    EXPECT_NEAR(a[i].aux, b[i].aux, 1e-5 * std::abs(b[i].aux)) << "step " << i + 1;
    EXPECT_EQ(a[i].load_min, b[i].load_min) << "step " << i + 1;
    EXPECT_EQ(a[i].load_max, b[i].load_max) << "step " << i + 1;
  }
}

std::vector<double> metric(const std::string& path, const std::string& name) {
  std::vector<double> out;
  for (const auto& j : read_metrics(path))
    if (!j.value("summary", false) && j.contains(name)) out.push_back(j[name].get<double>());
  return out;
}

}  // namespace

// EP 2 x dp 2 (4 ranks) equals FSDP 4 and one process with --grad-accum 4 (the same micro-batches:
// the auxiliary loss is per forward): losses, auxiliary losses and gradient norms within 1e-5,
// the same expert load. And EP 2 x dp 1 from the Mixtral fixture equals one process --grad-accum 2.
TEST(TrainGptMoE, ExpertParallelTrainsAsFSDPAndOneProcess) {
  TempDir tmp;
  const std::string ep = tmp.path + "/ep.jsonl", fsdp = tmp.path + "/fsdp.jsonl", one = tmp.path + "/one.jsonl";
  const auto a = ranks(4, moe_tiny(ep, {"--ep-size", "2"}));
  ASSERT_TRUE(a.ok()) << a.output;
  EXPECT_NE(a.output.find("4 ranks (dp 2 x ep 2: expert parallel)"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("expert parallel over 2 ranks (2 experts each)"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("  a2a "), std::string::npos) << a.output;
  const auto b = ranks(4, moe_tiny(fsdp, {}));
  ASSERT_TRUE(b.ok()) << b.output;
  const auto c = alone(moe_tiny(one, {"--grad-accum", "4"}));
  ASSERT_TRUE(c.ok()) << c.output;
  expect_same_router(router_lines(ep), router_lines(fsdp));
  expect_same_router(router_lines(ep), router_lines(one));
  const auto norms = metric(ep, "grad_norm"), norms_one = metric(one, "grad_norm");
  expect_close(norms, norms_one, 1e-5);
  EXPECT_GT(norms.at(0), 0.05) << "the gradients were not clipped";
  EXPECT_TRUE(metric(fsdp, "all_to_all_bytes").empty());

  const std::string dir = fixture("mixtral_tied"), m1 = tmp.path + "/f1.jsonl", m2 = tmp.path + "/f2.jsonl";
  const auto d = ranks(2, from_folder(dir, m1, {"--ep-size", "2"}, 3));
  ASSERT_TRUE(d.ok()) << d.output;
  const auto e = alone(from_folder(dir, m2, {"--grad-accum", "2"}, 3));
  ASSERT_TRUE(e.ok()) << e.output;
  expect_same_router(router_lines(m1), router_lines(m2));
}

// --activation-checkpointing checkpoints each layer's attention, experts and dense MLP, not the
// router: the auxiliary loss keeps its gradient to the router (checkpointing the whole layer lost
// it: gradient norms 1.3e-4 apart), so at EP 2 x dp 2 the run equals the one without
// checkpointing, and the recompute runs no all-to-all (the bytes per step are unchanged).
TEST(TrainGptMoE, ActivationCheckpointingKeepsTheRouterGradientAndTheAllToAlls) {
  TempDir tmp;
  const std::string plain = tmp.path + "/plain.jsonl", ac = tmp.path + "/ac.jsonl", ac2 = tmp.path + "/ac2.jsonl";
  const auto a = ranks(4, moe_tiny(plain, {"--ep-size", "2"}));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto b = ranks(4, moe_tiny(ac, {"--ep-size", "2", "--activation-checkpointing", "full"}));
  ASSERT_TRUE(b.ok()) << b.output;
  const auto c = alone(moe_tiny(ac2, {"--grad-accum", "4", "--activation-checkpointing", "every:2"}));
  ASSERT_TRUE(c.ok()) << c.output;
  expect_same_router(router_lines(plain), router_lines(ac));
  expect_same_router(router_lines(plain), router_lines(ac2));
  expect_close(metric(plain, "grad_norm"), metric(ac, "grad_norm"), 1e-7);
  expect_close(metric(plain, "grad_norm"), metric(ac2, "grad_norm"), 1e-5);
  EXPECT_EQ(metric(plain, "all_to_all_bytes"), metric(ac, "all_to_all_bytes"));
}

// With --top-k equal to --experts every token goes to every expert, so the routing is known: each
// rank sends T x (E - E/ep) rows of its T tokens and receives as many, per sparse layer and
// micro-batch. fsdp::ep::all_to_all_bytes' formula per rank: counts (ep - 1) x (E / ep) x 8, forward =
// backward = (sent + received) x hidden x 4 bytes; the metrics' all_to_all_bytes sums the ranks.
TEST(TrainGptMoE, AllToAllBytesPerStepEqualTheRoutingFormula) {
  TempDir tmp;
  const std::string m = tmp.path + "/m.jsonl";
  const int64_t world = 4, ep = 2, E = 4, hidden = 32, layers = 2, accum = 2, batch = 8, seq = 16;
  const auto r = ranks(static_cast<int>(world), moe_tiny(m, {"--ep-size", "2", "--top-k", "4", "--grad-accum", "2"}));
  ASSERT_TRUE(r.ok()) << r.output;
  const int64_t tokens = batch / world / accum * seq;  // per rank and micro-batch
  const int64_t sent = tokens * (E - E / ep), received = sent;
  const int64_t per_layer = (ep - 1) * (E / ep) * 8 + 2 * (sent + received) * hidden * 4;
  const double want = static_cast<double>(per_layer * layers * accum * world);
  const auto bytes = metric(m, "all_to_all_bytes");
  ASSERT_EQ(bytes.size(), 3u);
  for (double b : bytes) EXPECT_EQ(b, want);
  std::printf("all-to-all bytes per step: %.0f (formula %.0f)\n", bytes[0], want);
}

// A checkpoint of EP 2 x dp 2 holds every expert under its global name, its rows written by the
// two ranks holding it, and its optimizer state; it resumes at FSDP 3, in one process and at EP 2
// x dp 1 with the uninterrupted run's losses (1e-5; the same micro-batches of one sequence each).
// --export-hf of the EP run and fsdp-ckpt export-hf of its checkpoint write every expert: read back
// by load_moe_weights they are the checkpoint's tensors, and give its logits.
TEST(TrainGptMoE, ExpertParallelCheckpointResumesAndExportsAtAnyLayout) {
  TempDir tmp;
  const std::string ck = tmp.path + "/ck", out = tmp.path + "/hf", u = tmp.path + "/u.jsonl";
  auto run = [&](const std::vector<std::string>& extra, const std::string& metrics) {
    return moe_tiny(metrics, apply({"--batch-size", "12", "--steps", "4"}, extra));
  };
  const auto a = ranks(4, run({"--ep-size", "2", "--grad-accum", "3", "--checkpoint-dir", ck, "--checkpoint-every", "2",
                               "--export-hf", out},
                              u));
  ASSERT_TRUE(a.ok()) << a.output;
  const std::string step2 = ck + "/step_000002", step4 = ck + "/step_000004";
  const auto saved = fsdp::checkpoint::describe(step2);
  for (int layer = 0; layer < 2; ++layer)
    for (int e = 0; e < 4; ++e) {
      const std::string key =
          "model.layers." + std::to_string(layer) + ".block_sparse_moe.experts." + std::to_string(e) + ".w2.weight";
      EXPECT_TRUE(saved.count("model." + key)) << key;
      EXPECT_TRUE(saved.count("optim." + key + ".exp_avg")) << key;
      EXPECT_TRUE(saved.count("optim." + key + ".step")) << key;
    }
  const auto want = losses(u);
  ASSERT_EQ(want.size(), 4u);
  const std::vector<double> tail(want.begin() + 2, want.end());
  const std::vector<std::pair<int, std::vector<std::string>>> resumes = {
      {3, {"--grad-accum", "4"}}, {1, {"--grad-accum", "12"}}, {2, {"--ep-size", "2", "--grad-accum", "6"}}};
  for (const auto& [n, extra] : resumes) {
    SCOPED_TRACE(std::to_string(n) + " ranks");
    const std::string m = tmp.path + "/r" + std::to_string(n) + ".jsonl";
    auto args =
        run(apply(extra, {"--resume-from", step2, "--checkpoint-dir", tmp.path + "/ck" + std::to_string(n)}), m);
    const auto r = n == 1 ? alone(args) : ranks(n, args);
    ASSERT_TRUE(r.ok()) << r.output;
    expect_close(losses(m), tail, 1e-5);
  }

  const std::string out2 = tmp.path + "/hf2";
  const auto e = run_process(spec_of({kFsdpCkpt, "export-hf", step4, out2}, 60s));
  ASSERT_TRUE(e.ok()) << e.output;
  MoECausalLM checkpointed(fsdp::models::read_moe_config(out));
  fsdp::checkpoint::LoadOptions lo;
  lo.load_optimizer = false;
  fsdp::checkpoint::load(step4, fsdp::checkpoint::State{checkpointed.ptr(), nullptr, {}, {}}, lo);
  MoECausalLM reloaded = load_folder(out), reloaded2 = load_folder(out2);
  const auto got = reloaded->named_parameters(), got2 = reloaded2->named_parameters();
  ASSERT_EQ(got.size(), checkpointed->named_parameters().size());
  for (const auto& p : checkpointed->named_parameters()) {
    EXPECT_TRUE(got[p.key()].equal(p.value())) << p.key();
    EXPECT_TRUE(got2[p.key()].equal(p.value())) << p.key();
  }
  torch::NoGradGuard no_grad;
  const at::Tensor tokens = at::randint(0, 256, {2, 16}, at::kLong);
  EXPECT_TRUE(checkpointed->forward(tokens).equal(reloaded->forward(tokens)));
}

// Bad --ep-size values exit 2 in one line before any work (under fsdprun: every worker).
TEST(TrainGptMoE, BadExpertParallelOptionsExitTwo) {
  TempDir tmp;
  const std::string m = tmp.path + "/m.jsonl";
  const std::vector<std::tuple<int, std::vector<std::string>, std::string>> cases = {
      {1, moe_tiny(m, {"--ep-size", "3"}), "--ep-size 3 does not divide --experts 4"},
      {1, moe_tiny(m, {"--ep-size", "2", "--tp-size", "2"}), "--ep-size 2 with --tp-size 2"},
      {1, moe_tiny(m, {"--ep-size", "2"}), "--ep-size 2 needs --parallel fsdp"},
      {2, moe_tiny(m, {"--ep-size", "2", "--parallel", "hsdp"}), "--ep-size 2 needs --parallel fsdp"},
      {3, moe_tiny(m, {"--ep-size", "2", "--batch-size", "6"}), "--ep-size 2 does not divide the world size 3"},
      {2, tiny(m, {"--ep-size", "2"}), "--ep-size 2: --model gpt has no experts"},
      {2, tiny(m, {"--ep-size", "2", "--model", "llama"}), "--ep-size 2: --model llama has no experts"},
      {2, from_folder(fixture("mixtral_tied"), m, {"--ep-size", "8"}), "config.json's num_experts 4"},
  };
  for (const auto& [n, args, text] : cases) {
    const auto r = n == 1 ? alone(args) : ranks(n, args);
    // fsdprun exits 1 when a worker failed, naming the worker's status.
    EXPECT_EQ(r.exit_code, n == 1 ? 2 : 1) << r.output;
    if (n > 1) EXPECT_NE(r.output.find("exit code 2"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(text), std::string::npos) << text << "\n" << r.output;
    EXPECT_FALSE(trained(r.output)) << r.output;
  }
}
