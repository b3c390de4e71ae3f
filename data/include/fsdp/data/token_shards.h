#pragma once
// Token shards in llm.c's format, read where needed, and the order in which a trainer reads them.
//
// A shard is a 256 x int32 header (magic, version, token count, ...) followed by the tokens:
// uint16 in llm.c's GPT-2 data (magic 20240520, version 1), uint32 in its Llama 3 variant
// (magic 20240801, version 7), as dev/data/data_common.py in karpathy/llm.c writes them.
// Header slot 3 is this project's one addition: the tokenizer's vocabulary size (fsdp-tokenize
// writes it; 0, what llm.c writes, means "not recorded"; llm.c's readers ignore the slot).
//
// Example:
//   fsdp::data::TokenShards train(fsdp::data::expand_glob("data/tiny_train_*.bin"));
//   train.check_vocab(50257);                      // every id below the model's vocabulary
//   fsdp::data::WindowSampler order(train.size(), /*seq_len=*/1024, /*batch=*/32, /*seed=*/0);
//   std::vector<int64_t> rows(32 * 1025);
//   train.read_windows(order.batch_windows(step), 1024, rows.data());   // the global batch of `step`
#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp::data {

inline constexpr int32_t kGpt2Magic = 20240520, kGpt2Version = 1;      // uint16 tokens
inline constexpr int32_t kLlama3Magic = 20240801, kLlama3Version = 7;  // uint32 tokens
inline constexpr int64_t kHeaderInts = 256;
inline constexpr int64_t kHeaderBytes = kHeaderInts * 4;
inline constexpr int kVocabSlot = 3;  // header[3]: the vocabulary size (this project's; 0: unknown)

// Bad input (a file that is no shard, an empty glob, too few tokens, an id out of the
// vocabulary): a one-line message naming the file and the fix.
class DataError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The files a pattern names, sorted by name: the path itself when it has no wildcard (it must
// exist), else glob(3)'s matches. Throws DataError when nothing matches.
std::vector<std::string> expand_glob(const std::string& pattern);

// One shard, kept open and read with pread(2) where tokens are asked for (never read whole). The
// constructor checks the header against the file's size; a read that finds the file shorter
// than at start (truncated under a running job) throws DataError naming the shard, where a
// memory mapping would have raised SIGBUS.
class Shard {
 public:
  explicit Shard(const std::string& path);
  // Tokens held in memory (e.g. a text file encoded on the fly, text_tokens.h) read exactly like a
  // shard: `name` stands for the path in messages, `vocab` is what header[3] would record (0: none).
  Shard(std::string name, std::vector<uint32_t> tokens, int64_t vocab);
  ~Shard();
  Shard(Shard&& other) noexcept;
  Shard& operator=(Shard&&) = delete;
  Shard(const Shard&) = delete;

  const std::string& path() const { return path_; }
  int64_t size() const { return tokens_; }          // tokens
  int token_bytes() const { return token_bytes_; }  // 2 (GPT-2 format) or 4 (Llama 3 format; in memory)
  bool in_memory() const { return !owned_.empty(); }
  int64_t vocab() const { return vocab_; }  // header[3], 0 when not recorded
  // The largest token id, computed on first use (one sequential pass over the shard).
  uint32_t max_token() const;
  // Tokens [start, start + n) as int64.
  void read(int64_t start, int64_t n, int64_t* out) const;

 private:
  // Bytes [offset, offset + n) of the file; throws DataError when it has become shorter.
  void read_bytes(int64_t offset, int64_t n, unsigned char* out) const;

  std::string path_;
  int fd_ = -1;                               // the file, open while the shard lives (none when empty or in memory)
  int64_t file_bytes_ = 0;                    // its size when opened
  std::vector<uint32_t> owned_;               // the tokens of an in-memory shard
  const unsigned char* tokens_at_ = nullptr;  // the first token of an in-memory shard (owned_)
  int64_t tokens_ = 0;
  int token_bytes_ = 2;
  int64_t vocab_ = 0;
  mutable std::once_flag max_once_;
  mutable uint32_t max_token_ = 0;
};

// Several shards read as one stream of tokens, in the order given.
class TokenShards {
 public:
  // Opens and checks every shard (headers and sizes); throws DataError on the first bad one.
  explicit TokenShards(const std::vector<std::string>& paths);
  // Shards already open (in-memory ones included), read in the order given.
  explicit TokenShards(std::vector<std::unique_ptr<Shard>> shards);

  int64_t size() const { return total_; }  // tokens over all shards
  const std::vector<std::unique_ptr<Shard>>& shards() const { return shards_; }
  // The vocabulary the shards' headers record (the largest), 0 when any shard records none.
  int64_t header_vocab() const;
  // The largest token id over all shards, and the shard holding it.
  uint32_t max_token(std::string* where = nullptr) const;
  // Every id must be below `vocab`: checked on each shard's maximum (one pass per shard, skipped
  // for uint16 shards when vocab > 65535). Throws DataError naming the shard and the id.
  void check_vocab(int64_t vocab) const;
  // Tokens [start, start + n) of the stream (they may span shards) as int64.
  void read(int64_t start, int64_t n, int64_t* out) const;
  // Window w is tokens [w*T, w*T + T] (T + 1: inputs and targets); writes windows.size() rows of
  // T + 1 tokens, row-major.
  void read_windows(const std::vector<int64_t>& windows, int64_t seq_len, int64_t* out) const;
  // "3 shards, 1234567 tokens (uint16)"; "1234567 tokens in memory" for in-memory shards.
  std::string describe() const;

 private:
  std::vector<std::unique_ptr<Shard>> shards_;
  std::vector<int64_t> starts_;  // first token of each shard in the stream
  int64_t total_ = 0;
};

// Windows of T + 1 tokens that a stream of n tokens holds (window w starts at w*T): (n - 1) / T.
int64_t window_count(int64_t n_tokens, int64_t seq_len);

// Where the trainer is in the training data: the global batch of a step starts at row `index`
// of epoch `epoch`'s permutation of the windows.
struct Position {
  int64_t epoch = 0;
  int64_t index = 0;
  bool operator==(const Position&) const = default;
};

// The training order: each epoch is a permutation of the windows drawn from (seed, epoch); the
// stream of rows is epoch 0's permutation, then epoch 1's, ...; the global batch of step s is
// rows [s*B, s*B + B) of that stream, a function of (seed, s) alone (any world size; rank r
// takes its contiguous slice). Throws DataError when the tokens make fewer windows than one batch.
class WindowSampler {
 public:
  WindowSampler(int64_t n_tokens, int64_t seq_len, int64_t batch, uint64_t seed);
  int64_t windows() const { return windows_; }  // per epoch
  Position position(int64_t step) const;        // where step's global batch starts
  std::vector<int64_t> batch_windows(int64_t step) const;
  // Epoch `epoch`'s permutation (a Fisher-Yates shuffle seeded from (seed, epoch)).
  std::vector<uint32_t> permutation(int64_t epoch) const;

 private:
  int64_t windows_, batch_;
  uint64_t seed_;
  mutable std::mutex mu_;  // the cached permutation
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<uint32_t> cached_;
};

// Validation, as llm.c evaluates: consecutive windows from the start of the data; validation
// batch i holds windows [i*B, i*B + B) (wrapping around at the end), rows in order.
std::vector<int64_t> validation_windows(int64_t n_tokens, int64_t seq_len, int64_t batch, int64_t index);

}  // namespace fsdp::data
