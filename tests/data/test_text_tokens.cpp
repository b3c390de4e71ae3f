// --data text:FILE's encoding (fsdp/data/text_tokens.h): the tokens of a text or JSON-lines file
// equal those of fsdp-tokenize's shards for the same file, byte-level and SentencePiece (which it
// encodes through fsdp-tokenize in a child process); the in-memory shard reads like a file shard;
// each bad input is a one-line DataError and leaves nothing in the temporary folder.
#include <gtest/gtest.h>
#include <sentencepiece_trainer.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "fsdp/data/text_tokens.h"
#include "fsdp/data/token_shards.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;
using namespace fsdp::data;

const std::string kTool = FSDP_TOKENIZE_PATH;

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// The tokens fsdp-tokenize writes for `file` (with `args`), read back from its shards.
std::vector<uint32_t> tokenize_tool_tokens(const fsdp::testing::TempDir& dir, const std::string& file,
                                           const std::string& args, const std::string& out) {
  const std::string cmd = "timeout 60 " + kTool + " " + args + " --shard-tokens 50 --out " + quote(dir / out) + " " +
                          quote(file) + " > /dev/null";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  TokenShards shards(expand_glob(dir / (out + "_*.bin")));
  std::vector<int64_t> wide(static_cast<size_t>(shards.size()));
  shards.read(0, shards.size(), wide.data());
  return {wide.begin(), wide.end()};
}

void write_corpus(const fsdp::testing::TempDir& dir) {
  std::ofstream(dir / "a.txt")
      << "\nThe first paragraph.\nIts second line.\n\n\nSecond: caf\xC3\xA9 \xE2\x82\xAC 42\n\n"
         "  indented third\n\tand a tab\n";
  std::ofstream(dir / "b.jsonl") << "{\"text\": \"a JSON document\"}\n\n{\"id\": 2, \"text\": \"\\u00fcber alles\"}\n";
}

TEST(TextTokens, BytesEqualFsdpTokenizeShards) {
  fsdp::testing::TempDir dir("text_tokens_test");
  write_corpus(dir);
  for (const std::string file : {"a.txt", "b.jsonl"}) {
    const auto text = encode_text(dir / file, {});
    EXPECT_EQ(text.vocab, 257);
    EXPECT_EQ(text.tokens, tokenize_tool_tokens(dir, dir / file, "", "bytes_" + file)) << file;
  }
  const auto a = encode_text(dir / "a.txt", {});
  EXPECT_EQ(std::count(a.tokens.begin(), a.tokens.end(), 256u), 3);  // three documents
}

TEST(TextTokens, SentencePieceThroughFsdpTokenizeEqualsItsShards) {
  fsdp::testing::TempDir dir("text_tokens_test");
  write_corpus(dir);
  {
    std::ofstream train(dir / "train.txt");
    for (int i = 0; i < 100; ++i) train << "The quick brown fox " << i << " jumps over the lazy dog.\n";
  }
  const auto trained = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "train.txt") + " --model_prefix=" + (dir / "m") +
      " --vocab_size=300 --model_type=bpe --byte_fallback=true --minloglevel=2");
  ASSERT_TRUE(trained.ok()) << trained.ToString();
  TextEncoding enc;
  enc.tokenizer = dir / "m.model";
  enc.tool = kTool;
  enc.threads = 2;
  for (const std::string file : {"a.txt", "b.jsonl"}) {
    const auto text = encode_text(dir / file, enc);
    EXPECT_EQ(text.vocab, 300);
    EXPECT_EQ(text.tokens.front(), 1u);  // <s> opens each document
    EXPECT_EQ(text.tokens,
              tokenize_tool_tokens(dir, dir / file, "--tokenizer " + quote(dir / "m.model"), "spm_" + file))
        << file;
  }
  // $FSDP_TOKENIZE names the tool when TextEncoding::tool is empty.
  ::setenv("FSDP_TOKENIZE", kTool.c_str(), 1);
  EXPECT_EQ(tokenize_tool(), kTool);
  enc.tool.clear();
  EXPECT_EQ(encode_text(dir / "a.txt", enc).tokens,
            encode_text(dir / "a.txt", TextEncoding{enc.tokenizer, "text", kTool, 1}).tokens);
  ::unsetenv("FSDP_TOKENIZE");
}

