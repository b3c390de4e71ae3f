// Mixtral and Qwen3-MoE against transformers: folders made by scripts/make-moe-fixtures.py (random
// MixtralForCausalLM / Qwen3MoeForCausalLM saved by transformers' save_pretrained in the Hub's
// one-tensor-per-expert layout, with transformers' logits, training loss and load-balancing loss
// on fixed tokens) load into our MoECausalLM, unsharded and under fully_shard at 2 ranks (experts
// as ordinary FSDP parameters, one unit per decoder layer), and give the same logits (max |ours -
// theirs| <= 1e-5 x max |theirs|) and the same loss with the auxiliary term (1e-5 relative).
// Training at FSDP 2 equals training in one process; what we export loads back with the same
// logits (and in transformers' from_pretrained, when FSDP_TEST_HF_PYTHON names a Python with it: CMake
// sets the python3 it finds, which the LibTorch 2.14 half's chroot has transformers in); the grouping
// (group_tokens / combine) equals a token-by-token loop; a model holding a range of experts reads
// only those; every config.json field the model cannot honour is refused in one line.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/fsdp.h"
#include "models/moe/hf_moe.h"
#include "moe_fixture.h"
#include "multiprocess.h"
#include "subprocess.h"
#include "test_helpers.h"

using namespace fsdp::testing;
using namespace fsdp::testing::moe_fixture;
namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
using fsdp::models::HFError;
using fsdp::models::MoECausalLM;
using fsdp::models::MoEConfig;

namespace {

// models/moe/hf_moe.h's recipe: meta build, a unit per decoder layer then the root.
MoECausalLM load_sharded(const std::string& dir) {
  auto c = fsdp::models::read_moe_config(dir);
  c.base.device = torch::kMeta;
  MoECausalLM model(c);
  for (auto& layer : model->layers()) fsdp::fully_shard(layer);
  fsdp::fully_shard(model);
  fsdp::to_empty(*model, torch::kCPU);
  fsdp::models::load_moe_weights(*model, dir);
  return model;
}

}  // namespace

// ---- against transformers ---------------------------------------------------------------------

TEST(MoEHF, LogitsAndLossMatchTransformersUnsharded) {
  for (const auto& name : kFixtures) {
    auto model = load_unsharded(fixture(name));
    const auto ref = reference(fixture(name));
    const Diffs d = compare(model, ref);
    EXPECT_LE(d.logits, 1e-5) << name;
    EXPECT_LE(d.loss, 1e-5) << name;
    EXPECT_LE(d.aux, 1e-5) << name;
    // The auxiliary term matters: without it the loss is off by far more than the tolerance.
    EXPECT_GT(model->config.router_aux_loss_coef * ref.aux_loss / ref.loss, 1e-3) << name;
    std::printf("%-24s unsharded: logits %.3g, loss %.3g, aux loss %.3g (relative to transformers)\n", name.c_str(),
                d.logits, d.loss, d.aux);
  }
  // The comparison can fail: another folder's logits are far from these.
  auto model = load_unsharded(fixture("mixtral_tied"));
  EXPECT_GT(compare(model, reference(fixture("mixtral_untied_sharded"))).logits, 1e-2);
}

