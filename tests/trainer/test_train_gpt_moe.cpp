// train_gpt --model moe / --init-from a mixture-of-experts folder (Mixtral, Qwen3-MoE fixtures of
// tests/models/fixtures, made by scripts/make-moe-fixtures.py): one process and FSDP 2 ranks train
// alike on the same global batch (the router's auxiliary loss is computed per forward, so the
// single process runs the two ranks' halves as --grad-accum 2 micro-batches), each progress line
// and metrics line carries the auxiliary loss and the expert load, a MoE from scratch trains,
// --export-hf and fsdp-ckpt export-hf write the trained weights (re-read by load_moe_weights), a
// resume refuses another model, and MoE options with another model exit 2 in one line.
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