// The in-memory shard reads as the same tokens in a file shard would: windows, the maximum, the
// recorded vocabulary, the one-line message for an id out of the vocabulary.
TEST(TextTokens, InMemoryShardReadsLikeAFileShard) {
  fsdp::testing::TempDir dir("text_tokens_test");
  write_corpus(dir);
  const auto text = encode_text(dir / "a.txt", {});
  const auto n = static_cast<int64_t>(text.tokens.size());
  const auto mem = text.shards(0, n);
  tokenize_tool_tokens(dir, dir / "a.txt", "", "file");
  TokenShards file(expand_glob(dir / "file_*.bin"));
  ASSERT_EQ(mem->size(), file.size());
  EXPECT_EQ(mem->header_vocab(), 257);
  EXPECT_EQ(mem->max_token(), file.max_token());
  EXPECT_EQ(mem->describe(), std::to_string(n) + " tokens in memory");
  const WindowSampler order(n, 8, 3, 7);
  std::vector<int64_t> a(3 * 9), b(3 * 9);
  for (int64_t step = 0; step < 5; ++step) {
    mem->read_windows(order.batch_windows(step), 8, a.data());
    file.read_windows(order.batch_windows(step), 8, b.data());
    EXPECT_EQ(a, b) << "step " << step;
  }
  const auto part = text.shards(10, 30);
  std::vector<int64_t> got(20);
  part->read(0, 20, got.data());
  EXPECT_EQ(std::vector<uint32_t>(got.begin(), got.end()),
            std::vector<uint32_t>(text.tokens.begin() + 10, text.tokens.begin() + 30));
  EXPECT_ERROR_CONTAINS(mem->check_vocab(200), "token shard 'text:" + (dir / "a.txt") + "' holds token id 256");
}

TEST(TextTokens, BadInputIsOneLineAndLeavesNothing) {
  fsdp::testing::TempDir dir("text_tokens_test");
  fsdp::testing::TempDir tmp("text_tokens_tmp");
  ::setenv("TMPDIR", tmp.path.c_str(), 1);
  write_corpus(dir);
  std::ofstream(dir / "empty.txt") << "\n\n\n";
  std::ofstream(dir / "nofield.jsonl") << "{\"text\": \"fine\"}\n{\"body\": \"x\"}\n";
  std::ofstream(dir / "bad.jsonl") << "{\"text\": unquoted}\n";
  std::ofstream(dir / "tokenizer.json") << "{}";
  fs::create_directory(dir / "folder");
  auto with = [&](const std::string& tokenizer, const std::string& tool = kTool) {
    return TextEncoding{tokenizer, "text", tool, 1};
  };
  const std::vector<std::tuple<std::string, TextEncoding, std::string>> cases = {
      {dir / "missing.txt", {}, "cannot read text file '" + (dir / "missing.txt") + "': No such file"},
      {dir / "folder", {}, "is not a regular file (give a readable text or JSON-lines file)"},
      {dir / "empty.txt", {}, "holds no documents"},
      {dir / "nofield.jsonl", {}, "nofield.jsonl:2: no string field \"text\" (give --field NAME)"},
      {dir / "bad.jsonl", {}, "bad.jsonl:1: not JSON"},
      {dir / "a.txt", with(dir / "tokenizer.json"), "is a Hugging Face tokenizer.json, which encodes in Python"},
      {dir / "a.txt", with(dir / "a.txt"), "is not a SentencePiece model"},
      {dir / "a.txt", with(dir / "none.model"), "cannot read tokenizer"},
  };
  for (const auto& [file, enc, message] : cases) {
    try {
      encode_text(file, enc);
      ADD_FAILURE() << "no error for " << file << "; expected " << message;
    } catch (const DataError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(message), std::string::npos) << what << "\nexpected: " << message;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
  // fsdp-tokenize missing, and fsdp-tokenize failing (its message relayed, its temporary shards gone).
  const auto trained = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "a.txt") + " --model_prefix=" + (dir / "m") +
      " --vocab_size=30 --model_type=char --hard_vocab_limit=false --minloglevel=2");
  ASSERT_TRUE(trained.ok()) << trained.ToString();
  EXPECT_ERROR_CONTAINS(encode_text(dir / "a.txt", with(dir / "m.model", dir / "no-such-tool")),
                        "needs fsdp-tokenize, and " + (dir / "no-such-tool") + " is not executable");
  EXPECT_ERROR_CONTAINS(encode_text(dir / "nofield.jsonl", with(dir / "m.model")),
                        "nofield.jsonl:2: no string field \"text\"");
  EXPECT_ERROR_CONTAINS(encode_text(dir / "empty.txt", with(dir / "m.model")),
                        "encoding '" + (dir / "empty.txt") + "' with fsdp-tokenize: no documents in the input");
  EXPECT_TRUE(fs::is_empty(tmp.path)) << "the child's temporary folder was left in " << tmp.path;
  ::unsetenv("TMPDIR");
}

}  // namespace