TEST(MoEHF, ModuleTreeIsTheHubs) {
  auto mixtral = load_unsharded(fixture("mixtral_tied"));
  auto qwen = load_unsharded(fixture("qwen3_moe_sparse_step"));
  const auto m = mixtral->named_parameters(), q = qwen->named_parameters();
  for (const char* key :
       {"model.layers.1.block_sparse_moe.gate.weight", "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        "model.layers.0.block_sparse_moe.experts.3.w2.weight", "model.layers.0.block_sparse_moe.experts.0.w3.weight"})
    EXPECT_TRUE(m.contains(key)) << key;
  EXPECT_FALSE(m.contains("lm_head.weight"));  // tied
  // mlp_only_layers [0], decoder_sparse_step 2: layers 0 and 2 dense, 1 and 3 sparse.
  for (const char* key : {"model.layers.0.mlp.gate_proj.weight", "model.layers.2.mlp.down_proj.weight",
                          "model.layers.1.mlp.gate.weight", "model.layers.3.mlp.experts.3.up_proj.weight",
                          "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.o_proj.bias"})
    EXPECT_TRUE(q.contains(key)) << key;
  EXPECT_FALSE(q.contains("model.layers.0.mlp.gate.weight"));
  EXPECT_FALSE(q.contains("model.layers.2.mlp.experts.0.up_proj.weight"));
}

FSDP_RANK_WORKER(moe_logits_fsdp) {
  for (const auto& name : kFixtures) {
    auto model = load_sharded(fixture(name));
    const std::string expert = name.rfind("mixtral", 0) == 0 ? "model.layers.1.block_sparse_moe.experts.1.w1.weight"
                                                             : "model.layers.1.mlp.experts.1.gate_proj.weight";
    auto info = fsdp::shard_info(model->named_parameters()[expert]);
    TORCH_CHECK(info && info->local_rows < info->global_shape[0], name, ": ", expert, " is not sharded");
    const Diffs d = compare(model, reference(fixture(name)));
    TORCH_CHECK(d.logits <= 1e-5 && d.loss <= 1e-5 && d.aux <= 1e-5, name, " at FSDP ", fsdp::dist::world_size(),
                " ranks: logits ", d.logits, ", loss ", d.loss, ", aux ", d.aux);
    if (fsdp::dist::rank() == 0)
      std::printf("%-24s FSDP %d ranks: logits %.3g, loss %.3g, aux loss %.3g\n", name.c_str(),
                  fsdp::dist::world_size(), d.logits, d.loss, d.aux);
  }
}

TEST(MoEHF, LogitsAndLossMatchTransformersFSDP2) { EXPECT_RANKS_PASS(2, "moe_logits_fsdp"); }
// Uneven shards: the routers' 4 or 8 rows and the experts' 40 or 24 rows over 3 ranks.
TEST(MoEHF, LogitsAndLossMatchTransformersFSDP3) { EXPECT_RANKS_PASS(3, "moe_logits_fsdp"); }

// Training with the auxiliary loss: 3 AdamW steps at FSDP 2 (each rank the same batch, so the
// averaged gradient is the one-process gradient) equal 3 steps of the unsharded model.
FSDP_RANK_WORKER(moe_train_fsdp_vs_one_process) {
  for (const std::string name : {"mixtral_untied_sharded", "qwen3_moe_sparse_step"}) {
    auto sharded = load_sharded(fixture(name));
    auto single = load_unsharded(fixture(name));
    const auto tokens = reference(fixture(name)).tokens;
    auto options = torch::optim::AdamWOptions(1e-2).weight_decay(0.0);
    torch::optim::AdamW opt_sharded(sharded->parameters(), options), opt_single(single->parameters(), options);
    std::vector<double> a, b;
    for (int step = 0; step < 3; ++step) {
      for (auto [model, opt, out] : {std::tuple{&sharded, &opt_sharded, &a}, std::tuple{&single, &opt_single, &b}}) {
        opt->zero_grad();
        auto loss = shifted_loss(*model, fsdp::call(*model, tokens), tokens);
        loss.backward();
        opt->step();
        out->push_back(loss.item<double>());
      }
    }
    for (int s = 0; s < 3; ++s)
      TORCH_CHECK(std::abs(a[s] - b[s]) <= 1e-5 * std::abs(b[s]), name, " step ", s, ": FSDP ", a[s], " vs ", b[s]);
    TORCH_CHECK(b[2] < b[0], name, ": the loss did not fall: ", b[0], " -> ", b[2]);
    if (fsdp::dist::rank() == 0)
      std::printf("%-24s losses FSDP 2 %.7f %.7f %.7f, one process %.7f %.7f %.7f\n", name.c_str(), a[0], a[1], a[2],
                  b[0], b[1], b[2]);
  }
}

TEST(MoEHF, TrainingAtFSDP2EqualsOneProcess) { EXPECT_RANKS_PASS(2, "moe_train_fsdp_vs_one_process"); }

// ---- export -----------------------------------------------------------------------------------

FSDP_RANK_WORKER(moe_export_sharded) {
  const std::string out = std::getenv("EXPORT_DIR");
  auto untied = load_sharded(fixture("mixtral_untied_sharded"));
  fsdp::models::save_moe_hf(*untied, out + "/mixtral", {.max_shard_size = 40'000});
  auto qwen = load_sharded(fixture("qwen3_moe_sparse_step"));
  fsdp::models::save_moe_hf(*qwen, out + "/qwen3", {.copy_from = fixture("qwen3_moe_sparse_step")});
}

class MoEHFFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fsdp_moe_hf_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

namespace {

std::set<std::string> folder_keys(const fs::path& dir) {
  std::set<std::string> keys;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string f = entry.path().filename().string();
    if (f.size() < 12 || f.compare(f.size() - 12, 12, ".safetensors") != 0 || f == "reference.safetensors") continue;
    const st::Reader reader(entry.path().string());
    for (const auto& t : reader.header().tensors) keys.insert(t.name);
  }
  return keys;
}

}  // namespace

TEST_F(MoEHFFiles, ExportFromFSDPLoadsBackWithTheSameLogits) {
  RanksOptions options;
  options.env["EXPORT_DIR"] = dir_.string();
  EXPECT_RANKS_PASS(2, "moe_export_sharded", options);
  for (const auto& [out, name] :
       {std::pair{dir_ / "mixtral", "mixtral_untied_sharded"}, std::pair{dir_ / "qwen3", "qwen3_moe_sparse_step"}}) {
    // The Hub's keys, exactly the ones transformers wrote, and config.json read back the same.
    EXPECT_EQ(folder_keys(out), folder_keys(fixture(name))) << name;
    const auto theirs = fsdp::models::read_moe_config(fixture(name)), ours = fsdp::models::read_moe_config(out);
    EXPECT_EQ(ours.to_json("float32"), theirs.to_json("float32")) << name;
    auto model = load_unsharded(out.string());
    const Diffs d = compare(model, reference(fixture(name)));
    EXPECT_LE(d.logits, 1e-5) << name;
    EXPECT_LE(d.loss, 1e-5) << name;
  }
  EXPECT_TRUE(fs::exists(dir_ / "mixtral" / "model.safetensors.index.json"));  // split: 40 kB files
  EXPECT_TRUE(fs::exists(dir_ / "qwen3" / "generation_config.json"));          // copied along

  // transformers itself, where a Python with it is at hand (never downloaded here).
  const char* python = std::getenv("FSDP_TEST_HF_PYTHON");
  if (!python) {
    std::printf("FSDP_TEST_HF_PYTHON not set: the exports were not loaded by transformers\n");
    return;
  }
  for (const auto& [out, name] :
       {std::pair{dir_ / "mixtral", "mixtral_untied_sharded"}, std::pair{dir_ / "qwen3", "qwen3_moe_sparse_step"}}) {
    ProcessSpec spec;
    spec.argv = {python, "-c", R"(
import sys
try:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
except ImportError as e:
    print("SKIPPED: transformers on our export:", e)
    sys.exit(77)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ref = load_file(sys.argv[2])
with torch.no_grad():
    out = model(ref["tokens"], labels=ref["tokens"], output_router_logits=True)
diff = ((out.logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
loss = abs(out.loss.item() - ref["loss"].item()) / abs(ref["loss"].item())
prompt = ref["tokens"][:, :4]
model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False, pad_token_id=0)
print("transformers on our export: logits", diff, "loss", loss)
sys.exit(0 if diff <= 1e-5 and loss <= 1e-5 else 1)
)",
                 out.string(), fixture(name) + "/reference.safetensors"};
    spec.timeout = std::chrono::seconds(120);
    auto result = Child(spec).wait();
    std::printf("%s", result.output.c_str());
    // No transformers there (the LibTorch 1.13 half's python3): skipped, unless this must run.
    const char* required = std::getenv("FSDP_REQUIRE_PYTHON_CHECKS");
    if (result.exit_code == 77 && !(required && std::string(required) == "1")) continue;
    EXPECT_TRUE(result.ok()) << result.output;
  }
}

// fsdp-ckpt export-hf's path: a checkpoint recording the MoE config.json, written in the Hub's layout.
TEST_F(MoEHFFiles, CheckpointExportWritesTheHubLayout) {
  auto model = load_unsharded(fixture("qwen3_moe_untied"));
  fsdp::models::HFConfigState hf;
  hf.json = model->config.to_json("float32");
  const fs::path ck = dir_ / "ck", out = dir_ / "out";
  fsdp::checkpoint::save(ck.string(), {model.ptr(), nullptr, {{fsdp::models::kHFConfigEntry, &hf}}, {}});
  EXPECT_EQ(fsdp::models::hf_architecture(fsdp::models::recorded_hf_config(ck.string())), "Qwen3MoeForCausalLM");
  fsdp::models::export_moe_hf_from_checkpoint(ck.string(), out.string(), {.max_shard_size = 50'000});
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_EQ(folder_keys(out), folder_keys(fixture("qwen3_moe_untied")));
  auto back = load_unsharded(out.string());
  EXPECT_LE(compare(back, reference(fixture("qwen3_moe_untied"))).logits, 1e-5);
  // The Llama family's export refuses it in one line naming the architecture.
  try {
    fsdp::models::export_hf_from_checkpoint(ck.string(), (dir_ / "llama").string());
    FAIL() << "the Llama export took a MoE checkpoint";
  } catch (const fsdp::models::LlamaConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("'Qwen3MoeForCausalLM' is not supported"), std::string::npos) << e.what();
  }
}

TEST(MoEHF, RefusesAFolderOfAnotherModel) {
  auto c = fsdp::models::read_moe_config(fixture("mixtral_tied"));
  c.num_experts_per_tok = 1;
  MoECausalLM model(c);
  try {
    fsdp::models::load_moe_weights(*model, fixture("mixtral_tied"));
    FAIL() << "loaded a folder whose top k differs";
  } catch (const HFError& e) {
    EXPECT_NE(std::string(e.what()).find("num_experts_per_tok"), std::string::npos) << e.what();
  }
  // A Llama folder is not a MoE folder, and the MoE reader says so in one line.
  EXPECT_FALSE(fsdp::models::is_moe_folder(std::string(FSDP_HF_FIXTURES) + "/qwen2"));
  EXPECT_TRUE(fsdp::models::is_moe_folder(fixture("qwen3_moe_untied")));
  try {
    fsdp::models::read_moe_config(std::string(FSDP_HF_FIXTURES) + "/qwen2");
    FAIL() << "read a Qwen2 folder as MoE";
  } catch (const fsdp::models::MoEConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("architectures: 'Qwen2ForCausalLM' is not supported (MixtralForCausalLM, "
                                         "Qwen3MoeForCausalLM)"),
              std::string::npos)
        << e.what();
  }
}

// ---- grouping, routing, local experts ---------------------------------------------------------

TEST(MoEBlock, GroupAndCombineEqualATokenByTokenLoop) {
  torch::manual_seed(5);
  const int64_t T = 23, D = 6, E = 5, k = 2;
  const auto hidden = torch::randn({T, D});
  const auto r = fsdp::models::route(torch::randn({T, E}), k, /*renormalise=*/true, /*weights_in_float32=*/true);
  const auto g = fsdp::models::group_tokens(hidden, r.indices, E);
  ASSERT_EQ(g.tokens.sizes(), (std::vector<int64_t>{T * k, D}));
  // Expert 0's rows first: every row's expert never decreases; counts are per expert.
  const auto row_expert = r.indices.reshape(-1).index_select(0, g.slot);
  EXPECT_TRUE((row_expert.narrow(0, 1, T * k - 1) >= row_expert.narrow(0, 0, T * k - 1)).all().item<bool>());
  EXPECT_TRUE(torch::equal(g.counts, torch::bincount(r.indices.reshape(-1), {}, E)));
  EXPECT_TRUE(torch::equal(g.tokens, hidden.index_select(0, g.token_index)));
  // An "expert" e multiplying by (e + 1): the combine equals sum_j w_tj * (e_tj + 1) * h_t.
  const auto scale = (row_expert + 1).to(at::kFloat).unsqueeze(1);
  const auto out = fsdp::models::combine(g.tokens * scale, r.weights, g);
  auto expected = torch::zeros({T, D});
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) expected[t] += r.weights[t][j] * (r.indices[t][j].item<int64_t>() + 1) * hidden[t];
  EXPECT_LE((out - expected).abs().max().item<double>(), 1e-6);
  // Weights renormalised: each token's k weights sum to 1; without, to its top-k probability mass.
  EXPECT_LE((r.weights.sum(1) - 1).abs().max().item<double>(), 1e-6);
  const auto raw = fsdp::models::route(r.logits, k, false, false);
  EXPECT_LT(raw.weights.sum(1).max().item<double>(), 1.0);
}

TEST(MoEBlock, AProcessHoldingARangeOfExpertsReadsOnlyThose) {
  auto c = fsdp::models::read_moe_config(fixture("mixtral_untied_sharded"));
  c.local_experts_first = 2;
  c.local_experts_count = 3;
  MoECausalLM part(c);
  fsdp::models::load_moe_weights(*part, fixture("mixtral_untied_sharded"));  // others: neither read nor missed
  const auto names = part->named_parameters();
  EXPECT_TRUE(names.contains("model.layers.0.block_sparse_moe.experts.2.w1.weight"));
  EXPECT_TRUE(names.contains("model.layers.0.block_sparse_moe.experts.4.w2.weight"));
  EXPECT_FALSE(names.contains("model.layers.0.block_sparse_moe.experts.1.w1.weight"));
  EXPECT_FALSE(names.contains("model.layers.0.block_sparse_moe.experts.5.w1.weight"));
  // Its experts hold the folder's values under their global names.
  auto full = load_unsharded(fixture("mixtral_untied_sharded"));
  const auto key = "model.layers.1.block_sparse_moe.experts.3.w3.weight";
  EXPECT_TRUE(torch::equal(names[key], full->named_parameters()[key]));
  // Without expert parallelism it cannot run the other experts' tokens, and says so.
  const auto tokens = reference(fixture("mixtral_untied_sharded")).tokens;
  try {
    torch::NoGradGuard no_grad;
    part->forward(tokens);
    FAIL() << "a partial model ran alone";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("holds experts [2, 5) of 8"), std::string::npos) << e.what();
  }
  // Nor export.
  EXPECT_THROW(fsdp::models::save_moe_hf(*part, (fs::temp_directory_path() / "fsdp_moe_never").string()), HFError);
}

// ---- config.json ------------------------------------------------------------------------------

namespace {

nlohmann::json qwen3_json() {
  return {{"architectures", {"Qwen3MoeForCausalLM"}},
          {"model_type", "qwen3_moe"},
          {"vocab_size", 100},
          {"hidden_size", 32},
          {"intermediate_size", 64},
          {"moe_intermediate_size", 16},
          {"num_hidden_layers", 3},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 16},
          {"num_experts", 8},
          {"num_experts_per_tok", 2},
          {"norm_topk_prob", true},
          {"decoder_sparse_step", 1},
          {"mlp_only_layers", {2}},
          {"router_aux_loss_coef", 0.01},
          {"use_sliding_window", false},
          {"sliding_window", 4096},
          {"max_window_layers", 28},
          {"rope_theta", 1000000.0},
          {"torch_dtype", "bfloat16"}};
}

nlohmann::json mixtral_json() {
  return {{"architectures", {"MixtralForCausalLM"}},
          {"model_type", "mixtral"},
          {"vocab_size", 100},
          {"hidden_size", 32},
          {"intermediate_size", 48},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"num_local_experts", 8},
          {"num_experts_per_tok", 2},
          {"router_jitter_noise", 0.0},
          {"sliding_window", nullptr},
          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1e6}}},
          {"dtype", "float32"}};
}

