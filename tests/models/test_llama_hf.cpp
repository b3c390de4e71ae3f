// The Llama family against transformers: folders made by scripts/make-hf-fixtures.py (random
// LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM saved by transformers' save_pretrained,
// with transformers' logits on fixed tokens) load into our model, unsharded and FSDP-sharded over
// 2 and 3 ranks, and give the same logits within 1e-5 x max |theirs|; what we export loads back with the
// same logits (and, when FSDP_TEST_HF_PYTHON names a Python with transformers, in transformers);
// config.json in both transformers spellings; every bad input is one line and leaves the model as
// it was (a FIFO in the folder included: refused, never opened; NaN weights refused on every rank).
// Exports never lose data: the --init-from folder and someone's files are refused, a re-export
// replaces an earlier one only once complete, a failed one leaves it byte-identical. No Python at
// test time otherwise: the fixtures are committed.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <sys/stat.h>

#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "folder_bytes.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/fsdp.h"
#include "models/llama/hf.h"
#include "multiprocess.h"
#include "subprocess.h"
#include "test_helpers.h"

using namespace fsdp::testing;
namespace fs = std::filesystem;
namespace st = fsdp::safetensors;
using fsdp::models::HFError;
using fsdp::models::Llama;
using fsdp::models::LlamaConfig;
using fsdp::models::LlamaConfigError;

namespace {

const std::vector<std::string> kFixtures = {"llama_tied_bf16", "llama_untied_sharded", "qwen2", "mistral"};

std::string fixture(const std::string& name) { return std::string(FSDP_HF_FIXTURES) + "/" + name; }

std::string env(const char* name) {
  const char* v = std::getenv(name);
  TORCH_CHECK(v, name, " is not set");
  return v;
}

struct Reference {
  at::Tensor tokens, logits;
};
Reference reference(const std::string& dir) {
  st::Reader r(dir + "/reference.safetensors");
  return {r.read("tokens"), r.read("logits")};
}

// max |ours - theirs| / max |theirs|: the issue's criterion is <= 1e-5.
double rel_diff(const at::Tensor& ours, const at::Tensor& theirs) {
  return (ours - theirs).abs().max().item<double>() / theirs.abs().max().item<double>();
}

Llama load_unsharded(const std::string& dir) {
  auto c = fsdp::models::read_hf_config(dir);
  Llama model(c);
  fsdp::models::load_hf_weights(*model, dir);
  return model;
}

// The recipe of models/llama/hf.h: meta build, a unit per decoder layer then the root, this
// rank's shards allocated, then each rank reads its own rows.
Llama load_sharded(const std::string& dir) {
  auto c = fsdp::models::read_hf_config(dir);
  c.device = torch::kMeta;
  Llama model(c);
  for (auto& layer : model->layers()) fsdp::fully_shard(layer);
  fsdp::fully_shard(model);
  fsdp::to_empty(*model, torch::kCPU);
  fsdp::models::load_hf_weights(*model, dir);
  return model;
}

at::Tensor logits_of(Llama& model, const at::Tensor& tokens) {
  torch::NoGradGuard no_grad;
  return fsdp::call(model, tokens);
}

}  // namespace

// ---- logits against transformers --------------------------------------------------------------

TEST(LlamaHF, LogitsMatchTransformersUnsharded) {
  for (const auto& name : kFixtures) {
    auto model = load_unsharded(fixture(name));
    const auto ref = reference(fixture(name));
    const double diff = rel_diff(logits_of(model, ref.tokens), ref.logits);
    EXPECT_LE(diff, 1e-5) << name;
    std::printf("%-22s unsharded: max|ours - transformers| / max|transformers| = %.3g\n", name.c_str(), diff);
  }
}

FSDP_RANK_WORKER(llama_logits_fsdp) {
  for (const auto& name : kFixtures) {
    auto model = load_sharded(fixture(name));
    // Shards really are shards: each rank holds only its rows of the first layer's q_proj.
    auto info = fsdp::shard_info(model->named_parameters()["model.layers.0.self_attn.q_proj.weight"]);
    TORCH_CHECK(info && info->local_rows < info->global_shape[0], name, ": q_proj is not sharded");
    const auto ref = reference(fixture(name));
    const double diff = rel_diff(logits_of(model, ref.tokens), ref.logits);
    TORCH_CHECK(diff <= 1e-5, name, " at FSDP ", fsdp::dist::world_size(), " ranks: relative difference ", diff);
    if (fsdp::dist::rank() == 0)
      std::printf("%-22s FSDP %d ranks: relative difference %.3g\n", name.c_str(), fsdp::dist::world_size(), diff);
  }
}

TEST(LlamaHF, LogitsMatchTransformersFSDP2) { EXPECT_RANKS_PASS(2, "llama_logits_fsdp"); }
// Uneven shards: 3 ranks split 32, 64 and 256 rows unevenly (the last rank holds fewer).
TEST(LlamaHF, LogitsMatchTransformersFSDP3) { EXPECT_RANKS_PASS(3, "llama_logits_fsdp"); }

