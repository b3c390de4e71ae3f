#include "fsdp/data/token_shards.h"

#include <fcntl.h>
#include <glob.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace fsdp::data {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw DataError(msg); }

std::string quoted(const std::string& path) { return "'" + path + "'"; }

constexpr const char* kShardHint =
    " (give llm.c token shards: fsdp-tokenize writes them, as do llm.c's dev/data scripts)";

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

template <typename T>
uint32_t max_of(const T* p, int64_t n) {
  T m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, p[i]);  // vectorised by the compiler
  return m;
}

template <typename T>
void widen(const T* p, int64_t n, int64_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = p[i];
}

}  // namespace

std::vector<std::string> expand_glob(const std::string& pattern) {
  if (pattern.find_first_of("*?[") == std::string::npos) {
    struct stat st {};
    if (::stat(pattern.c_str(), &st) != 0) {
      fail("cannot read token shard " + quoted(pattern) + ": " + std::strerror(errno) + kShardHint);
    }
    return {pattern};
  }
  glob_t g{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &g);
  std::vector<std::string> out;
  if (rc == 0) out.assign(g.gl_pathv, g.gl_pathv + g.gl_pathc);
  ::globfree(&g);
  if (out.empty()) fail("no file matches " + quoted(pattern) + kShardHint);
  std::sort(out.begin(), out.end());
  return out;
}