std::string refusal(nlohmann::json j, const std::function<void(nlohmann::json&)>& edit) {
  edit(j);
  try {
    MoEConfig::from_json(j.dump(), "test/config.json");
  } catch (const fsdp::models::LlamaConfigError& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST(MoEConfig, ReadsBothArchitecturesAndWritesThemBack) {
  const auto q = MoEConfig::from_json(qwen3_json().dump());
  EXPECT_EQ(q.num_experts, 8);
  EXPECT_EQ(q.moe_intermediate_size, 16);
  EXPECT_EQ(q.base.intermediate_size, 64);
  EXPECT_TRUE(q.base.qk_norm);
  EXPECT_TRUE(q.norm_topk_prob);
  EXPECT_TRUE(q.is_sparse_layer(0) && q.is_sparse_layer(1) && !q.is_sparse_layer(2));
  EXPECT_EQ(q.base.passthrough.count("sliding_window"), 0u);  // off with use_sliding_window false
  auto q5 = qwen3_json();                                     // transformers 5.x writes num_local_experts
  q5.erase("num_experts");
  q5["num_local_experts"] = 8;
  EXPECT_EQ(MoEConfig::from_json(q5.dump()).num_experts, 8);
  const auto m = MoEConfig::from_json(mixtral_json().dump());
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.moe_intermediate_size, 48);
  EXPECT_TRUE(m.norm_topk_prob && !m.base.qk_norm && !m.base.attention_bias);
  EXPECT_EQ(m.base.rope_theta, 1e6);
  // Written back: read again, the same config (and the same text).
  for (const auto& c : {q, m}) {
    const auto again = MoEConfig::from_json(c.to_json("bfloat16"));
    EXPECT_EQ(again.to_json("bfloat16"), c.to_json("bfloat16"));
    EXPECT_EQ(again.mlp_only_layers, c.mlp_only_layers);
    EXPECT_EQ(again.router_aux_loss_coef, c.router_aux_loss_coef);
  }
  const auto written = nlohmann::json::parse(q.to_json("float32"));
  EXPECT_EQ(written["num_experts"], 8);
  EXPECT_EQ(written["use_sliding_window"], false);
  EXPECT_EQ(written["model_type"], "qwen3_moe");
}

TEST(MoEConfig, RefusesWhatItCannotHonourInOneLineNamingTheField) {
  const std::vector<std::tuple<nlohmann::json, std::function<void(nlohmann::json&)>, std::string>> cases = {
      {mixtral_json(), [](auto& j) { j["architectures"] = {"DeepseekV3ForCausalLM"}; },
       "architectures: 'DeepseekV3ForCausalLM' is not supported (MixtralForCausalLM, Qwen3MoeForCausalLM)"},
      {mixtral_json(), [](auto& j) { j["model_type"] = "qwen3_moe"; }, "model_type: "},
      {mixtral_json(), [](auto& j) { j["router_jitter_noise"] = 0.1; }, "router_jitter_noise: router jitter"},
      {mixtral_json(), [](auto& j) { j["sliding_window"] = 16; }, "sliding_window: 16 is a sliding window in use"},
      {mixtral_json(), [](auto& j) { j["num_experts_per_tok"] = 9; },
       "num_experts_per_tok (9) must be in 1..num_experts (8)"},
      {mixtral_json(), [](auto& j) { j["num_local_experts"] = "8"; }, "num_local_experts: expected an integer"},
      {mixtral_json(), [](auto& j) { j["hidden_act"] = "gelu"; }, "hidden_act: 'gelu' is not supported"},
      {qwen3_json(), [](auto& j) { j["use_sliding_window"] = true; }, "use_sliding_window: sliding-window attention"},
      {qwen3_json(), [](auto& j) { j["mlp_only_layers"] = {5}; }, "mlp_only_layers names layer 5, outside 0..2"},
      {qwen3_json(), [](auto& j) { j["mlp_only_layers"] = "all"; }, "mlp_only_layers: expected an array"},
      {qwen3_json(), [](auto& j) { j["decoder_sparse_step"] = 0; }, "decoder_sparse_step must be at least 1"},
      {qwen3_json(), [](auto& j) { j["norm_topk_prob"] = 1; }, "norm_topk_prob: expected true or false"},
      {qwen3_json(), [](auto& j) { j["router_aux_loss_coef"] = -1; }, "router_aux_loss_coef must not be negative"},
      {qwen3_json(),
       [](auto& j) {
         j["rope_parameters"] = {{"rope_type", "yarn"}};
       },
       "rope_parameters.rope_type: 'yarn' is not supported"},
  };
  for (const auto& [base, edit, expected] : cases) {
    const std::string msg = refusal(base, edit);
    EXPECT_NE(msg.find(expected), std::string::npos) << "expected '" << expected << "' in: " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("test/config.json: ", 0), 0u) << msg;
  }
}
