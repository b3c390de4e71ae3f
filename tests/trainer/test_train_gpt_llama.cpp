// train_gpt --model llama / --init-from / --export-hf / --eval-only, and fsdp-ckpt export-hf,
// against the Hugging Face fixtures of tests/models/fixtures (made by transformers,
// scripts/make-hf-fixtures.py): a Llama from scratch and one loaded from a folder train alike in
// one process and at FSDP 2 ranks (losses within 1e-5), the first loss is the loaded weights'
// loss on the first batch, the exported folder loads back with the trained model's logits, the
// checkpoint exports to the same tensors, --eval-only reports the loss on consecutive windows from
// the start of the validation data, and each bad input is one line with exit status 2.
#include <torch/torch.h>

#include "data.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/safetensors.h"
#include "models/gpt.h"
#include "models/llama/hf.h"
#include "train_gpt_harness.h"

using namespace train_gpt_test;
using fsdp::models::Llama;

namespace {

const std::string kFsdpCkpt = FSDP_CKPT_PATH;

// This suite's runs: four steps of a Llama from a folder (train_gpt_harness.h's from_folder).
std::vector<std::string> four_steps_from(const std::string& dir, const std::string& metrics,
                                         const std::vector<std::string>& extra = {}) {
  return from_folder(dir, metrics, extra, 4);
}

// Sizes from a fixture's config.json, built unsharded in this process.
Llama build(const std::string& dir) {
  auto c = fsdp::models::read_hf_config(dir);
  return Llama(c);
}

Llama load_folder(const std::string& dir) {
  Llama model = build(dir);
  fsdp::models::load_hf_weights(*model, dir);
  return model;
}

// The model's weights from one of train_gpt's checkpoints (keys "model.<Hugging Face name>").
Llama load_checkpoint(const std::string& config_dir, const std::string& checkpoint) {
  Llama model = build(config_dir);
  fsdp::checkpoint::LoadOptions lo;
  lo.load_optimizer = false;
  fsdp::checkpoint::load(checkpoint, fsdp::checkpoint::State{model.ptr(), nullptr, {}, {}}, lo);
  return model;
}

double loss_of(Llama& model, const at::Tensor& batch) {
  torch::NoGradGuard no_grad;
  const int64_t T = batch.size(1) - 1;
  return fsdp::models::gpt_loss(model->forward(batch.narrow(1, 0, T)), batch.narrow(1, 1, T)).item<double>();
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

at::Tensor reference_tokens(const std::string& dir) {
  return fsdp::safetensors::Reader(dir + "/reference.safetensors").read("tokens");
}

// One "train_gpt: error: ..." line (fsdprun or not), nothing trained.
void expect_one_line_error(const ProcessResult& r, const std::string& program, const std::string& needle) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count(r.output, program + ": error: "), 1u) << r.output;
  EXPECT_NE(r.output.find(needle), std::string::npos) << "want '" << needle << "' in:\n" << r.output;
  EXPECT_EQ(count(r.output, "\n"), 1u) << "one line expected:\n" << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
}

}  // namespace

// --model llama from scratch (grouped KV heads, SwiGLU): one process and FSDP 2 ranks (with and
// without activation checkpointing) give the same losses, and the loss falls.
TEST(TrainGptLlama, FromScratchOneProcessEqualsTwoRanks) {
  TempDir tmp;
  const std::vector<std::string> llama = {"--model", "llama", "--kv-heads", "1", "--ffn-dim", "48"};
  const std::string m1 = tmp.path + "/one.jsonl", m2 = tmp.path + "/two.jsonl", m3 = tmp.path + "/ac.jsonl";
  const auto a = alone(tiny(m1, llama));
  ASSERT_TRUE(a.ok()) << a.output;
  EXPECT_NE(a.output.find("Llama (LlamaForCausalLM) 2 layers, hidden 32, 2 heads / 1 KV heads (head 16), ffn 48"),
            std::string::npos)
      << a.output;
  const auto b = ranks(2, tiny(m2, llama));
  ASSERT_TRUE(b.ok()) << b.output;
  auto ac = llama;
  ac.insert(ac.end(), {"--activation-checkpointing", "full"});
  const auto c = ranks(2, tiny(m3, ac));
  ASSERT_TRUE(c.ok()) << c.output;
  const auto la = losses(m1);
  ASSERT_EQ(la.size(), 6u);
  expect_close(losses(m2), la, 1e-5);
  expect_close(losses(m3), la, 1e-5);
  EXPECT_LT(la.back(), la.front());
}

