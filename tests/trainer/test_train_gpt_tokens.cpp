// train_gpt on llm.c token shards (--data tokens:PATTERN): the same losses for one process and
// FSDP on 2 ranks, a run stopped at step k and resumed at 3 ranks continues the same stream (the
// checkpoint holds the data position), every bad input is one line and exit 2 with nothing
// written, byte-level shards from fsdp-tokenize train and sample as text, and --data text:FILE
// trains exactly as fsdp-tokenize's shards of the same file.
#include <gtest/gtest.h>

#include <numeric>

#include "fsdp/checkpoint/inspect.h"
#include "shard_writer.h"
#include "train_gpt_harness.h"

namespace {

using namespace train_gpt_test;
using fsdp_data_test::write_shard;

// A learnable token language over `vocab` ids: x[t] follows from x[t-1] and x[t-2], with a jump
// every 37 tokens so that the windows differ.
std::vector<uint32_t> corpus(size_t n, uint32_t vocab, uint32_t salt) {
  std::vector<uint32_t> x(n);
  for (size_t t = 0; t < n; ++t) {
    x[t] = t < 2 || t % 37 == 0 ? static_cast<uint32_t>((t * 131 + salt) % vocab)
                                : (x[t - 1] * 7 + x[t - 2] * 3 + 1) % vocab;
  }
  return x;
}

// Training shards c_000000.bin, c_000001.bin (uint16, then uint32: both of llm.c's formats) and
// validation c_val_000000.bin, vocabulary 300 recorded in the headers.
std::string make_shards(const TempDir& dir, size_t train_tokens = 2000) {
  const auto train = corpus(train_tokens, 300, 1);
  const size_t half = train_tokens / 2;
  write_shard(dir / "c_000000.bin", {train.begin(), train.begin() + static_cast<std::ptrdiff_t>(half)}, false, 300);
  write_shard(dir / "c_000001.bin", {train.begin() + static_cast<std::ptrdiff_t>(half), train.end()}, true, 300);
  write_shard(dir / "c_val_000000.bin", corpus(400, 300, 2), false, 300);
  return "tokens:" + (dir / "c_*.bin");
}

TEST(TrainGptTokens, OneProcessAndFsdpTwoRanksGiveTheSameLosses) {
  TempDir dir;
  const std::string data = make_shards(dir);
  const std::vector<std::string> extra = {"--data", data, "--eval-every", "3", "--steps", "6"};
  auto a = alone(tiny(dir / "a.jsonl", extra));
  ASSERT_TRUE(a.ok()) << a.output;
  auto b = ranks(2, tiny(dir / "b.jsonl", extra));
  ASSERT_TRUE(b.ok()) << b.output;
  expect_close(losses(dir / "b.jsonl"), losses(dir / "a.jsonl"), 1e-5);
  ASSERT_EQ(losses(dir / "a.jsonl").size(), 6u);
  // The banner names the shards, the windows per epoch and where the vocabulary came from.
  EXPECT_NE(a.output.find("train 2 shards, 2000 tokens (uint16 and uint32): c_000000.bin, c_000001.bin; "
                          "validation 1 shard, 400 tokens (uint16): c_val_000000.bin; 124 windows of 17 tokens per "
                          "epoch (1984 tokens); vocabulary 300 (recorded in the shards)"),
            std::string::npos)
      << a.output;
  // The metrics file: tokens seen and the data position after each step (batch 8 of 124 windows).
  const auto lines = read_metrics(dir / "a.jsonl");
  ASSERT_GE(lines.size(), 6u);
  EXPECT_EQ(lines[5]["tokens_seen"].get<int64_t>(), 6 * 8 * 16);
  EXPECT_EQ(lines[5]["data_epoch"].get<int64_t>(), 0);
  EXPECT_EQ(lines[5]["data_index"].get<int64_t>(), 48);
  EXPECT_TRUE(lines[2].contains("val_loss"));
}

// Stopped at step 4 (rank 1 killed before step 5), resumed at 3 ranks: the losses of an
// uninterrupted one-process run, and the checkpoint holds the data position. 20 windows per epoch
// and 6 per batch: step 4 starts in epoch 1, so the resumed run crosses into a new permutation.
TEST(TrainGptTokens, StoppedAndResumedAtThreeRanksContinuesTheSameStream) {
  TempDir dir;
  const std::string data = make_shards(dir, 321);  // (321 - 1) / 16 = 20 windows
  const std::vector<std::string> extra = {"--data", data, "--batch-size", "6", "--steps", "8"};
  auto a = alone(tiny(dir / "a.jsonl", extra));
  ASSERT_TRUE(a.ok()) << a.output;
  auto with_ckpt = tiny(dir / "b.jsonl", extra);
  with_ckpt = apply(with_ckpt, {"--checkpoint-dir", dir / "ckpt", "--checkpoint-every", "4"});
  auto spec = spec_of(fsdprun_argv(2, with_ckpt), 120s);
  spec.env_set["FSDP_TEST_KILL_AT_STEP"] = "5";
  auto killed = run_process(spec);
  EXPECT_FALSE(killed.ok()) << killed.output;
  EXPECT_NE(killed.output.find("rank 1 kills itself"), std::string::npos) << killed.output;
  const std::string step4 = dir / "ckpt/step_000004";
  ASSERT_TRUE(fs::exists(fs::path(step4) / "index.json")) << killed.output;
  EXPECT_EQ(fsdp::checkpoint::read_full_tensor(step4, "extra.trainer.data_epoch").item<int64_t>(), 1);  // row 24
  EXPECT_EQ(fsdp::checkpoint::read_full_tensor(step4, "extra.trainer.data_index").item<int64_t>(), 4);
  auto resumed = ranks(3, apply(with_ckpt, {"--resume"}));
  ASSERT_TRUE(resumed.ok()) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed " + step4 + " at step 4"), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("note:"), std::string::npos) << resumed.output;
  expect_close(losses(dir / "b.jsonl"), losses(dir / "a.jsonl"), 1e-5);
  EXPECT_EQ(fsdp::checkpoint::read_full_tensor(dir / "ckpt/step_000008", "extra.trainer.data_index").item<int64_t>(),
            8);  // row 48 = 2 x 20 + 8
}

// Each bad input: one line naming it, exit 2, no checkpoint folder, no metrics file.
TEST(TrainGptTokens, BadInputIsOneLineExitTwoAndNothingWritten) {
  TempDir dir;
  const std::string good = make_shards(dir);
  write_shard(dir / "magic_val_0.bin", corpus(400, 300, 3), false, 0, 1234);
  write_shard(dir / "version_val_0.bin", corpus(400, 300, 3), true, 0, 20240801, 6);
  write_shard(dir / "count_val_0.bin", corpus(400, 300, 3), false, 0, 0, 0, 401);
  write_shard(dir / "small_000000.bin", corpus(100, 300, 3));
  write_shard(dir / "small_val_000000.bin", corpus(400, 300, 3));
  write_shard(dir / "noval_000000.bin", corpus(400, 300, 3));
  std::ofstream(dir / "notes.txt") << "hello world\n";
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--val-data", "tokens:" + (dir / "magic_val_0.bin")}, "has magic 1234, not llm.c's 20240520"},
      {{"--val-data", "tokens:" + (dir / "version_val_0.bin")},
       "has version 6 with Llama 3 magic 20240801, expected 7"},
      {{"--val-data", "tokens:" + (dir / "count_val_0.bin")}, "says 401 tokens (802 bytes) but holds 800 bytes"},
      {{"--vocab-size", "200"}, "at or above the model's vocabulary of 200 (give --vocab-size"},
      {{"--data", "tokens:" + (dir / "none_*.bin")}, "no file matches"},
      {{"--data", "tokens:" + (dir / "small_*.bin")}, "100 training tokens are fewer than one batch"},
      {{"--data", "tokens:" + (dir / "noval_*.bin")}, "has no validation shards (none is named *_val_*)"},
      {{"--val-data", dir / "c_val_000000.bin"}, "--val-data '" + (dir / "c_val_000000.bin") + "' must be tokens:"},
      {{"--tokenizer", dir / "notes.txt"}, "is not a SentencePiece model"},
  };
  for (const auto& [extra, message] : cases) {
    auto args = apply(tiny(dir / "m.jsonl", {"--data", good}), extra);
    args = apply(args, {"--checkpoint-dir", dir / "ckpt"});
    auto r = alone(args, 60s);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("train_gpt: error: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << message << "\n" << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
    EXPECT_FALSE(fs::exists(dir / "ckpt")) << message;
    EXPECT_FALSE(fs::exists(dir / "m.jsonl")) << message;
  }
}

// train.txt and val.txt of short sentences (the validation text starts "a lazy dog naps").
void write_texts(const TempDir& dir) {
  std::ofstream train(dir / "train.txt"), val(dir / "val.txt");
  for (int i = 0; i < 300; ++i) train << "the quick brown fox " << i % 17 << " jumps over the lazy dog\n\n";
  for (int i = 0; i < 40; ++i) val << "a lazy dog naps in the sun " << i << "\n\n";
}

// Runs the build's fsdp-tokenize with `args`; a failure fails the test.
void fsdp_tokenize(const std::vector<std::string>& args) {
  ProcessSpec spec = spec_of({}, 60s);
  spec.argv = {FSDP_TOKENIZE_PATH};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  const auto r = run_process(spec);
  EXPECT_TRUE(r.ok()) << r.output;
}

// Debian's spm_train by its path (execve takes a path), or "" when it is not installed.
std::string find_spm_train() {
  std::string found;
  for (const char* d : {"/usr/bin", "/usr/local/bin", "/bin"}) {
    if (fs::exists(std::string(d) + "/spm_train")) found = std::string(d) + "/spm_train";
  }
  return found;
}

// A 64-piece BPE model dir/m.model trained on dir/train.txt.
ProcessResult train_spm64(const std::string& spm_train, const TempDir& dir) {
  return run_process(spec_of({spm_train, "--input=" + (dir / "train.txt"), "--model_prefix=" + (dir / "m"),
                              "--vocab_size=64", "--model_type=bpe"},
                             60s));
}

// From text to a trained sample: fsdp-tokenize writes the shards (bytes, then a SentencePiece model
// that Debian's spm_train makes here), train_gpt reads them with the vocabulary they record and
// decodes its sample through --tokenizer: the prompt is the validation text's start.
TEST(TrainGptTokens, ShardsFromFsdpTokenizeTrainAndSampleAsText) {
  TempDir dir;
  write_texts(dir);
  fsdp_tokenize({"--out", dir / "b_train", dir / "train.txt"});
  fsdp_tokenize({"--out", dir / "b_val", dir / "val.txt"});
  auto bytes = alone(tiny(dir / "b.jsonl", {"--data", "tokens:" + (dir / "b_*.bin"), "--sample-tokens", "8"}));
  ASSERT_TRUE(bytes.ok()) << bytes.output;
  EXPECT_NE(bytes.output.find("vocabulary 257 (recorded in the shards)"), std::string::npos) << bytes.output;
  // The prompt: the separator (id 256) and the first 15 bytes of the validation text.
  EXPECT_NE(bytes.output.find("<|endoftext|>a lazy dog naps|"), std::string::npos) << bytes.output;

  const std::string spm_train = find_spm_train();
  if (spm_train.empty()) GTEST_SKIP() << "spm_train (Debian's sentencepiece) is not installed";
  const auto trained = train_spm64(spm_train, dir);
  ASSERT_TRUE(trained.ok()) << trained.output;
  fsdp_tokenize({"--tokenizer", dir / "m.model", "--out", dir / "s_train", dir / "train.txt"});
  fsdp_tokenize({"--tokenizer", dir / "m.model", "--out", dir / "s_val", dir / "val.txt"});
  auto spm = alone(tiny(dir / "s.jsonl", {"--data", "tokens:" + (dir / "s_*.bin"), "--tokenizer", dir / "m.model",
                                          "--sample-tokens", "8"}));
  ASSERT_TRUE(spm.ok()) << spm.output;
  EXPECT_NE(spm.output.find("vocabulary 64 (recorded in the shards); tokenizer " + (dir / "m.model")),
            std::string::npos)
      << spm.output;
  EXPECT_NE(spm.output.find("---- sample (prompt|generated) ----\na lazy dog naps in the"), std::string::npos)
      << spm.output;
}

// A byte-level tokenizer.json as GPT-2's is laid out (the 256 bytes through GPT-2's byte-to-unicode
// table as ids 0-255, <|endoftext|> added as 256): byte-level shards decode through it as bytes.
std::string byte_level_tokenizer_json() {
  std::vector<int> bs;
  for (int i = '!'; i <= '~'; ++i) bs.push_back(i);
  for (int i = 0xA1; i <= 0xAC; ++i) bs.push_back(i);
  for (int i = 0xAE; i <= 0xFF; ++i) bs.push_back(i);
  std::vector<int> code(256, -1);
  for (int b : bs) code[static_cast<size_t>(b)] = b;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (code[static_cast<size_t>(b)] < 0) code[static_cast<size_t>(b)] = 256 + n++;
  }
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    const int cp = code[static_cast<size_t>(b)];
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    vocab[s] = b;
  }
  return nlohmann::json{
      {"added_tokens", nlohmann::json::array({{{"id", 256}, {"content", "<|endoftext|>"}, {"special", true}}})},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}}
      .dump();
}

