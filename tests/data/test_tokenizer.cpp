// fsdp_data's tokenizers: bytes, and SentencePiece (a model trained here with libsentencepiece's
// trainer on a small corpus: nothing downloaded).
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <fstream>

#include "fsdp/data/piece_decoder.h"
#include "fsdp/data/token_shards.h"
#include "fsdp/data/tokenizer.h"
#include "test_helpers.h"

namespace {

using namespace fsdp::data;

TEST(Tokenizer, BytesPrecedeEachDocumentWith256) {
  auto tok = Tokenizer::bytes();
  EXPECT_EQ(tok->vocab_size(), 257);
  std::vector<uint32_t> ids;
  tok->encode_document("hi\n", ids);
  tok->encode_document("\xC3\xA9", ids);  // UTF-8 bytes stay bytes
  EXPECT_EQ(ids, (std::vector<uint32_t>{256, 'h', 'i', '\n', 256, 0xC3, 0xA9}));
  EXPECT_EQ(tok->decode({'o', 'k', 256, 300}), "ok<|endoftext|><id 300>");
}

TEST(Tokenizer, SentencePieceModelEncodesAndDecodes) {
  fsdp::testing::TempDir dir("tokenizer_test");
  {
    std::ofstream corpus(dir / "corpus.txt");
    for (int i = 0; i < 200; ++i) corpus << "the quick brown fox " << i << " jumps over the lazy dog\n";
  }
  const auto status =
      sentencepiece::SentencePieceTrainer::Train("--input=" + (dir / "corpus.txt") + " --model_prefix=" + (dir / "m") +
                                                 " --vocab_size=60 --model_type=bpe --minloglevel=2");
  ASSERT_TRUE(status.ok()) << status.ToString();
  auto tok = Tokenizer::load(dir / "m.model");
  EXPECT_EQ(tok->vocab_size(), 60);
  EXPECT_EQ(tok->bos_id(), 1);  // SentencePiece's defaults: <unk> 0, <s> 1, </s> 2
  EXPECT_EQ(tok->eos_id(), 2);
  std::vector<uint32_t> ids;
  tok->encode_document("the lazy fox", ids);
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 1u);
  EXPECT_EQ(ids.back(), 2u);
  // The same ids as the library used directly.
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(dir / "m.model").ok());
  std::vector<int> direct;
  ASSERT_TRUE(sp.Encode("the lazy fox", &direct).ok());
  EXPECT_EQ(std::vector<uint32_t>(ids.begin() + 1, ids.end() - 1), std::vector<uint32_t>(direct.begin(), direct.end()));
  EXPECT_EQ(tok->decode(std::vector<int64_t>(ids.begin() + 1, ids.end() - 1)), "the lazy fox");
  EXPECT_ERROR_CONTAINS(Tokenizer::load(dir / "corpus.txt"), "cannot load SentencePiece model");
}

// The decoder train_gpt uses (no libsentencepiece) against the library's own decoding, on a model
// with byte fallback (characters outside the pieces become <0xNN> byte pieces).
TEST(PieceDecoder, DecodesAsSentencePieceDoes) {
  fsdp::testing::TempDir dir("tokenizer_test");
  {
    std::ofstream corpus(dir / "corpus.txt");
    for (int i = 0; i < 200; ++i) corpus << "the quick brown fox " << i << " jumps over the lazy dog\n";
  }
  const auto status = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "corpus.txt") + " --model_prefix=" + (dir / "m") +
      " --vocab_size=320 --model_type=bpe --byte_fallback=true --minloglevel=2");
  ASSERT_TRUE(status.ok()) << status.ToString();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(dir / "m.model").ok());
  const auto dec = PieceDecoder::load(dir / "m.model");
  EXPECT_EQ(dec.vocab_size(), 320);
  for (const std::string text : {"the lazy fox", "  quick 123   dog ", "zebra \xC3\xA9t\xC3\xA9 \xE2\x82\xAC", "x"}) {
    std::vector<int> ids;
    ASSERT_TRUE(sp.Encode(text, &ids).ok());
    ids.insert(ids.begin(), sp.bos_id());
    ids.push_back(sp.eos_id());
    std::string want;
    ASSERT_TRUE(sp.Decode(ids, &want).ok());
    EXPECT_EQ(dec.decode(std::vector<int64_t>(ids.begin(), ids.end())), want) << text;
  }
  EXPECT_EQ(dec.decode({5000}), "<id 5000>");
  EXPECT_ERROR_CONTAINS(PieceDecoder::load(dir / "corpus.txt"), "is not a SentencePiece model");
  EXPECT_ERROR_CONTAINS(PieceDecoder::load(dir / "missing.model"), "cannot read tokenizer");
}

}  // namespace