// --init-from a transformers folder (untied with biases and head_dim != hidden / heads, sharded
// into five files; and tied bf16): one process and 2 ranks agree within 1e-5, and the first loss
// is the loaded weights' loss on the first global batch (computed here from the same data).
TEST(TrainGptLlama, InitFromOneProcessEqualsTwoRanksAndStartsFromTheWeights) {
  for (const std::string name : {"llama_untied_sharded", "llama_tied_bf16"}) {
    SCOPED_TRACE(name);
    TempDir tmp;
    const std::string m1 = tmp.path + "/one.jsonl", m2 = tmp.path + "/two.jsonl";
    const auto a = alone(four_steps_from(fixture(name), m1));
    ASSERT_TRUE(a.ok()) << a.output;
    EXPECT_NE(a.output.find("from " + fixture(name)), std::string::npos) << a.output;
    const auto b = ranks(2, four_steps_from(fixture(name), m2));
    ASSERT_TRUE(b.ok()) << b.output;
    const auto la = losses(m1);
    ASSERT_EQ(la.size(), 4u);
    expect_close(losses(m2), la, 1e-5);

    const train_gpt::TokenSource data("synthetic", 16, /*seed=*/0);
    Llama loaded = load_folder(fixture(name));
    const double expected = loss_of(loaded, data.train_batch(0, 8));
    EXPECT_NEAR(la[0], expected, 1e-5 * expected);
  }
}

// --export-hf after training at 2 ranks: the folder (config.json, weights, the copied
// generation_config.json) loads back into a fresh model with the trained model's logits (the
// checkpoint's weights) within 1e-6; fsdp-ckpt export-hf of the checkpoint writes the same
// tensors; bf16 and split exports load too; a resume from the checkpoint says it wins over
// --init-from.
TEST(TrainGptLlama, ExportHfReloadsTheTrainedModelAndCheckpointExportsMatch) {
  TempDir tmp;
  const std::string dir = fixture("llama_untied_sharded"), out = tmp.path + "/hf", ck = tmp.path + "/ck";
  const auto r = ranks(
      2, four_steps_from(dir, tmp.path + "/m.jsonl", {"--checkpoint-dir", ck, "--steps", "3", "--export-hf", out}));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("exported the model (fp32) to " + out), std::string::npos) << r.output;
  for (const char* f : {"config.json", "generation_config.json", "model.safetensors"})
    EXPECT_TRUE(fs::exists(fs::path(out) / f)) << f;

  const std::string step = ck + "/step_000003";
  Llama trained = load_checkpoint(dir, step);
  Llama reloaded = load_folder(out);
  Llama original = load_folder(dir);
  const at::Tensor tokens = reference_tokens(dir);
  torch::NoGradGuard no_grad;
  const at::Tensor want = trained->forward(tokens);
  EXPECT_LE(rel_diff(reloaded->forward(tokens), want), 1e-6);
  EXPECT_GT(rel_diff(original->forward(tokens), want), 1e-4) << "training did not change the model";

  // fsdp-ckpt export-hf from the checkpoint: the same tensors, bit for bit, and the same config.
  const std::string out2 = tmp.path + "/hf2";
  const auto e = run_process(spec_of({kFsdpCkpt, "export-hf", step, out2}, 60s));
  ASSERT_TRUE(e.ok()) << e.output;
  fsdp::safetensors::Reader ra(out + "/model.safetensors"), rb(out2 + "/model.safetensors");
  ASSERT_EQ(ra.header().tensors.size(), rb.header().tensors.size());
  for (const auto& t : ra.header().tensors) {
    const at::Tensor x = ra.read(t.name), y = rb.read(t.name);
    EXPECT_TRUE(x.scalar_type() == y.scalar_type() && x.sizes() == y.sizes() && x.equal(y)) << t.name;
  }
  auto json_of = [](const std::string& f) {
    std::ifstream in(f);
    return nlohmann::json::parse(in);
  };
  EXPECT_EQ(json_of(out + "/config.json"), json_of(out2 + "/config.json"));

  // bf16, split into several files with an index: loads back within bf16's rounding.
  const std::string out3 = tmp.path + "/hf3";
  const auto e3 =
      run_process(spec_of({kFsdpCkpt, "export-hf", step, out3, "--dtype", "bf16", "--max-shard-size", "8000"}, 60s));
  ASSERT_TRUE(e3.ok()) << e3.output;
  EXPECT_TRUE(fs::exists(out3 + "/model.safetensors.index.json"));
  EXPECT_EQ(json_of(out3 + "/config.json").value("torch_dtype", ""), "bfloat16");
  Llama bf16 = load_folder(out3);
  EXPECT_LE(rel_diff(bf16->forward(tokens), want), 2e-2);
}

