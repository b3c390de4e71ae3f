// fsdp_data's Hugging Face tokenizer.json decoder, on small tokenizer.json files written here
// (nothing downloaded): byte-level BPE as GPT-2 and Llama 3 write it (GPT-2's byte-to-unicode
// table, added tokens), SentencePiece-style BPE as Llama 2's (▁, <0xNN> byte fallback, the
// leading space stripped), and every bad file as a one-line DataError.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "fsdp/data/hf_tokenizer.h"
#include "fsdp/data/token_shards.h"
#include "test_helpers.h"

namespace {

using namespace fsdp::data;
using nlohmann::json;

// GPT-2's bytes_to_unicode, written out independently of the decoder: byte -> UTF-8 of its character.
std::string byte_char(int b) {
  static const std::vector<int> table = [] {
    std::vector<int> bs, cs;
    for (int i = '!'; i <= '~'; ++i) bs.push_back(i);
    for (int i = 0xA1; i <= 0xAC; ++i) bs.push_back(i);
    for (int i = 0xAE; i <= 0xFF; ++i) bs.push_back(i);
    cs = bs;
    int n = 0;
    for (int i = 0; i < 256; ++i) {
      if (std::find(bs.begin(), bs.end(), i) == bs.end()) {
        bs.push_back(i);
        cs.push_back(256 + n++);
      }
    }
    std::vector<int> t(256);
    for (size_t i = 0; i < bs.size(); ++i) t[static_cast<size_t>(bs[i])] = cs[i];
    return t;
  }();
  const int cp = table[static_cast<size_t>(b)];
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

std::string byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += byte_char(c);
  return out;
}

// A GPT-2-style tokenizer.json: the 256 byte tokens (ids 0-255, as GPT-2 orders them does not
// matter here), a few merged tokens, <|endoftext|> added.
json gpt2_style() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  int id = 256;
  for (const std::string t : {"He", "llo", "Hello", " world", " caf\xC3\xA9", "\n\n"}) vocab[byte_level(t)] = id++;
  return {{"version", "1.0"},
          {"added_tokens", json::array({{{"id", 262}, {"content", "<|endoftext|>"}, {"special", true}}})},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}}},
          {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array({"H e", "l lo"})}}}};
}

// A Llama-2-style tokenizer.json (transformers' conversion of a SentencePiece BPE model).
json llama2_style() {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    vocab[name] = 3 + b;
  }
  int id = 259;
  for (const std::string t : {"\xE2\x96\x81Hello", "\xE2\x96\x81world", "!", "\xE2\x96\x81"}) vocab[t] = id++;
  const json decoder = {
      {"type", "Sequence"},
      {"decoders", json::array({{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
                                {{"type", "ByteFallback"}},
                                {{"type", "Fuse"}},
                                {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}})}};
  return {{"added_tokens", json::array({{{"id", 0}, {"content", "<unk>"}, {"special", true}},
                                        {{"id", 1}, {"content", "<s>"}, {"special", true}},
                                        {{"id", 2}, {"content", "</s>"}, {"special", true}}})},
          {"decoder", decoder},
          {"model", {{"type", "BPE"}, {"byte_fallback", true}, {"vocab", vocab}, {"merges", json::array()}}}};
}

std::string write(const fsdp::testing::TempDir& dir, const std::string& name, const std::string& text) {
  std::ofstream(dir / name) << text;
  return dir / name;
}

TEST(HfTokenizer, ByteLevelDecodesThroughGpt2ByteTable) {
  fsdp::testing::TempDir dir("hf_tokenizer_test");
  const auto dec = HfTokenizerDecoder::load(write(dir, "tokenizer.json", gpt2_style().dump()));
  EXPECT_TRUE(dec.byte_level());
  EXPECT_EQ(dec.vocab_size(), 263);
  EXPECT_EQ(dec.decode({258, 259, 262, 'A', 261, 260, 0xC3, 0xA9, 10}),
            "Hello world<|endoftext|>A\n\n caf\xC3\xA9\xC3\xA9\n");  // bytes 0xC3 0xA9 are é
  EXPECT_EQ(dec.decode({' ', 0, 127, 255}), std::string(" \0\x7F\xFF", 4));
  EXPECT_EQ(dec.decode({263, -1}), "<id 263><id -1>");
  // Through SampleDecoder, as train_gpt loads --tokenizer.
  const auto sample = SampleDecoder::load(dir / "tokenizer.json");
  EXPECT_EQ(sample.decode({256, 257}), "Hello");
  EXPECT_EQ(sample.vocab_size(), 263);
  EXPECT_EQ(sample.kind(), "Hugging Face tokenizer.json (byte-level BPE)");
}

TEST(HfTokenizer, MetaspaceDecodesLikeLlama2) {
  fsdp::testing::TempDir dir("hf_tokenizer_test");
  const auto dec = HfTokenizerDecoder::load(write(dir, "tokenizer.json", llama2_style().dump()));
  EXPECT_FALSE(dec.byte_level());
  EXPECT_EQ(dec.vocab_size(), 263);
  // <s>, ▁Hello, ▁world, !, <0x0A>, ▁, <0xC3><0xA9>, </s>
  EXPECT_EQ(dec.decode({1, 259, 260, 261, 3 + 10, 262, 3 + 0xC3, 3 + 0xA9, 2}), "<s> Hello world!\n \xC3\xA9</s>");
  EXPECT_EQ(dec.decode({259, 260}), "Hello world");  // the leading space stripped, as Strip does
  // A Metaspace decoder (tokenizers' newer spelling) decodes the same.
  json metaspace = llama2_style();
  metaspace["decoder"] = {{"type", "Metaspace"}, {"replacement", "\xE2\x96\x81"}, {"prepend_scheme", "first"}};
  const auto dec2 = HfTokenizerDecoder::load(write(dir, "metaspace.json", metaspace.dump()));
  EXPECT_EQ(dec2.decode({259, 260, 261}), "Hello world!");
}

TEST(HfTokenizer, BadFilesAreOneLine) {
  fsdp::testing::TempDir dir("hf_tokenizer_test");
  json wordpiece = gpt2_style();
  wordpiece["model"]["type"] = "WordPiece";
  json nodecoder = gpt2_style();
  nodecoder.erase("decoder");
  json badid = gpt2_style();
  badid["model"]["vocab"]["x"] = "seven";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir / "missing.json", "cannot read tokenizer '" + (dir / "missing.json") + "'"},
      {write(dir, "notjson.json", "{\"model\": "), "is not JSON"},
      {write(dir, "novocab.json", "{\"model\": {\"type\": \"BPE\"}}"), "has no model.vocab object"},
      {write(dir, "wordpiece.json", wordpiece.dump()), "has a WordPiece model; only BPE tokenizers decode here"},
      {write(dir, "nodecoder.json", nodecoder.dump()), "has decoder none; train_gpt decodes ByteLevel"},
      {write(dir, "badid.json", badid.dump()), "model.vocab[\"x\"] is not an integer id"},
  };
  for (const auto& [path, message] : cases) {
    try {
      SampleDecoder::load(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const DataError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(message), std::string::npos) << what << "\nexpected: " << message;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  }
}

}  // namespace
