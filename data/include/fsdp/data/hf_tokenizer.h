#pragma once
// Ids back to text for a Hugging Face `tokenizer.json` (its BPE vocabulary and decoder read with
// nlohmann-json; no Python, no Rust library), for train_gpt's samples. Encoding with these
// tokenizers is done in Python by scripts/prepare-hf-tokenizer.py (the `tokenizers` package).
//
// Two decoders are understood, which cover the BPE tokenizers in use:
//   byte-level (GPT-2, Llama 3, Qwen2: decoder "ByteLevel"): each character of a token stands for
//     one byte through GPT-2's byte-to-unicode table ("Ġ" is a space);
//   SentencePiece-style (Llama 2, Mistral, TinyLlama: "Metaspace", or a "Sequence" of Replace
//     "▁" -> " ", ByteFallback, Fuse, Strip): "▁" is a space, <0xNN> tokens are raw bytes, the
//     leading space is dropped.
// Added tokens (<|endoftext|>, <s>, <|begin_of_text|>, ...) decode to their text, as
// tokenizers' decode(ids, skip_special_tokens=False) gives them.
//
// Example:
//   auto dec = fsdp::data::HfTokenizerDecoder::load("gpt2/tokenizer.json");
//   std::string text = dec.decode({15496, 995});   // "Hello world"
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/data/piece_decoder.h"

namespace fsdp::data {

class HfTokenizerDecoder {
 public:
  // Throws DataError (one line) when the file is unreadable, not JSON, not a BPE model, or its
  // decoder is neither of the two above.
  static HfTokenizerDecoder load(const std::string& path);
  int64_t vocab_size() const { return static_cast<int64_t>(tokens_.size()); }  // the largest id + 1
  bool byte_level() const { return byte_level_; }
  // Ids outside the vocabulary (or holes in it) are shown as "<id N>".
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  struct Token {
    std::string text;
    bool known = false;
    bool added = false;  // added_tokens: decoded as their text
  };
  std::vector<Token> tokens_;
  bool byte_level_ = false;
  bool byte_fallback_ = false;
};

// The decoder --tokenizer names: a Hugging Face tokenizer.json (by its .json extension) or a
// SentencePiece tokenizer.model.
class SampleDecoder {
 public:
  static SampleDecoder load(const std::string& path);
  std::string decode(const std::vector<int64_t>& ids) const;
  int64_t vocab_size() const;
  std::string kind() const;  // "Hugging Face tokenizer.json (byte-level BPE)", "SentencePiece tokenizer.model"

 private:
  std::shared_ptr<const PieceDecoder> piece_;
  std::shared_ptr<const HfTokenizerDecoder> hf_;
};

}  // namespace fsdp::data