// Sharded training still works on a loaded model (gradients reach every shard, the loss falls).
FSDP_RANK_WORKER(llama_train_steps) {
  auto model = load_sharded(fixture("llama_untied_sharded"));
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.0));
  const auto tokens = reference(fixture("llama_untied_sharded")).tokens;
  double first = 0, last = 0;
  for (int step = 0; step < 4; ++step) {
    opt.zero_grad();
    auto logits = fsdp::call(model, tokens.narrow(1, 0, tokens.size(1) - 1));
    auto loss = torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}),
                                                     tokens.narrow(1, 1, tokens.size(1) - 1).reshape(-1));
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  TORCH_CHECK(last < first, "loss did not fall: ", first, " -> ", last);
}

TEST(LlamaHF, TrainsShardedFromLoadedWeights) { EXPECT_RANKS_PASS(2, "llama_train_steps"); }

// ---- export -----------------------------------------------------------------------------------

FSDP_RANK_WORKER(llama_export_sharded) {
  auto untied = load_sharded(fixture("llama_untied_sharded"));
  fsdp::models::save_hf(*untied, env("EXPORT_DIR") + "/fp32", {.max_shard_size = 30'000});
  auto tied = load_sharded(fixture("llama_tied_bf16"));
  fsdp::models::save_hf(*tied, env("EXPORT_DIR") + "/bf16",
                        {.dtype = at::kBFloat16, .copy_from = fixture("llama_tied_bf16")});
}

class LlamaHFFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("fsdp_llama_hf_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

TEST_F(LlamaHFFiles, ExportFromFSDPLoadsBackWithTheSameLogits) {
  RanksOptions options;
  options.env["EXPORT_DIR"] = dir_.string();
  EXPECT_RANKS_PASS(2, "llama_export_sharded", options);

  // fp32, split: model-0000k-of-0000n.safetensors + index, every file {"format": "pt"}.
  const fs::path fp32 = dir_ / "fp32";
  std::ifstream in(fp32 / "model.safetensors.index.json");
  ASSERT_TRUE(in) << "no index";
  const auto index = nlohmann::json::parse(in);
  std::set<std::string> files;
  for (const auto& [name, file] : index["weight_map"].items()) files.insert(file.get<std::string>());
  EXPECT_GT(files.size(), 2u);
  const std::string last =
      "model-0000" + std::to_string(files.size()) + "-of-0000" + std::to_string(files.size()) + ".safetensors";
  EXPECT_TRUE(files.count(last)) << "expected " << last;
  uint64_t total = 0;
  for (const auto& f : files) {
    st::Reader r((fp32 / f).string());
    EXPECT_EQ(r.header().metadata.at("format"), "pt") << f;
    for (const auto& t : r.header().tensors) total += t.nbytes();
  }
  EXPECT_EQ(index["metadata"]["total_size"].get<uint64_t>(), total);
  auto model = load_unsharded(fp32.string());
  EXPECT_EQ(index["weight_map"].size(), model->named_parameters().size());
  const auto ref = reference(fixture("llama_untied_sharded"));
  EXPECT_LE(rel_diff(logits_of(model, ref.tokens), ref.logits), 1e-5);

  // bf16, tied (no lm_head.weight), one file; the fixture's bf16 weights survive exactly.
  const fs::path bf16 = dir_ / "bf16";
  st::Reader r((bf16 / "model.safetensors").string());
  EXPECT_EQ(r.header().find("lm_head.weight"), nullptr);
  EXPECT_EQ(r.entry("model.embed_tokens.weight").dtype, at::kBFloat16);
  EXPECT_EQ(LlamaConfig::from_file((bf16 / "config.json").string()).torch_dtype, "bfloat16");
  EXPECT_TRUE(fs::exists(bf16 / "generation_config.json"));
  auto tied = load_unsharded(bf16.string());
  const auto tied_ref = reference(fixture("llama_tied_bf16"));
  EXPECT_LE(rel_diff(logits_of(tied, tied_ref.tokens), tied_ref.logits), 1e-5);

  // transformers itself, where a Python with it is at hand (never downloaded here).
  const char* python = std::getenv("FSDP_TEST_HF_PYTHON");
  if (!python) {
    std::printf("FSDP_TEST_HF_PYTHON not set: the exports were not loaded by transformers\n");
    return;
  }
  for (const auto& [out, name] : {std::pair{fp32, "llama_untied_sharded"}, std::pair{bf16, "llama_tied_bf16"}}) {
    ProcessSpec spec;
    spec.argv = {python, "-c", R"(
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
ref = load_file(sys.argv[2])
with torch.no_grad():
    logits = model(ref["tokens"]).logits
diff = ((logits - ref["logits"]).abs().max() / ref["logits"].abs().max()).item()
prompt = ref["tokens"][:, :4]
model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False, pad_token_id=0)
print("transformers on our export: relative difference", diff)
sys.exit(0 if diff <= 1e-5 else 1)
)",
                 out.string(), fixture(name) + "/reference.safetensors"};
    spec.timeout = std::chrono::seconds(120);
    auto result = Child(spec).wait();
    EXPECT_TRUE(result.ok()) << result.output;
    std::printf("%s", result.output.c_str());
  }
}

// ---- config.json ------------------------------------------------------------------------------

namespace {

// A Llama config in transformers 5.x's spelling; `edit` changes it before parsing.
LlamaConfig parse(const std::function<void(nlohmann::json&)>& edit = {}) {
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"vocab_size", 100},
                      {"hidden_size", 64},
                      {"intermediate_size", 96},
                      {"num_hidden_layers", 3},
                      {"num_attention_heads", 8},
                      {"num_key_value_heads", 2},
                      {"rms_norm_eps", 1e-5},
                      {"max_position_embeddings", 512},
                      {"hidden_act", "silu"},
                      {"bos_token_id", 1},
                      {"rope_parameters",
                       {{"rope_type", "llama3"},
                        {"rope_theta", 500000.0},
                        {"factor", 32.0},
                        {"low_freq_factor", 1.0},
                        {"high_freq_factor", 4.0},
                        {"original_max_position_embeddings", 8192}}},
                      {"dtype", "bfloat16"}};
  if (edit) edit(j);
  return LlamaConfig::from_json(j.dump(), "test/config.json");
}

