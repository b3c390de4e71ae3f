#pragma once
// Ids back to text for a SentencePiece `tokenizer.model`, without libsentencepiece: the model
// file's pieces read with a minimal protobuf reader. Why not the library: Debian's
// libsentencepiece carries its own copy of protobuf-lite, and in a process that also loads
// LibTorch (which links libprotobuf.so) the two copies' symbols collide and the process crashes
// while loading. train_gpt links LibTorch, so it decodes its samples with this; fsdp-tokenize
// (no LibTorch) encodes with the library (tokenizer.h).
//
// Example:
//   auto dec = fsdp::data::PieceDecoder::load("tokenizer.model");
//   std::string text = dec.decode({1, 450, 4996, 17354});   // "The quick brown" (Llama 2's model)
#include <cstdint>
#include <string>
#include <vector>

namespace fsdp::data {

class PieceDecoder {
 public:
  // Throws DataError (one line) when the file is unreadable or holds no pieces.
  static PieceDecoder load(const std::string& path);
  int64_t vocab_size() const { return static_cast<int64_t>(pieces_.size()); }
  // As SentencePiece decodes: "▁" is a space (the leading one dropped), <0xNN> pieces are raw
  // bytes, control pieces (<s>, </s>) are nothing, <unk> is " ⁇ "; ids outside the vocabulary
  // are shown as "<id N>".
  std::string decode(const std::vector<int64_t>& ids) const;

 private:
  enum class Kind { kNormal, kUnknown, kControl, kByte };
  struct Piece {
    std::string text;
    Kind kind = Kind::kNormal;
    unsigned char byte = 0;
  };
  std::vector<Piece> pieces_;
};

}  // namespace fsdp::data
