#pragma once
// Tokenizers for preparing and reading token data: bytes (the default: ids 0-255 are the bytes,
// 256 separates documents), or a SentencePiece model (`tokenizer.model`: Llama 2, Mistral,
// TinyLlama, ...) through Debian's libsentencepiece.
//
// Example:
//   auto tok = fsdp::data::Tokenizer::load("tokenizer.model");   // or Tokenizer::bytes()
//   std::vector<uint32_t> ids;
//   tok->encode_document("Hello world", ids);   // BOS, the text's ids, EOS (those the tokenizer has)
//   std::string text = tok->decode({ids.begin(), ids.end()});
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::data {

// Byte-level data: documents are preceded by this id (as llm.c's GPT-2 data precedes each with
// <|endoftext|>), so the vocabulary is 257.
inline constexpr uint32_t kByteSeparator = 256;

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  static std::unique_ptr<Tokenizer> bytes();
  // A SentencePiece model file; throws DataError (one line) when it cannot be loaded.
  static std::unique_ptr<Tokenizer> load(const std::string& path);

  virtual int64_t vocab_size() const = 0;
  virtual int64_t bos_id() const = 0;  // -1: none
  virtual int64_t eos_id() const = 0;  // -1: none
  // Appends the text's ids (no BOS/EOS). Safe to call from several threads at once.
  virtual void encode(std::string_view text, std::vector<uint32_t>& out) const = 0;
  // Appends BOS (if any), the text's ids, EOS (if any): one document of a corpus.
  void encode_document(std::string_view text, std::vector<uint32_t>& out) const;
  // Text for ids (ids outside the vocabulary are shown as "<id N>").
  virtual std::string decode(const std::vector<int64_t>& ids) const = 0;
  // "bytes (vocabulary 257, documents preceded by 256)", "SentencePiece tokenizer.model (...)".
  virtual std::string describe() const = 0;
};

}  // namespace fsdp::data