Shard::Shard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0 && errno == EMFILE) {
    fail("cannot open token shard " + quoted(path) + ": " + std::strerror(errno) +
         " (each shard stays open while training: raise the limit, ulimit -n, or merge shards)");
  }
  if (fd < 0) fail("cannot read token shard " + quoted(path) + ": " + std::strerror(errno) + kShardHint);
  struct Closer {  // kept open (fd_) once the file is known to be a shard with tokens
    int fd;
    ~Closer() {
      if (fd >= 0) ::close(fd);
    }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail("cannot read token shard " + quoted(path) + ": " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("token shard " + quoted(path) + " is not a regular file" + kShardHint);
  const int64_t bytes = st.st_size;
  if (bytes < kHeaderBytes) {
    fail("token shard " + quoted(path) + " has " + std::to_string(bytes) + " bytes, less than llm.c's " +
         std::to_string(kHeaderBytes) + "-byte header" + kShardHint);
  }
  int32_t header[kHeaderInts];
  if (::pread(fd, header, sizeof header, 0) != static_cast<ssize_t>(sizeof header)) {
    fail("cannot read the header of token shard " + quoted(path) + ": " + std::strerror(errno));
  }
  const int32_t magic = header[0], version = header[1];
  if (magic == kGpt2Magic) {
    token_bytes_ = 2;
    if (version != kGpt2Version) {
      fail("token shard " + quoted(path) + " has version " + std::to_string(version) + " with GPT-2 magic " +
           std::to_string(kGpt2Magic) + ", expected " + std::to_string(kGpt2Version) +
           " (written by another tool or llm.c version: re-tokenize it with fsdp-tokenize)");
    }
  } else if (magic == kLlama3Magic) {
    token_bytes_ = 4;
    if (version != kLlama3Version) {
      fail("token shard " + quoted(path) + " has version " + std::to_string(version) + " with Llama 3 magic " +
           std::to_string(kLlama3Magic) + ", expected " + std::to_string(kLlama3Version) +
           " (written by another tool or llm.c version: re-tokenize it with fsdp-tokenize)");
    }
  } else {
    fail("token shard " + quoted(path) + " has magic " + std::to_string(magic) + ", not llm.c's " +
         std::to_string(kGpt2Magic) + " (uint16 tokens) or " + std::to_string(kLlama3Magic) + " (uint32 tokens)" +
         kShardHint);
  }
  tokens_ = header[2];
  vocab_ = header[kVocabSlot] > 0 ? header[kVocabSlot] : 0;
  const int64_t payload = bytes - kHeaderBytes;
  if (tokens_ < 0 || tokens_ * token_bytes_ != payload) {
    fail("token shard " + quoted(path) + " says " + std::to_string(tokens_) + " tokens (" +
         std::to_string(tokens_ * token_bytes_) + " bytes) but holds " + std::to_string(payload) +
         " bytes after its header (truncated or damaged: write it again)");
  }
  if (tokens_ == 0) return;
  fd_ = fd;
  file_bytes_ = bytes;
  closer.fd = -1;
}

Shard::Shard(std::string name, std::vector<uint32_t> tokens, int64_t vocab)
    : path_(std::move(name)),
      owned_(std::move(tokens)),
      tokens_(static_cast<int64_t>(owned_.size())),
      token_bytes_(4),
      vocab_(vocab > 0 ? vocab : 0) {
  tokens_at_ = reinterpret_cast<const unsigned char*>(owned_.data());
}

Shard::~Shard() {
  if (fd_ >= 0) ::close(fd_);
}

Shard::Shard(Shard&& o) noexcept
    : path_(std::move(o.path_)),
      fd_(o.fd_),
      file_bytes_(o.file_bytes_),
      owned_(std::move(o.owned_)),  // a moved vector keeps its buffer: tokens_at_ stays valid
      tokens_at_(o.tokens_at_),
      tokens_(o.tokens_),
      token_bytes_(o.token_bytes_),
      vocab_(o.vocab_) {
  o.fd_ = -1;
  o.tokens_at_ = nullptr;
}

// [Note: shards read with pread] A shard is read through pread(2) on the descriptor opened at
// start, not through a mapping: a file truncated or rewritten shorter under a running job makes a
// mapped read past the new end raise SIGBUS, which kills the process naming no file; pread
// returns short instead, and the read fails with a DataError naming the shard. (A file replaced by
// a rename is not seen: the descriptor keeps the file the run started with.)
void Shard::read_bytes(int64_t offset, int64_t n, unsigned char* out) const {
  int64_t done = 0;
  while (done < n) {
    const ssize_t got = ::pread(fd_, out + done, static_cast<size_t>(n - done), offset + done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) fail("cannot read token shard " + quoted(path_) + ": " + std::strerror(errno));
    if (got == 0) {
      struct stat st {};
      const std::string now = ::fstat(fd_, &st) == 0 ? std::to_string(st.st_size) + " bytes" : "unknown";
      fail("token shard " + quoted(path_) + " changed under the running job: it had " + std::to_string(file_bytes_) +
           " bytes at start and has " + now +
           " now (truncated or rewritten: restore it, then resume from the last "
           "checkpoint)");
    }
    done += got;
  }
}

uint32_t Shard::max_token() const {
  std::call_once(max_once_, [&] {
    if (tokens_ == 0) return;
    if (in_memory()) {
      max_token_ = max_of(reinterpret_cast<const uint32_t*>(tokens_at_), tokens_);
      return;
    }
    constexpr int64_t kChunk = int64_t{1} << 20;  // tokens per read: one sequential pass
    std::vector<unsigned char> buf(static_cast<size_t>(std::min(tokens_, kChunk) * token_bytes_));
    for (int64_t at = 0; at < tokens_; at += kChunk) {
      const int64_t n = std::min(kChunk, tokens_ - at);
      read_bytes(kHeaderBytes + at * token_bytes_, n * token_bytes_, buf.data());
      max_token_ = std::max(max_token_, token_bytes_ == 2 ? max_of(reinterpret_cast<const uint16_t*>(buf.data()), n)
                                                          : max_of(reinterpret_cast<const uint32_t*>(buf.data()), n));
    }
  });
  return max_token_;
}

void Shard::read(int64_t start, int64_t n, int64_t* out) const {
  const unsigned char* p = tokens_at_;
  if (!in_memory()) {  // a window (seq_len + 1 tokens) at a time, through a buffer of this thread's
    thread_local std::vector<unsigned char> staged;
    staged.resize(static_cast<size_t>(n * token_bytes_));
    read_bytes(kHeaderBytes + start * token_bytes_, n * token_bytes_, staged.data());
    p = staged.data();
    start = 0;
  }
  if (token_bytes_ == 2) {
    widen(reinterpret_cast<const uint16_t*>(p) + start, n, out);
  } else {
    widen(reinterpret_cast<const uint32_t*>(p) + start, n, out);
  }
}

TokenShards::TokenShards(const std::vector<std::string>& paths) {
  // Every shard keeps a descriptor open: many shards may need more than the soft limit (1024 by
  // default), which the process may raise up to the hard one itself.
  if (rlimit lim{}; ::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
                    lim.rlim_cur < paths.size() + 256 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur =
        lim.rlim_max == RLIM_INFINITY ? paths.size() + 256 : std::min<rlim_t>(lim.rlim_max, paths.size() + 256);
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
  for (const auto& path : paths) {
    shards_.push_back(std::make_unique<Shard>(path));
    starts_.push_back(total_);
    total_ += shards_.back()->size();
  }
}

TokenShards::TokenShards(std::vector<std::unique_ptr<Shard>> shards) : shards_(std::move(shards)) {
  for (const auto& s : shards_) {
    starts_.push_back(total_);
    total_ += s->size();
  }
}

int64_t TokenShards::header_vocab() const {
  int64_t v = 0;
  for (const auto& s : shards_) {
    if (s->vocab() == 0) return 0;
    v = std::max(v, s->vocab());
  }
  return v;
}

uint32_t TokenShards::max_token(std::string* where) const {
  uint32_t m = 0;
  for (const auto& s : shards_) {
    if (s->size() > 0 && (s->max_token() > m || (where && where->empty()))) {
      m = std::max(m, s->max_token());
      if (where && s->max_token() == m) *where = s->path();
    }
  }
  return m;
}

void TokenShards::check_vocab(int64_t vocab) const {
  for (const auto& s : shards_) {
    if (s->size() == 0 || (s->token_bytes() == 2 && vocab > 65535)) continue;  // every uint16 fits
    if (static_cast<int64_t>(s->max_token()) >= vocab) {
      fail("token shard " + quoted(s->path()) + " holds token id " + std::to_string(s->max_token()) +
           ", at or above the model's vocabulary of " + std::to_string(vocab) + " (give --vocab-size " +
           std::to_string(static_cast<int64_t>(s->max_token()) + 1) +
           " or more, or shards made with this model's tokenizer)");
    }
  }
}

void TokenShards::read(int64_t start, int64_t n, int64_t* out) const {
  // The shard holding `start`: the last one starting at or before it.
  size_t i = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), start) - starts_.begin()) - 1;
  while (n > 0) {
    const Shard& s = *shards_.at(i);
    const int64_t offset = start - starts_[i];
    const int64_t take = std::min(n, s.size() - offset);
    if (take > 0) s.read(offset, take, out);
    out += take;
    start += take;
    n -= take;
    ++i;
  }
}