// --data text:FILE (encoded when train_gpt starts, in memory) trains exactly as the shards
// fsdp-tokenize writes for the same files: bytes, and a SentencePiece model (encoded through
// fsdp-tokenize in a child process), at 1 process and FSDP 2 ranks; without --val-data its last
// 10% validates. A Hugging Face tokenizer.json decodes byte-level shards' sample.
TEST(TrainGptTokens, TextFileTrainsAsItsFsdpTokenizeShards) {
  TempDir dir;
  write_texts(dir);
  fsdp_tokenize({"--out", dir / "b_train", dir / "train.txt"});
  fsdp_tokenize({"--out", dir / "b_val", dir / "val.txt"});
  const std::vector<std::string> steps = {"--steps", "4", "--eval-every", "2"};
  auto shards = alone(tiny(dir / "b.jsonl", apply(steps, {"--data", "tokens:" + (dir / "b_*.bin")})));
  ASSERT_TRUE(shards.ok()) << shards.output;
  const std::vector<std::string> text_args = {"--data", "text:" + (dir / "train.txt"), "--val-data",
                                              "text:" + (dir / "val.txt")};
  auto text = alone(tiny(dir / "t.jsonl", apply(steps, text_args)));
  ASSERT_TRUE(text.ok()) << text.output;
  EXPECT_NE(text.output.find("train 13920 tokens in memory: train.txt; validation 1190 tokens in memory: val.txt"),
            std::string::npos)
      << text.output;
  EXPECT_NE(text.output.find("vocabulary 257 (the tokenizer's)"), std::string::npos) << text.output;
  expect_close(losses(dir / "t.jsonl"), losses(dir / "b.jsonl"), 1e-6);
  auto text2 = ranks(2, tiny(dir / "t2.jsonl", apply(steps, text_args)));
  ASSERT_TRUE(text2.ok()) << text2.output;
  expect_close(losses(dir / "t2.jsonl"), losses(dir / "b.jsonl"), 1e-5);
  // Without --val-data: the first 90% of the tokens train, the rest validate.
  auto split = alone(tiny(dir / "s.jsonl", apply(steps, {"--data", "text:" + (dir / "train.txt")})));
  ASSERT_TRUE(split.ok()) << split.output;
  EXPECT_NE(split.output.find("train 12528 tokens in memory: train.txt; validation 1392 tokens in memory: train.txt"),
            std::string::npos)
      << split.output;
  // tokenizer.json decodes the sample of byte-level shards: the prompt is the validation text.
  std::ofstream(dir / "tokenizer.json") << byte_level_tokenizer_json();
  auto hf = alone(tiny(dir / "h.jsonl", {"--data", "tokens:" + (dir / "b_*.bin"), "--tokenizer", dir / "tokenizer.json",
                                         "--sample-tokens", "8"}));
  ASSERT_TRUE(hf.ok()) << hf.output;
  EXPECT_NE(hf.output.find("<|endoftext|>a lazy dog naps|"), std::string::npos) << hf.output;

  const std::string spm_train = find_spm_train();
  if (spm_train.empty()) GTEST_SKIP() << "spm_train (Debian's sentencepiece) is not installed";
  const auto trained = train_spm64(spm_train, dir);
  ASSERT_TRUE(trained.ok()) << trained.output;
  fsdp_tokenize({"--tokenizer", dir / "m.model", "--out", dir / "p_train", dir / "train.txt"});
  fsdp_tokenize({"--tokenizer", dir / "m.model", "--out", dir / "p_val", dir / "val.txt"});
  auto spm_shards = alone(tiny(dir / "p.jsonl", apply(steps, {"--data", "tokens:" + (dir / "p_*.bin")})));
  ASSERT_TRUE(spm_shards.ok()) << spm_shards.output;
  // fsdp-tokenize is found beside train_gpt (both in the build's bin folder).
  auto spm_text = ranks(2, tiny(dir / "q.jsonl", apply(apply(steps, text_args), {"--tokenizer", dir / "m.model"})));
  ASSERT_TRUE(spm_text.ok()) << spm_text.output;
  EXPECT_NE(spm_text.output.find("vocabulary 64 (the tokenizer's); tokenizer " + (dir / "m.model")), std::string::npos)
      << spm_text.output;
  expect_close(losses(dir / "q.jsonl"), losses(dir / "p.jsonl"), 1e-5);
}

