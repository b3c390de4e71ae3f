#pragma once
// Token streams for train_gpt. The global batch of step s is a pure function of (seed, s): the
// same sequences whatever the world size, parallel mode or restart; rank r trains on its
// contiguous slice of it (and micro-batch m on a contiguous slice of that).
#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/data/token_shards.h"
#include "options.h"

namespace train_gpt {

// Token shards (--data tokens:PATTERN, data/include/fsdp/data/token_shards.h), opened and checked
// once before any work by resolve_vocab(), then read by TokenSource.
struct TokenData;

class TokenSource {
 public:
  // `path`: a file read as bytes, the first 90% for training, the rest for validation; or
  // "synthetic": a learnable byte language drawn from the seed (x[t] follows from x[t-1], x[t-2]);
  // or "tokens:PATTERN": llm.c token shards (Options::val_data, or the `_val_` shards, validate).
  // Throws std::invalid_argument (one line) when the file is unreadable or too short for seq_len.
  TokenSource(const Options& o);
  TokenSource(const std::string& path, int64_t seq_len, uint64_t seed);

  // [batch, seq_len + 1] int64: inputs are [:, :-1], targets [:, 1:].
  at::Tensor train_batch(int64_t step, int64_t batch) const;
  // Validation batch `index`: consecutive windows from the start of the validation data (window
  // k is tokens [kT, kT + T], batch i holds windows [iB, iB + B) in row order, wrapping at the
  // end), so a validation figure is the loss on a stated span of tokens. Synthetic data: rows
  // drawn from (seed, index).
  at::Tensor val_batch(int64_t index, int64_t batch) const;
  // A short prompt from the validation text (synthetic: two seed tokens) for the final sample.
  at::Tensor prompt(int64_t max_len) const;
  // Text for ids: bytes as printable characters ('?' for the rest); token shards through
  // --tokenizer, else as bytes when the vocabulary is that of byte-level shards (257), else "<id N>".
  std::string decode(const std::vector<int64_t>& ids) const;
  std::string describe() const;  // "cookie: 245093 bytes (220583 train, 24510 validation)"
  bool tokens() const { return tokens_ != nullptr; }
  // Token shards: where the global batch of `step` starts (epoch, index in its permutation).
  fsdp::data::Position position(int64_t step) const;

 private:
  at::Tensor draw(const at::Tensor& tokens, uint64_t stream, int64_t index, int64_t batch) const;
  std::string path_;
  bool synthetic_ = false;
  int64_t seq_len_;
  uint64_t seed_;
  at::Tensor train_, val_;  // uint8 bytes (files only)
  std::shared_ptr<const TokenData> tokens_;
};

// The model's vocabulary for these options, checking token data before any work: --vocab-size,
// else 256 for bytes and synthetic data, else the shards' recorded vocabulary (fsdp-tokenize
// writes it), else their largest id + 1. For token shards it opens and checks every shard (header,
// size, ids below the vocabulary, at least one batch of training and of validation windows) and
// keeps them for TokenSource. Throws std::invalid_argument (one line).
int64_t resolve_vocab(const Options& o);

// --data files are read whole into memory: at most this many bytes.
inline constexpr int64_t kMaxDataBytes = int64_t{8} << 30;

// Checks a --data path without opening it (stat only: opening a FIFO would block): it must be a
// readable regular file of at most kMaxDataBytes. Throws std::invalid_argument with one line
// naming the path ("cannot read data file '/dev/zero': it is a character device, ...").
// Returns the file's size.
int64_t check_data_file(const std::string& path);

// Reads a --data file whole into a uint8 tensor: opened non-blocking, checked again on the open
// descriptor (a regular file, at most kMaxDataBytes), then exactly its size is read.
at::Tensor read_data_file(const std::string& path);

// Slice of a [B, ...] global batch for rank `rank` of `world`, micro-batch `micro` of `n_micro`.
at::Tensor local_slice(const at::Tensor& global, int rank, int world, int64_t micro, int64_t n_micro);

}  // namespace train_gpt