// The one-line error of parsing an edited config.
std::string refusal(const std::function<void(nlohmann::json&)>& edit) {
  try {
    parse(edit);
  } catch (const LlamaConfigError& e) {
    return e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST(LlamaConfig, BothTransformersSpellings) {
  const auto v5 = parse();
  const auto v4 = parse([](nlohmann::json& j) {
    auto rope = j["rope_parameters"];
    j.erase("rope_parameters");
    j["rope_theta"] = rope["rope_theta"];
    rope.erase("rope_theta");
    rope.erase("rope_type");
    rope["type"] = "llama3";  // the older 4.x key
    j["rope_scaling"] = rope;
    j.erase("dtype");
    j["torch_dtype"] = "bfloat16";
  });
  for (const auto* c : {&v5, &v4}) {
    EXPECT_EQ(c->rope_type, "llama3");
    EXPECT_EQ(c->rope_theta, 500000.0);
    EXPECT_EQ(c->rope_factor, 32.0);
    EXPECT_EQ(c->rope_original_max_position_embeddings, 8192);
    EXPECT_EQ(c->torch_dtype, "bfloat16");
    EXPECT_EQ(c->num_key_value_heads, 2);
    EXPECT_EQ(c->resolved_head_dim(), 8);
  }
  // What we write reads back the same, unknown fields kept.
  const auto again = LlamaConfig::from_json(v5.to_json("float32"));
  EXPECT_EQ(again.rope_type, "llama3");
  EXPECT_EQ(again.rope_theta, 500000.0);
  EXPECT_EQ(again.passthrough.at("bos_token_id"), "1");
  EXPECT_EQ(again.torch_dtype, "float32");
  // Qwen2 has q/k/v biases (no o_proj bias) without saying so; Mistral without a window loads.
  const auto qwen = parse([](nlohmann::json& j) {
    j["architectures"] = {"Qwen2ForCausalLM"};
    j["model_type"] = "qwen2";
    j["use_sliding_window"] = false;
    j["sliding_window"] = 4096;
  });
  EXPECT_TRUE(qwen.qkv_bias());
  EXPECT_FALSE(qwen.o_bias());
  EXPECT_NO_THROW(parse([](nlohmann::json& j) {
    j["architectures"] = {"MistralForCausalLM"};
    j["model_type"] = "mistral";
    j["sliding_window"] = nullptr;
  }));
}

TEST(LlamaConfig, RefusesWhatItCannotHonourInOneLineNamingTheField) {
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> cases = {
      {[](auto& j) { j["architectures"] = {"GPTNeoXForCausalLM"}; }, "architectures: 'GPTNeoXForCausalLM'"},
      {[](auto& j) { j["model_type"] = "qwen2"; }, "model_type: 'qwen2' does not match"},
      {[](auto& j) { j["rope_parameters"]["rope_type"] = "yarn"; }, "rope_parameters.rope_type: 'yarn'"},
      {[](auto& j) { j["hidden_act"] = "gelu"; }, "hidden_act: 'gelu'"},
      {[](auto& j) { j.erase("hidden_size"); }, "hidden_size: missing"},
      {[](auto& j) { j["num_key_value_heads"] = 3; }, "num_key_value_heads (3) must divide"},
      {[](auto& j) { j["vocab_size"] = "100"; }, "vocab_size: expected an integer"},
      {[](auto& j) {
         j["architectures"] = {"MistralForCausalLM"};
         j["model_type"] = "mistral";
         j["sliding_window"] = 64;
       },
       "sliding_window: 64 is a sliding window in use"},
      {[](auto& j) { j["use_sliding_window"] = true; }, "use_sliding_window:"},
      {[](auto& j) {
         j["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
       },
       "layer_types:"},
      {[](auto& j) { j["pretraining_tp"] = 2; }, "pretraining_tp: 2"},
      {[](auto& j) {
         j["quantization_config"] = {{"quant_method", "gptq"}};
       },
       "quantization_config:"},
      {[](auto& j) { j["dtype"] = "float8_e4m3fn"; }, "torch_dtype: 'float8_e4m3fn'"},
  };
  for (const auto& [edit, want] : cases) {
    const std::string msg = refusal(edit);
    EXPECT_NE(msg.find("test/config.json: " + want), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

// ---- bad folders ------------------------------------------------------------------------------

namespace {

// Parameters of a model, copied (to show that a refused load changed nothing).
std::map<std::string, at::Tensor> snapshot(Llama& model) {
  std::map<std::string, at::Tensor> out;
  for (const auto& p : model->named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

// The error of loading `dir` into a fresh model of `config_dir`'s config; the model must be
// untouched by it.
std::string load_error(const fs::path& dir, const std::string& config_dir) {
  auto c = fsdp::models::read_hf_config(config_dir);
  c.init_seed = 3;
  Llama model(c);
  const auto before = snapshot(model);
  std::string msg = "(loaded)";
  try {
    fsdp::models::load_hf_weights(*model, dir.string());
  } catch (const HFError& e) {
    msg = e.what();
  } catch (const std::exception& e) {
    msg = std::string("wrong exception type: ") + e.what();
  }
  for (const auto& [name, t] : snapshot(model)) EXPECT_TRUE(at::equal(t, before.at(name))) << name << " was changed";
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  return msg;
}

// `from`'s model.safetensors rewritten by `edit` (name -> tensor) into `to`, with its config.json.
void rewrite(const std::string& from, const fs::path& to,
             const std::function<void(std::map<std::string, at::Tensor>&)>& edit) {
  fs::create_directories(to);
  fs::copy_file(fs::path(from) / "config.json", to / "config.json");
  st::Reader r(from + "/model.safetensors");
  std::map<std::string, at::Tensor> tensors;
  for (const auto& e : r.header().tensors) tensors[e.name] = r.read(e.name);
  edit(tensors);
  std::vector<st::NamedTensor> out;
  for (auto& [name, t] : tensors) out.push_back({name, t});
  st::write_file((to / "model.safetensors").string(), out, {{"format", "pt"}});
}

}  // namespace

TEST_F(LlamaHFFiles, IgnoresRotaryInvFreqAndLoadsIntoAnUnshardedModel) {
  const std::string src = fixture("qwen2");
  rewrite(src, dir_ / "ok", [](auto& t) { t["model.layers.0.self_attn.rotary_emb.inv_freq"] = at::ones({4}); });
  auto c = fsdp::models::read_hf_config(src);
  Llama model(c);
  fsdp::models::load_hf_weights(*model, (dir_ / "ok").string());
  const auto ref = reference(src);
  EXPECT_LE(rel_diff(logits_of(model, ref.tokens), ref.logits), 1e-5);
}

TEST_F(LlamaHFFiles, EveryBadInputIsOneLineAndTouchesNothing) {
  const std::string qwen = fixture("qwen2"), sharded = fixture("llama_untied_sharded");

  rewrite(qwen, dir_ / "keys", [](auto& t) {
    t.erase("model.norm.weight");
    t.erase("lm_head.weight");
    t["model.extra.weight"] = at::zeros({2});
  });
  EXPECT_NE(load_error(dir_ / "keys", qwen)
                .find("2 missing (model.norm.weight, lm_head.weight); 1 unexpected (model.extra.weight)"),
            std::string::npos);

  rewrite(qwen, dir_ / "many", [](auto& t) {
    for (auto it = t.begin(); it != t.end();)
      it = it->first.find("layers.1.") != std::string::npos ? t.erase(it) : ++it;
  });
  EXPECT_NE(load_error(dir_ / "many", qwen).find("12 missing (model.layers.1."), std::string::npos);
  EXPECT_NE(load_error(dir_ / "many", qwen).find(" and 7 more)"), std::string::npos);

  rewrite(qwen, dir_ / "shape", [](auto& t) { t["model.norm.weight"] = at::ones({31}); });
  EXPECT_NE(load_error(dir_ / "shape", qwen).find("'model.norm.weight' has shape [31] but the model expects [32]"),
            std::string::npos);

  rewrite(qwen, dir_ / "int", [](auto& t) { t["model.norm.weight"] = at::ones({32}, at::kInt); });
  EXPECT_NE(load_error(dir_ / "int", qwen).find("'model.norm.weight' is I32, not a float dtype"), std::string::npos);

  // A short file and a damaged header: the file is named.
  fs::copy(qwen, dir_ / "short");
  const fs::path short_file = dir_ / "short" / "model.safetensors";
  fs::resize_file(short_file, fs::file_size(short_file) - 100);
  const auto short_msg = load_error(dir_ / "short", qwen);
  EXPECT_NE(short_msg.find(short_file.string() + ": "), std::string::npos) << short_msg;
  EXPECT_NE(short_msg.find("truncated"), std::string::npos) << short_msg;

  fs::copy(qwen, dir_ / "header");
  {
    std::fstream f(dir_ / "header" / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("[[[[", 4);
  }
  const auto header_msg = load_error(dir_ / "header", qwen);
  EXPECT_NE(header_msg.find((dir_ / "header" / "model.safetensors").string() + ": header is not valid JSON"),
            std::string::npos)
      << header_msg;

  // An index naming a file that is not there.
  fs::copy(sharded, dir_ / "lost");
  fs::remove(dir_ / "lost" / "model-00003-of-00005.safetensors");
  EXPECT_NE(load_error(dir_ / "lost", sharded).find("model-00003-of-00005.safetensors: listed by"), std::string::npos);

  // pickle weights only, and no weights at all.
  fs::create_directories(dir_ / "bin");
  fs::copy_file(fs::path(qwen) / "config.json", dir_ / "bin" / "config.json");
  std::ofstream(dir_ / "bin" / "pytorch_model.bin") << "not loaded";
  EXPECT_NE(load_error(dir_ / "bin", qwen).find("pytorch_model.bin weights only, which are not loaded"),
            std::string::npos);
  fs::remove(dir_ / "bin" / "pytorch_model.bin");
  EXPECT_NE(load_error(dir_ / "bin", qwen).find("no model.safetensors or model.safetensors.index.json"),
            std::string::npos);

  // A folder of another model than the one built.
  EXPECT_NE(load_error(qwen, fixture("mistral"))
                .find("config.json: architectures is Qwen2ForCausalLM but the model was built with MistralForCausalLM"),
            std::string::npos);
}

// ---- exports never lose data; model folders refused before work ------------------------------

namespace {

// The HFError of `fn` (one line), or a note saying what happened instead.
std::string hf_refusal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const HFError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return msg;
  } catch (const std::exception& e) {
    return std::string("(wrong exception type: ") + e.what() + ")";
  }
  return "(accepted)";
}

void expect_contains(const std::string& text, const std::string& needle) {
  EXPECT_NE(text.find(needle), std::string::npos) << "want '" << needle << "' in: " << text;
}

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

at::Tensor param(Llama& model, const std::string& name) { return model->named_parameters()[name]; }

}  // namespace

// The --init-from folder (directly, through a symlinked parent, or as a link), a folder of someone
// else's files, a Hugging Face folder that is not ours, a file, a path under a file: each refused
// in one line before anything is written, every file there byte-identical, nothing left behind.
TEST_F(LlamaHFFiles, ExportRefusesTheInitFromFolderAndSomeoneElsesFiles) {
  const fs::path init = dir_ / "init";
  fs::copy(fixture("qwen2"), init);
  fs::create_directories(dir_ / "notes");
  write_text(dir_ / "notes" / "notes.txt", "mine");
  write_text(dir_ / "notes" / "model-00001-of-00002.safetensors", "also mine");
  fs::copy(fixture("mistral"), dir_ / "hub");
  fs::remove(dir_ / "hub" / "reference.safetensors");  // what transformers' save_pretrained wrote, no more
  write_text(dir_ / "file", "a file");
  fs::create_directory_symlink(dir_, dir_ / "link");
  fs::create_directory_symlink(init, dir_ / "init_link");
  const auto before = folder_bytes(dir_);
  auto model = load_unsharded(init.string());
  auto refused = [&](const fs::path& out, const std::string& copy_from) {
    return hf_refusal([&] { fsdp::models::save_hf(*model, out.string(), {.copy_from = copy_from}); });
  };
  expect_contains(refused(init, init.string()), init.string() + ": is the --init-from folder");
  expect_contains(refused(dir_ / "link" / "init", init.string()), "is the --init-from folder");
  expect_contains(refused(dir_ / "init_link", init.string()), "is the --init-from folder");
  expect_contains(refused(dir_ / "init_link", ""), "is a symbolic link");
  expect_contains(refused(dir_ / "notes", ""), "holds files an export does not write ('");
  expect_contains(refused(dir_ / "hub", ""), "holds a Hugging Face folder that is not an export of ours");
  expect_contains(refused(dir_ / "file", ""), "exists and is not a folder");
  expect_contains(refused(dir_ / "file" / "sub", ""), "which is not a folder");
  EXPECT_EQ(folder_bytes(dir_), before);
  EXPECT_EQ(names_in(dir_), (std::set<std::string>{"init", "notes", "hub", "file", "link", "init_link"}));
  // check_hf_export_dir (train_gpt's and fsdp-ckpt's check at start) says the same.
  expect_contains(hf_refusal([&] { fsdp::models::check_hf_export_dir((dir_ / "notes").string()); }),
                  "holds files an export does not write");
}

// An export writes the marker; a second export into the same folder (another split this time)
// replaces the first completely; an empty folder is replaced too; nothing else is left around.
TEST_F(LlamaHFFiles, ReExportReplacesAnEarlierExport) {
  auto model = load_unsharded(fixture("qwen2"));
  const fs::path out = dir_ / "out";
  fsdp::models::save_hf(*model, out.string());
  std::ifstream marker(out / fsdp::models::kHFExportMarker);
  ASSERT_TRUE(marker) << "no " << fsdp::models::kHFExportMarker;
  EXPECT_EQ(nlohmann::json::parse(marker).value("format", ""), "fsdp-hf-export");
  {
    torch::NoGradGuard no_grad;
    param(model, "model.norm.weight").fill_(2.0);
  }
  const auto written = fsdp::models::save_hf(*model, out.string(), {.max_shard_size = 30'000});
  EXPECT_FALSE(fs::exists(out / "model.safetensors")) << "the earlier export's weights are still there";
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  for (const auto& f : written) EXPECT_TRUE(fs::exists(f)) << f;
  auto again = load_unsharded(out.string());
  EXPECT_TRUE(at::equal(param(again, "model.norm.weight"), at::full({32}, 2.0)));
  fs::create_directories(dir_ / "empty");
  fsdp::models::save_hf(*model, (dir_ / "empty").string());
  EXPECT_TRUE(fs::exists(dir_ / "empty" / "config.json"));
  // Without RENAME_EXCHANGE (the backup-name path): replaced too, the backup removed.
  fsdp::models::set_hf_export_faults({.no_rename_exchange = true});
  fsdp::models::save_hf(*model, out.string());
  fsdp::models::set_hf_export_faults({});
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_EQ(names_in(dir_), (std::set<std::string>{"out", "empty"}));
}

// A re-export that fails on rank 0 (a full disk, injected: after config.json, before the gathers;
// and after the weights, before the commit) is the same one-line HFExportError on both ranks (no
// hang, no peer's closed connection), removes its temporary folder, and leaves the earlier export.
FSDP_RANK_WORKER(llama_export_fails_on_rank0) {
  auto model = load_sharded(fixture("qwen2"));
  const std::string out = env("EXPORT_DIR") + "/out";
  for (int after : {1, 3}) {  // config.json | + generation_config.json + model.safetensors
    if (fsdp::dist::rank() == 0) fsdp::models::set_hf_export_faults({.fail_after_files = after});
    std::string msg = "(accepted)";
    try {
      fsdp::models::save_hf(*model, out, {.copy_from = fixture("qwen2")});
    } catch (const fsdp::models::HFExportError& e) {
      msg = e.what();
    }
    fsdp::models::set_hf_export_faults({});
    TORCH_CHECK(msg.find("export to " + out + " failed: cannot write") != std::string::npos &&
                    msg.find("No space left on device") != std::string::npos &&
                    msg.find("removed its temporary folder") != std::string::npos &&
                    msg.find(out + " is as it was") != std::string::npos && msg.find('\n') == std::string::npos,
                "after ", after, " files: ", msg);
  }
}

TEST_F(LlamaHFFiles, FailedReExportLeavesTheEarlierExportAtTwoRanks) {
  auto model = load_unsharded(fixture("qwen2"));
  {
    torch::NoGradGuard no_grad;
    param(model, "model.norm.weight").fill_(3.0);
  }
  const fs::path out = dir_ / "out";
  fsdp::models::save_hf(*model, out.string());
  const auto before = folder_bytes(out);
  RanksOptions options;
  options.env["EXPORT_DIR"] = dir_.string();
  options.timeout = std::chrono::seconds(120);
  EXPECT_RANKS_PASS(2, "llama_export_fails_on_rank0", options);
  EXPECT_EQ(folder_bytes(out), before);
  EXPECT_EQ(names_in(dir_), std::set<std::string>{"out"}) << "a temporary folder was left";
  auto again = load_unsharded(out.string());
  EXPECT_TRUE(at::equal(param(again, "model.norm.weight"), at::full({32}, 3.0)));
}

// fsdp-ckpt export-hf's library call: the destination is checked before the checkpoint is read;
// a re-export failing half way (after config.json and one of the shards) leaves the earlier one.
TEST_F(LlamaHFFiles, CheckpointExportIsCheckedFirstAndFailsWithoutLoss) {
  auto model = load_unsharded(fixture("llama_untied_sharded"));
  fsdp::models::HFConfigState hf(model->config);
  const fs::path ck = dir_ / "ck", out = dir_ / "out";
  fsdp::checkpoint::save(ck.string(), {model.ptr(), nullptr, {{fsdp::models::kHFConfigEntry, &hf}}, {}});
  fsdp::models::export_hf_from_checkpoint(ck.string(), out.string(), {.max_shard_size = 30'000});
  const auto before = folder_bytes(out);
  ASSERT_GT(before.size(), 4u);
  fsdp::models::set_hf_export_faults({.fail_after_files = 3});
  std::string msg = "(accepted)";
  try {
    fsdp::models::export_hf_from_checkpoint(ck.string(), out.string(), {.max_shard_size = 30'000});
  } catch (const fsdp::models::HFExportError& e) {
    msg = e.what();
  }
  fsdp::models::set_hf_export_faults({});
  expect_contains(msg, "No space left on device");
  expect_contains(msg, "removed its temporary folder");
  EXPECT_EQ(folder_bytes(out), before);
  EXPECT_EQ(names_in(dir_), (std::set<std::string>{"ck", "out"}));
  load_unsharded(out.string());
  // Refused before reading: the checkpoint folder as the destination (named, not the checkpoint).
  expect_contains(hf_refusal([&] { fsdp::models::export_hf_from_checkpoint((dir_ / "absent").string(), ck.string()); }),
                  ck.string() + ": holds files an export does not write");
  fsdp::models::export_hf_from_checkpoint(ck.string(), out.string(), {.dtype = at::kBFloat16});
  EXPECT_EQ(LlamaConfig::from_file((out / "config.json").string()).torch_dtype, "bfloat16");
  EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json"));
}

// A FIFO where a model folder has a file (config.json, model.safetensors, the index, a shard it
// names, a file an export copies along) is refused from its stat in one line, never opened (which
// would block forever): the worker's timeout fails the test if anything hangs.
FSDP_RANK_WORKER(llama_fifo_refused) {
  const fs::path root = env("FIFO_DIR");
  auto fifo_at = [&](const std::string& fixture_name, const std::string& file) {
    const fs::path dir = root / (fixture_name + "_" + fs::path(file).stem().string());
    fs::copy(fixture(fixture_name), dir);
    fs::remove(dir / file);
    TORCH_CHECK(::mkfifo((dir / file).c_str(), 0644) == 0, "mkfifo failed");
    return dir;
  };
  auto expect_fifo = [](const std::function<void()>& fn, const fs::path& where) {
    fsdp::testing::expect_error(fn, where.string() + ": is a FIFO (named pipe), not a regular file");
  };
  const fs::path config = fifo_at("qwen2", "config.json");
  expect_fifo([&] { fsdp::models::read_hf_config(config.string()); }, config / "config.json");
  auto c = fsdp::models::read_hf_config(fixture("qwen2"));
  Llama qwen(c);
  for (const std::string file : {"model.safetensors"}) {
    const fs::path dir = fifo_at("qwen2", file);
    expect_fifo([&] { fsdp::models::load_hf_weights(*qwen, dir.string()); }, dir / file);
    expect_fifo([&] { fsdp::models::check_hf_weights(dir.string()); }, dir / file);
  }
  auto s = fsdp::models::read_hf_config(fixture("llama_untied_sharded"));
  Llama sharded(s);
  for (const std::string file : {"model.safetensors.index.json", "model-00002-of-00005.safetensors"}) {
    const fs::path dir = fifo_at("llama_untied_sharded", file);
    expect_fifo([&] { fsdp::models::load_hf_weights(*sharded, dir.string()); }, dir / file);
  }
  const fs::path gen = fifo_at("qwen2", "generation_config.json");
  expect_fifo([&] { fsdp::models::save_hf(*qwen, (root / "out").string(), {.copy_from = gen.string()}); },
              gen / "generation_config.json");
  TORCH_CHECK(!fs::exists(root / "out"), "a refused export left its folder");
}

TEST_F(LlamaHFFiles, FifoInAModelFolderIsRefusedWithinSeconds) {
  RanksOptions options;
  options.env["FIFO_DIR"] = dir_.string();
  options.timeout = std::chrono::seconds(30);
  options.init_runtime = false;
  EXPECT_RANKS_PASS(1, "llama_fifo_refused", options);
}

// NaN or Inf in the weights: refused naming the first such tensor, unless allowed. At FSDP 2 ranks
// the bad rows are rank 1's alone (the last rows), and both ranks refuse the same tensor.
FSDP_RANK_WORKER(llama_nonfinite_refused_on_every_rank) {
  auto c = fsdp::models::read_hf_config(env("NAN_DIR"));
  c.device = torch::kMeta;
  Llama model(c);
  for (auto& layer : model->layers()) fsdp::fully_shard(layer);
  fsdp::fully_shard(model);
  fsdp::to_empty(*model, torch::kCPU);
  fsdp::testing::expect_error(
      [&] { fsdp::models::load_hf_weights(*model, env("NAN_DIR")); },
      "'model.layers.1.mlp.down_proj.weight' holds NaN or Inf values (the first of 2 tensors that do)");
}

TEST_F(LlamaHFFiles, NonFiniteWeightsAreRefusedUnlessAllowed) {
  const std::string qwen = fixture("qwen2");
  const fs::path bad = dir_ / "nan";
  rewrite(qwen, bad, [](auto& t) {
    t["model.layers.1.mlp.down_proj.weight"][-1][0] = std::nan("");
    t["lm_head.weight"][-1][1] = INFINITY;
  });
  auto c = fsdp::models::read_hf_config(qwen);
  Llama model(c);
  expect_contains(
      hf_refusal([&] { fsdp::models::load_hf_weights(*model, bad.string()); }),
      bad.string() +
          ": 'model.layers.1.mlp.down_proj.weight' holds NaN or Inf values (the first of 2 tensors that do)");
  fsdp::models::load_hf_weights(*model, bad.string(), {.allow_nonfinite = true});
  EXPECT_TRUE(std::isnan(param(model, "model.layers.1.mlp.down_proj.weight")[-1][0].item<float>()));
  RanksOptions options;
  options.env["NAN_DIR"] = bad.string();
  EXPECT_RANKS_PASS(2, "llama_nonfinite_refused_on_every_rank", options);
}

// A shard in a subfolder of the model folder is inside it: loaded. '..' out of the folder and an
// empty weight_map are refused in one line.
TEST_F(LlamaHFFiles, IndexShardInASubfolderLoadsAndEscapesAreRefused) {
  const std::string src = fixture("llama_untied_sharded");
  const std::string moved = "model-00002-of-00005.safetensors";
  auto with_index = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    const fs::path dir = dir_ / name;
    fs::copy(src, dir);
    std::ifstream in(dir / "model.safetensors.index.json");
    auto index = nlohmann::json::parse(in);
    edit(index);
    write_text(dir / "model.safetensors.index.json", index.dump(2));
    return dir;
  };
  auto remap = [&](const std::string& to) {
    return [&, to](nlohmann::json& index) {
      for (auto& [name, file] : index["weight_map"].items())
        if (file == moved) file = to;
    };
  };
  const fs::path sub = with_index("sub", remap("shards/" + moved));
  fs::create_directories(sub / "shards");
  fs::rename(sub / moved, sub / "shards" / moved);
  auto model = load_unsharded(sub.string());
  const auto ref = reference(src);
  EXPECT_LE(rel_diff(logits_of(model, ref.tokens), ref.logits), 1e-5);

  const fs::path escape = with_index("escape", remap("../sub/shards/" + moved));
  expect_contains(load_error(escape, src), "names a file outside the folder: '../sub/shards/" + moved + "'");
  const fs::path empty =
      with_index("empty", [](nlohmann::json& index) { index["weight_map"] = nlohmann::json::object(); });
  expect_contains(load_error(empty, src), "\"weight_map\" is empty");
}

// A re-export killed half way (std::abort after config.json and two shards: no clean-up runs)
// leaves the earlier export byte-identical and loadable; its temporary folder is the only thing
// added, and the next export succeeds beside it.
FSDP_RANK_WORKER(llama_export_killed) {
  fsdp::models::set_hf_export_faults({.abort_after_files = 3});
  fsdp::models::export_hf_from_checkpoint(env("EXPORT_DIR") + "/ck", env("EXPORT_DIR") + "/out",
                                          {.max_shard_size = 30'000});
}

TEST_F(LlamaHFFiles, KilledReExportLeavesTheEarlierExport) {
  auto model = load_unsharded(fixture("llama_untied_sharded"));
  fsdp::models::HFConfigState hf(model->config);
  const fs::path ck = dir_ / "ck", out = dir_ / "out";
  fsdp::checkpoint::save(ck.string(), {model.ptr(), nullptr, {{fsdp::models::kHFConfigEntry, &hf}}, {}});
  fsdp::models::export_hf_from_checkpoint(ck.string(), out.string(), {.dtype = at::kBFloat16});
  const auto before = folder_bytes(out);
  RanksOptions options;
  options.env["EXPORT_DIR"] = dir_.string();
  options.init_runtime = false;
  const auto result = run_ranks(1, "llama_export_killed", options);
  ASSERT_EQ(result.ranks.size(), 1u);
  EXPECT_EQ(result.ranks[0].term_signal, SIGABRT) << result.report();
  EXPECT_EQ(folder_bytes(out), before);
  load_unsharded(out.string());
  std::vector<std::string> added;
  for (const auto& name : names_in(dir_))
    if (name != "ck" && name != "out") added.push_back(name);
  ASSERT_EQ(added.size(), 1u);
  EXPECT_EQ(added[0].rfind(".out.fsdp-export-tmp-", 0), 0u) << added[0];
  const auto left = names_in(dir_ / added[0]);  // config.json and two shards, no marker
  EXPECT_EQ(left.size(), 3u);
  EXPECT_TRUE(left.count("config.json"));
  EXPECT_FALSE(left.count(fsdp::models::kHFExportMarker));
  fsdp::models::export_hf_from_checkpoint(ck.string(), out.string());
  EXPECT_TRUE(fs::exists(out / "model.safetensors"));
  EXPECT_TRUE(fs::exists(dir_ / added[0])) << "another export's temporary folder was removed";
}
