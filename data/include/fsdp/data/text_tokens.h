#pragma once
// A text or JSON-lines file encoded on the fly into tokens held in memory, exactly as
// fsdp-tokenize would write them into shards (the same documents, the same BOS/EOS): what
// train_gpt --data text:FILE trains on. For small corpora: the tokens are all in memory.
//
// Bytes are encoded in this process. A SentencePiece tokenizer.model is encoded by fsdp-tokenize
// itself in a child process (the executable installed beside the caller's): libsentencepiece
// cannot be loaded into a process that loads LibTorch (piece_decoder.h), and the child's output
// is fsdp-tokenize's byte for byte. Its shards go to a temporary folder that is read back and
// removed; nothing stays on disk, also when it fails.
//
// Example:
//   fsdp::data::TextEncoding enc;
//   enc.tokenizer = "tokenizer.model";                               // "": bytes
//   auto text = fsdp::data::encode_text("corpus.txt", enc);
//   auto train = text.shards(0, text.tokens.size() * 9 / 10);        // TokenShards, in memory
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/data/token_shards.h"

namespace fsdp::data {

struct TextEncoding {
  std::string tokenizer;       // "": bytes (id 256 before each document); else a SentencePiece tokenizer.model
  std::string field = "text";  // the JSON field of .jsonl/.json/.ndjson files
  std::string tool;            // fsdp-tokenize ("": beside this executable, tokenize_tool())
  int threads = 1;             // fsdp-tokenize's --threads (the tokens do not depend on it)
};

struct TextTokens {
  std::string path;
  std::vector<uint32_t> tokens;
  int64_t vocab = 0;  // the tokenizer's vocabulary (257 for bytes)
  // Tokens [begin, end) as one in-memory shard named "text:PATH" (read like token shards).
  std::unique_ptr<TokenShards> shards(int64_t begin, int64_t end) const;
};

// Encodes `path`. Throws DataError (one line) on bad input: the file unreadable or not a regular
// file, no documents in it, a JSON line without the field, a tokenizer that is no SentencePiece
// model (a Hugging Face tokenizer.json is refused: scripts/prepare-hf-tokenizer.py encodes with
// it), fsdp-tokenize missing.
TextTokens encode_text(const std::string& path, const TextEncoding& enc);

// fsdp-tokenize beside the running executable (/proc/self/exe's folder), or $FSDP_TOKENIZE when set.
std::string tokenize_tool();

}  // namespace fsdp::data