void TokenShards::read_windows(const std::vector<int64_t>& windows, int64_t seq_len, int64_t* out) const {
  for (const int64_t w : windows) {
    read(w * seq_len, seq_len + 1, out);
    out += seq_len + 1;
  }
}

std::string TokenShards::describe() const {
  if (std::all_of(shards_.begin(), shards_.end(), [](const auto& s) { return s->in_memory(); })) {
    return std::to_string(total_) + " tokens in memory";
  }
  bool u16 = false, u32 = false;
  for (const auto& s : shards_) (s->token_bytes() == 2 ? u16 : u32) = true;
  return std::to_string(shards_.size()) + (shards_.size() == 1 ? " shard, " : " shards, ") + std::to_string(total_) +
         " tokens (" +
         (u16 && u32 ? "uint16 and uint32"
          : u16      ? "uint16"
                     : "uint32") +
         ")";
}

int64_t window_count(int64_t n_tokens, int64_t seq_len) { return n_tokens > 0 ? (n_tokens - 1) / seq_len : 0; }

WindowSampler::WindowSampler(int64_t n_tokens, int64_t seq_len, int64_t batch, uint64_t seed)
    : windows_(window_count(n_tokens, seq_len)), batch_(batch), seed_(seed) {
  if (windows_ < batch) {
    fail(std::to_string(n_tokens) + " training tokens are fewer than one batch (--batch-size " + std::to_string(batch) +
         " x --seq-len " + std::to_string(seq_len) + " + 1 = " + std::to_string(batch * seq_len + 1) +
         "): give more data or a smaller batch");
  }
  if (windows_ > int64_t{0xFFFFFFFF}) {
    fail(std::to_string(windows_) + " training windows are more than 2^32 - 1: give a longer --seq-len or less data");
  }
}

Position WindowSampler::position(int64_t step) const {
  const int64_t row = step * batch_;
  return {row / windows_, row % windows_};
}

std::vector<uint32_t> WindowSampler::permutation(int64_t epoch) const {
  std::vector<uint32_t> p(static_cast<size_t>(windows_));
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint32_t>(i);
  // Fisher-Yates from a counter-based generator: the same permutation on every machine.
  uint64_t state = splitmix64(splitmix64(seed_ ^ 0x5EEDDA7Aull) + static_cast<uint64_t>(epoch));
  for (size_t i = p.size(); i > 1; --i) {
    state = splitmix64(state);
    const auto j = static_cast<size_t>((static_cast<unsigned __int128>(state) * i) >> 64);  // in [0, i)
    std::swap(p[i - 1], p[j]);
  }
  return p;
}

std::vector<int64_t> WindowSampler::batch_windows(int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(batch_));
  for (int64_t row = step * batch_; row < (step + 1) * batch_; ++row) {
    const int64_t epoch = row / windows_;
    if (epoch != cached_epoch_) {
      cached_ = permutation(epoch);
      cached_epoch_ = epoch;
    }
    out.push_back(cached_[static_cast<size_t>(row % windows_)]);
  }
  return out;
}

std::vector<int64_t> validation_windows(int64_t n_tokens, int64_t seq_len, int64_t batch, int64_t index) {
  const int64_t n = window_count(n_tokens, seq_len);
  if (n < batch) {
    fail(std::to_string(n_tokens) + " validation tokens are fewer than one batch (--batch-size " +
         std::to_string(batch) + " x --seq-len " + std::to_string(seq_len) +
         " + 1 = " + std::to_string(batch * seq_len + 1) + "): give more validation data or a smaller batch");
  }
  std::vector<int64_t> out;
  for (int64_t r = 0; r < batch; ++r) out.push_back((index * batch + r) % n);
  return out;
}

}  // namespace fsdp::data