// A checkpoint of an --init-from run (saved at 2 ranks) resumed in one process with --init-from
// still given: the checkpoint wins (the banner says so) and the losses go on as uninterrupted.
TEST(TrainGptLlama, ResumeFromCheckpointWinsOverInitFrom) {
  TempDir tmp;
  const std::string dir = fixture("llama_untied_sharded"), ck = tmp.path + "/ck";
  const std::string full = tmp.path + "/full.jsonl", part = tmp.path + "/part.jsonl";
  const auto a = ranks(2, four_steps_from(dir, full, {"--checkpoint-dir", ck, "--checkpoint-every", "2"}));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto b =
      alone(four_steps_from(dir, part, {"--checkpoint-dir", tmp.path + "/ck2", "--resume-from", ck + "/step_000002"}));
  ASSERT_TRUE(b.ok()) << b.output;
  EXPECT_NE(b.output.find("the checkpoint wins: " + dir + "'s weights are not loaded"), std::string::npos) << b.output;
  const auto lf = losses(full), lp = losses(part);
  ASSERT_EQ(lf.size(), 4u);
  expect_close(lp, {lf[2], lf[3]}, 1e-5);
}

// --eval-only: the loss on --eval-batches global batches of consecutive windows from the start of
// the validation bytes (the last 10% of the file), printed as "val ..." and written as val_loss;
// the same at 1 and 2 ranks; no training and no checkpoint.
TEST(TrainGptLlama, EvalOnlyIsTheLossOnConsecutiveValidationWindows) {
  TempDir tmp;
  const std::string text = tmp.path + "/text.txt";
  {
    std::ofstream f(text);
    for (int i = 0; i < 400; ++i) f << "line " << i << ": the quick brown fox " << (i * 7919 % 1000) << "\n";
  }
  const std::string dir = fixture("llama_tied_bf16"), ck = tmp.path + "/ck";
  auto eval_args = [&](const std::string& metrics) {
    auto args = four_steps_from(dir, metrics,
                                {"--data", text, "--eval-batches", "3", "--batch-size", "4", "--checkpoint-dir", ck});
    args.push_back("--eval-only");  // a flag (apply() takes name-value pairs)
    return args;
  };
  const std::string m1 = tmp.path + "/one.jsonl", m2 = tmp.path + "/two.jsonl";
  const auto a = alone(eval_args(m1));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto b = ranks(2, eval_args(m2));
  ASSERT_TRUE(b.ok()) << b.output;
  EXPECT_NE(a.output.find("\nval "), std::string::npos) << a.output;
  EXPECT_FALSE(trained(a.output)) << a.output;
  EXPECT_FALSE(fs::exists(ck + "/step_000000")) << "--eval-only wrote a checkpoint";
  EXPECT_FALSE(fs::exists(ck) && !fs::is_empty(ck)) << "--eval-only wrote into --checkpoint-dir";

  auto val_of = [](const std::string& metrics) {
    for (const auto& j : read_metrics(metrics))
      if (j.contains("val_loss")) return j["val_loss"].get<double>();
    return -1.0;
  };
  const double v1 = val_of(m1), v2 = val_of(m2);
  ASSERT_GT(v1, 0) << "no val_loss in " << m1;
  EXPECT_NEAR(v2, v1, 1e-6 * v1);

  // The same figure here: windows k = bytes [kT, kT + T] of the validation part, in order.
  std::ifstream in(text, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const int64_t n = static_cast<int64_t>(bytes.size()), start = n * 9 / 10, T = 16, B = 4;
  Llama model = load_folder(dir);
  double sum = 0;
  for (int64_t batch = 0; batch < 3; ++batch) {
    at::Tensor x = at::empty({B, T + 1}, at::kLong);
    for (int64_t r = 0; r < B; ++r)
      for (int64_t t = 0; t <= T; ++t)
        x[r][t] = static_cast<int64_t>(static_cast<uint8_t>(bytes[start + (batch * B + r) * T + t]));
    sum += loss_of(model, x);
  }
  EXPECT_NEAR(v1, sum / 3, 1e-5 * v1);
}

// Each bad input: one line naming the problem and the fix, exit status 2, nothing trained.
TEST(TrainGptLlama, BadInputsAreOneLineExitTwo) {
  TempDir tmp;
  const std::string dir = fixture("llama_tied_bf16"), m = tmp.path + "/m.jsonl";
  struct Case {
    std::vector<std::string> args;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {four_steps_from(dir, m, {"--layers", "3"}),
       "--init-from takes the model's size from " + dir + "/config.json: drop --layers"},
      {four_steps_from(dir, m, {"--seq-len", "65"}),
       "--seq-len 65 exceeds " + dir + "/config.json's max_position_embeddings 64"},
      {four_steps_from(tmp.path + "/absent", m), "--init-from " + tmp.path + "/absent: no such folder"},
      {four_steps_from(dir, m, {"--model", "gpt"}), "drop --model gpt"},
      {tiny(m, {"--export-hf", tmp.path + "/out"}), "the GPT has no Hugging Face architecture"},
      {tiny(m, {"--model", "llama", "--kv-heads", "3"}), "--kv-heads 3 does not divide --heads 2"},
      {tiny(m, {"--kv-heads", "1"}), "--kv-heads sizes --model llama or moe only: add --model llama or --model moe"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.needle);
    expect_one_line_error(alone(c.args), "train_gpt", c.needle);
  }
  EXPECT_FALSE(fs::exists(tmp.path + "/out"));

  // fsdp-ckpt export-hf of a GPT checkpoint: no Hugging Face architecture, one line, exit 2.
  const std::string ck = tmp.path + "/gpt";
  const auto g = alone(tiny(m, {"--steps", "1", "--checkpoint-dir", ck}));
  ASSERT_TRUE(g.ok()) << g.output;
  const auto e = run_process(spec_of({kFsdpCkpt, "export-hf", ck + "/step_000001", tmp.path + "/hf"}, 60s));
  expect_one_line_error(e, "fsdp-ckpt", "no Hugging Face architecture");
  EXPECT_FALSE(fs::exists(tmp.path + "/hf"));
}

// --tp-size for --model llama (torchtitan's plan: q/k/v/gate/up column-wise, o/down row-wise,
// embeddings row-wise, lm_head column-wise with loss_parallel, RMSNorms under sequence
// parallelism, KV heads divided over tp): tp 2 at 2 ranks (dp 1) and dp 2 x tp 2 at 4 ranks give
// one process's losses within 1e-5, from scratch and from a folder with biases.
TEST(TrainGptLlama, TensorParallelEqualsOneProcess) {
  TempDir tmp;
  const std::vector<std::string> llama = {"--model", "llama", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "48"};
  const std::string m1 = tmp.path + "/one.jsonl", m2 = tmp.path + "/tp2.jsonl", m4 = tmp.path + "/dp2tp2.jsonl";
  const auto a = alone(tiny(m1, llama));
  ASSERT_TRUE(a.ok()) << a.output;
  auto tp = llama;
  tp.insert(tp.end(), {"--tp-size", "2"});
  const auto b = ranks(2, tiny(m2, tp));
  ASSERT_TRUE(b.ok()) << b.output;
  const auto c = ranks(4, tiny(m4, tp), 240s);
  ASSERT_TRUE(c.ok()) << c.output;
  expect_close(losses(m2), losses(m1), 1e-5);
  expect_close(losses(m4), losses(m1), 1e-5);

  const std::string dir = fixture("llama_untied_sharded"), f1 = tmp.path + "/f1.jsonl", f2 = tmp.path + "/f2.jsonl";
  const auto d = alone(four_steps_from(dir, f1));
  ASSERT_TRUE(d.ok()) << d.output;
  const auto e = ranks(2, four_steps_from(dir, f2, {"--tp-size", "2"}));
  ASSERT_TRUE(e.ok()) << e.output;
  expect_close(losses(f2), losses(f1), 1e-5);

  // What tensor parallelism cannot split: one line before any work.
  const auto bad = ranks(2, tiny(m2, {"--model", "llama", "--tp-size", "2", "--seq-len", "15"}));
  EXPECT_FALSE(bad.ok()) << bad.output;
  EXPECT_NE(bad.output.find("--tp-size 2 does not divide --seq-len 15"), std::string::npos) << bad.output;
  const auto tied = ranks(2, four_steps_from(fixture("llama_tied_bf16"), m2, {"--tp-size", "2"}));
  EXPECT_FALSE(tied.ok()) << tied.output;
  EXPECT_NE(tied.output.find("does not support tied embeddings"), std::string::npos) << tied.output;
}