// text:FILE and tokenizer.json bad input: one line naming it, exit 2, nothing written.
TEST(TrainGptTokens, TextAndTokenizerJsonBadInputIsOneLineExitTwo) {
  TempDir dir;
  const std::string good = make_shards(dir);
  std::ofstream(dir / "empty.txt") << "\n\n";
  std::ofstream(dir / "short.txt") << "just a few words\n";
  std::ofstream(dir / "notes.txt") << "hello world\n";
  std::ofstream(dir / "bad.json") << "{\"model\": ";
  std::ofstream(dir / "tokenizer.json") << byte_level_tokenizer_json();
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--data", "text:" + (dir / "missing.txt")}, "cannot read text file '" + (dir / "missing.txt") + "'"},
      {{"--data", "text:" + (dir / "empty.txt")}, "holds no documents"},
      {{"--data", "text:" + (dir / "short.txt")}, "training tokens are fewer than one batch"},
      {{"--data", "text:" + (dir / "notes.txt"), "--tokenizer", dir / "tokenizer.json"},
       "is a Hugging Face tokenizer.json, which encodes in Python"},
      {{"--data", "text:" + (dir / "notes.txt"), "--tokenizer", dir / "notes.txt"}, "is not a SentencePiece model"},
      {{"--val-data", "text:" + (dir / "missing.txt")}, "cannot read text file"},
      {{"--tokenizer", dir / "bad.json"}, "is not JSON"},
  };
  for (const auto& [extra, message] : cases) {
    auto args = apply(tiny(dir / "m.jsonl", {"--data", good}), extra);
    args = apply(args, {"--checkpoint-dir", dir / "ckpt"});
    auto r = alone(args, 60s);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("train_gpt: error: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << message << "\n" << r.output;
    EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
    EXPECT_FALSE(fs::exists(dir / "ckpt")) << message;
    EXPECT_FALSE(fs::exists(dir / "m.jsonl")) << message;
  }
}

}  // namespace
