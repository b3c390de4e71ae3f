#include "data.h"

#include "fsdp/data/hf_tokenizer.h"
#include "fsdp/data/text_tokens.h"
#include "fsdp/dist/env.h"
#include "options.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>

namespace train_gpt {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// One generator per (seed, stream, index): batches never depend on what ran before.
at::Generator generator(uint64_t seed, uint64_t stream, int64_t index) {
  return at::detail::createCPUGenerator(splitmix64(splitmix64(seed ^ (stream << 56)) + static_cast<uint64_t>(index)));
}

constexpr uint64_t kTrain = 1, kVal = 2, kPrompt = 3;

[[noreturn]] void data_error(const std::string& path, const std::string& why) {
  throw std::invalid_argument("cannot read data file '" + path + "'" + why);
}

// What a non-regular file is, for the message.
std::string file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

constexpr const char* kDataHint = " (give a readable text file, or --data synthetic)";

// The checks shared by check_data_file (stat) and read_data_file (fstat of the open descriptor).
int64_t check_stat(const std::string& path, const struct stat& st) {
  if (!S_ISREG(st.st_mode)) {
    data_error(path, ": it is " + file_kind(st.st_mode) + ", not a regular file" + kDataHint);
  }
  if (st.st_size > kMaxDataBytes) {
    data_error(path, ": " + std::to_string(st.st_size) + " bytes is more than the " +
                         std::to_string(kMaxDataBytes >> 30) +
                         " GiB a --data file may have (it is read whole into memory)");
  }
  return static_cast<int64_t>(st.st_size);
}

}  // namespace

int64_t check_data_file(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    data_error(path,
               std::string(": ") + std::strerror(err) +
                   (path == kDefaultCorpus ? " (the default corpus: run scripts/setup.sh, or apt-get install fortunes)"
                                           : kDataHint));
  }
  const int64_t size = check_stat(path, st);
  if (::access(path.c_str(), R_OK) != 0) data_error(path, std::string(": ") + std::strerror(errno) + kDataHint);
  return size;
}

at::Tensor read_data_file(const std::string& path) {
  // O_NONBLOCK: should the path have become a FIFO since validate() looked, open returns at once.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) data_error(path, std::string(": ") + std::strerror(errno) + kDataHint);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) data_error(path, std::string(": ") + std::strerror(errno));
  const int64_t size = check_stat(path, st);
  at::Tensor bytes = at::empty({size}, at::kByte);
  auto* out = reinterpret_cast<char*>(bytes.data_ptr<uint8_t>());
  int64_t got = 0;
  while (got < size) {  // exactly the size fstat gave: a file that grows is not followed
    const ssize_t n = ::read(fd, out + got, static_cast<size_t>(std::min<int64_t>(size - got, int64_t{1} << 26)));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) data_error(path, std::string(": ") + std::strerror(errno));
    if (n == 0) break;  // it shrank meanwhile: keep what was read
    got += n;
  }
  return got == size ? bytes : bytes.narrow(0, 0, got).clone();
}

namespace {

constexpr const char* kTokensPrefix = "tokens:";

bool is_tokens(const std::string& data) { return data.rfind(kTokensPrefix, 0) == 0; }
std::string pattern_of(const std::string& data) { return data.substr(std::strlen(kTokensPrefix)); }

// --data text:FILE: the file encoded on the fly with --tokenizer (bytes without it), in memory.
constexpr const char* kTextPrefix = "text:";

bool is_text(const std::string& data) { return data.rfind(kTextPrefix, 0) == 0; }
bool is_token_data(const std::string& data) { return is_tokens(data) || is_text(data); }

// The file of text:FILE encoded as fsdp-tokenize would (fsdp/data/text_tokens.h); SentencePiece
// through fsdp-tokenize beside train_gpt, its threads shared among this node's ranks.
fsdp::data::TextTokens encode_text_option(const std::string& spec, const Options& o) {
  fsdp::data::TextEncoding enc;
  enc.tokenizer = o.tokenizer;
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int ranks_here = local ? std::max(1, std::atoi(local)) : 1;
  enc.threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks_here);
  return fsdp::data::encode_text(spec.substr(std::strlen(kTextPrefix)), enc);
}

// "a_000000.bin, a_000001.bin" or "a_000000.bin .. a_000011.bin (12 files)".
std::string file_names(const std::vector<std::string>& files) {
  auto name = [](const std::string& f) { return std::filesystem::path(f).filename().string(); };
  if (files.size() > 3) {
    return name(files.front()) + " .. " + name(files.back()) + " (" + std::to_string(files.size()) + " files)";
  }
  std::string out;
  for (const auto& f : files) out += (out.empty() ? "" : ", ") + name(f);
  return out;
}

}  // namespace

// Everything --data tokens: needs, opened and checked once (resolve_vocab) before any work.
struct TokenData {
  std::string data, val_data, tokenizer;  // the options it was opened for
  int64_t seq_len = 0, batch = 0, vocab_option = 0;
  uint64_t seed = 0;
  std::vector<std::string> train_files, val_files;
  std::unique_ptr<fsdp::data::TokenShards> train, val;
  std::unique_ptr<fsdp::data::WindowSampler> order;
  int64_t vocab = 0;
  std::string vocab_origin;                          // "--vocab-size", "recorded in the shards", "largest id + 1"
  std::optional<fsdp::data::SampleDecoder> decoder;  // --tokenizer: tokenizer.model or tokenizer.json

  bool opened_for(const Options& o) const {
    return data == o.data && val_data == o.val_data && tokenizer == o.tokenizer && seq_len == o.seq_len &&
           batch == o.batch_size && seed == o.seed && (o.vocab_size == 0 || o.vocab_size == vocab);
  }
};

namespace {

// Under --init-from: every id below config.json's vocab_size, or one line naming the shard and
// the fix (the model's tokenizer; --vocab-size cannot change a pretrained model's vocabulary).
void check_ids_fit_model(const fsdp::data::TokenShards& shards, int64_t vocab, const Options& o) {
  const std::string& init_from = o.init_from;
  if (shards.size() == 0) return;
  std::string where;
  const int64_t top = shards.max_token(&where);
  if (top < vocab) return;
  throw std::invalid_argument("token shard '" + where + "' holds token id " + std::to_string(top) + ", at or above " +
                              init_from + "/config.json's vocab_size " + std::to_string(vocab) +
                              ": tokenize the data with that model's tokenizer (" +
                              (is_text(o.data) ? "--tokenizer " + init_from + "/tokenizer.model or tokenizer.json"
                                               : "fsdp-tokenize --tokenizer " + init_from + "/tokenizer.model") +
                              ")");
}

// Rank 0 (or a process without a launcher) prints what is allowed but probably a mistake.
void warn(const std::string& text) {
  try {
    if (fsdp::dist::read_launch_env().rank != 0) return;
  } catch (const std::exception&) {
    // A launcher's variables this process cannot read: run_training() names them; warn here anyway.
  }
  std::fprintf(stderr, "train_gpt: warning: %s\n", text.c_str());
  std::fflush(stderr);
}

// Two warnings, before any work: validation data that is the training data (the validation loss
// then measures memorisation), and shards that record a larger vocabulary than the model's (made
// by another tokenizer, though every id present happens to fit).
void warn_probable_mistakes(const TokenData& d, const Options& o) {
  std::set<std::string> train;
  for (const auto& f : d.train_files) train.insert(std::filesystem::weakly_canonical(f).string());
  for (const auto& f : d.val_files) {
    if (o.val_data.empty() || !train.count(std::filesystem::weakly_canonical(f).string())) continue;
    warn("--val-data " + o.val_data + " reads " + f + ", which is training data too (--data " + o.data +
         "): the validation loss then measures memorisation; give held-out data");
    break;
  }
  for (const auto* shards : {d.train.get(), d.val.get()}) {
    for (const auto& s : shards->shards()) {
      if (s->vocab() <= d.vocab) continue;
      warn("token shard '" + s->path() + "' records a vocabulary of " + std::to_string(s->vocab()) +
           ", larger than the model's " + std::to_string(d.vocab) + " (" + d.vocab_origin +
           "): were the shards made with another tokenizer than the model's?");
      return;
    }
  }
}

std::shared_ptr<const TokenData> open_token_data(const Options& o) {
  auto d = std::make_shared<TokenData>();
  d->data = o.data;
  d->val_data = o.val_data;
  d->tokenizer = o.tokenizer;
  d->seq_len = o.seq_len;
  d->batch = o.batch_size;
  d->vocab_option = o.vocab_size;
  d->seed = o.seed;
  if (is_text(o.data)) {
    const auto text = encode_text_option(o.data, o);
    d->train_files = d->val_files = {text.path};
    const auto n = static_cast<int64_t>(text.tokens.size());
    if (o.val_data.empty()) {  // as a --data FILE of bytes: the first 90% train, the rest validation
      d->train = text.shards(0, n * 9 / 10);
      d->val = text.shards(n * 9 / 10, n);
    } else {
      d->train = text.shards(0, n);
    }
  }
  const auto files = d->train ? std::vector<std::string>{} : fsdp::data::expand_glob(pattern_of(o.data));
  if (d->train) {
    // text:FILE, above
  } else if (o.val_data.empty()) {
    // As llm.c names them: shards whose name contains "_val_" are the validation data.
    for (const auto& f : files) {
      (std::filesystem::path(f).filename().string().find("_val_") != std::string::npos ? d->val_files : d->train_files)
          .push_back(f);
    }
    if (d->val_files.empty()) {
      throw std::invalid_argument("--data " + o.data +
                                  " has no validation shards (none is named *_val_*): give --val-data tokens:PATTERN");
    }
    if (d->train_files.empty()) {
      throw std::invalid_argument("--data " + o.data +
                                  " matches only validation shards (*_val_*): give the training shards too");
    }
  } else {
    d->train_files = files;
  }
  if (!o.val_data.empty()) {
    if (!is_token_data(o.val_data)) {
      throw std::invalid_argument("--val-data '" + o.val_data +
                                  "' must be tokens:PATTERN (llm.c token shards) or text:FILE (encoded on the fly)");
    }
    if (is_text(o.val_data)) {
      const auto text = encode_text_option(o.val_data, o);
      d->val_files = {text.path};
      d->val = text.shards(0, static_cast<int64_t>(text.tokens.size()));
    } else {
      d->val_files = fsdp::data::expand_glob(pattern_of(o.val_data));
    }
  }
  if (!d->train) d->train = std::make_unique<fsdp::data::TokenShards>(d->train_files);
  if (!d->val) d->val = std::make_unique<fsdp::data::TokenShards>(d->val_files);
  if (o.vocab_size > 0) {
    d->vocab = o.vocab_size;
    d->vocab_origin = o.init_from.empty() ? "--vocab-size" : o.init_from + "/config.json";
  } else if (d->train->header_vocab() > 0 && d->val->header_vocab() > 0) {
    d->vocab = std::max(d->train->header_vocab(), d->val->header_vocab());
    d->vocab_origin = is_text(o.data) ? "the tokenizer's" : "recorded in the shards";
  } else {
    d->vocab = int64_t{std::max(d->train->max_token(), d->val->max_token())} + 1;
    d->vocab_origin = "the largest id + 1; --vocab-size sets it";
  }
  if (!o.init_from.empty()) {  // the vocabulary is config.json's: --vocab-size is no fix
    check_ids_fit_model(*d->train, d->vocab, o);
    check_ids_fit_model(*d->val, d->vocab, o);
  }
  d->train->check_vocab(d->vocab);
  d->val->check_vocab(d->vocab);
  warn_probable_mistakes(*d, o);
  d->order = std::make_unique<fsdp::data::WindowSampler>(d->train->size(), o.seq_len, o.batch_size, o.seed);
  fsdp::data::validation_windows(d->val->size(), o.seq_len, o.batch_size, 0);  // at least one batch
  if (!o.tokenizer.empty()) d->decoder = fsdp::data::SampleDecoder::load(o.tokenizer);
  return d;
}

// resolve_vocab's shards, for the TokenSource made from the same options.
std::shared_ptr<const TokenData>& checked_token_data() {
  static std::shared_ptr<const TokenData> d;
  return d;
}

// Bytes as the trainer has always printed them.
char printable(int64_t b) { return (b == '\n' || b == '\t' || (b >= 32 && b < 127)) ? static_cast<char>(b) : '?'; }

}  // namespace

int64_t resolve_vocab(const Options& o) {
  if (!is_token_data(o.data)) {
    if (!o.val_data.empty()) {
      throw std::invalid_argument("--val-data needs --data tokens:PATTERN (token shards) or text:FILE");
    }
    if (!o.tokenizer.empty()) {
      throw std::invalid_argument(
          "--tokenizer encodes --data text:FILE and decodes token shards' samples: use it with --data text:FILE or "
          "tokens:PATTERN");
    }
    if (o.vocab_size > 0 && o.vocab_size < 256) {
      throw std::invalid_argument("--vocab-size " + std::to_string(o.vocab_size) +
                                  " is too small for bytes (256 ids): give 256 or more, or leave it out");
    }
    return o.vocab_size > 0 ? o.vocab_size : 256;
  }
  checked_token_data() = open_token_data(o);
  return checked_token_data()->vocab;
}

TokenSource::TokenSource(const Options& o) : TokenSource(is_token_data(o.data) ? "" : o.data, o.seq_len, o.seed) {
  if (!is_token_data(o.data)) return;
  path_ = o.data;
  auto& checked = checked_token_data();
  tokens_ = checked && checked->opened_for(o) ? checked : open_token_data(o);
}

TokenSource::TokenSource(const std::string& path, int64_t seq_len, uint64_t seed)
    : path_(path), synthetic_(path == "synthetic"), seq_len_(seq_len), seed_(seed) {
  if (synthetic_ || path.empty()) return;  // "": token shards (the constructor above)
  at::Tensor all = read_data_file(path);
  const int64_t n = all.numel();
  const int64_t n_train = n * 9 / 10;
  if (n_train < seq_len + 2 || n - n_train < seq_len + 2) {
    throw std::invalid_argument("data file '" + path + "' has " + std::to_string(n) + " bytes, too few for --seq-len " +
                                std::to_string(seq_len) + " (each 10% validation / 90% train part needs seq-len + 2)");
  }
  train_ = all.narrow(0, 0, n_train);
  val_ = all.narrow(0, n_train, n - n_train);
}

at::Tensor TokenSource::draw(const at::Tensor& tokens, uint64_t stream, int64_t index, int64_t batch) const {
  auto gen = generator(seed_, stream, index);
  const int64_t len = seq_len_ + 1;
  if (synthetic_) {
    at::Tensor x = at::empty({batch, len}, at::kLong);
    x.narrow(1, 0, 2).copy_(at::randint(256, {batch, 2}, gen, at::kLong));
    for (int64_t t = 2; t < len; ++t) {
      x.select(1, t).copy_((x.select(1, t - 1) * 7 + x.select(1, t - 2) * 3 + 1) % 256);
    }
    return x;
  }
  const int64_t n = tokens.size(0);
  at::Tensor starts = at::randint(n - len + 1, {batch, 1}, gen, at::kLong);
  at::Tensor idx = starts + at::arange(len, at::kLong).unsqueeze(0);
  return tokens.index_select(0, idx.reshape({-1})).to(at::kLong).reshape({batch, len});
}

namespace {

at::Tensor read_windows(const fsdp::data::TokenShards& shards, const std::vector<int64_t>& windows, int64_t seq_len) {
  at::Tensor x = at::empty({static_cast<int64_t>(windows.size()), seq_len + 1}, at::kLong);
  shards.read_windows(windows, seq_len, x.data_ptr<int64_t>());
  return x;
}

}  // namespace

at::Tensor TokenSource::train_batch(int64_t step, int64_t batch) const {
  if (tokens_) return read_windows(*tokens_->train, tokens_->order->batch_windows(step), seq_len_);
  return draw(train_, kTrain, step, batch);
}

at::Tensor TokenSource::val_batch(int64_t index, int64_t batch) const {
  if (tokens_) {
    return read_windows(*tokens_->val, fsdp::data::validation_windows(tokens_->val->size(), seq_len_, batch, index),
                        seq_len_);
  }
  if (synthetic_) return draw(val_, kVal, index, batch);  // no stream to read: generated from (seed, index)
  // As llm.c evaluates (and as token shards are read): consecutive windows from the start of the
  // validation bytes, window k = bytes [kT, kT + T] (inputs [kT, kT + T), targets shifted by one),
  // batch i holding windows [iB, iB + B) in order, wrapping around at the end.
  const int64_t windows = fsdp::data::window_count(val_.size(0), seq_len_);
  at::Tensor starts = (at::arange(batch, at::kLong) + index * batch).remainder(windows) * seq_len_;
  at::Tensor idx = starts.unsqueeze(1) + at::arange(seq_len_ + 1, at::kLong).unsqueeze(0);
  return val_.index_select(0, idx.reshape({-1})).to(at::kLong).reshape({batch, seq_len_ + 1});
}

fsdp::data::Position TokenSource::position(int64_t step) const {
  return tokens_ ? tokens_->order->position(step) : fsdp::data::Position{};
}

std::string TokenSource::decode(const std::vector<int64_t>& ids) const {
  if (tokens_ && tokens_->decoder) return tokens_->decoder->decode(ids);
  std::string out;
  for (const int64_t id : ids) {
    if (id < 256 && (!tokens_ || tokens_->vocab <= 257)) {
      out += printable(id);
    } else if (id == 256 && tokens_ && tokens_->vocab == 257) {
      out += "<|endoftext|>";  // fsdp-tokenize's document separator for bytes
    } else {
      out += "<" + std::to_string(id) + ">";
    }
  }
  return out;
}

at::Tensor TokenSource::prompt(int64_t max_len) const {
  if (tokens_) {  // the start of the validation data
    const int64_t len = std::min<int64_t>(max_len, tokens_->val->size());
    at::Tensor x = at::empty({1, len}, at::kLong);
    tokens_->val->read(0, len, x.data_ptr<int64_t>());
    return x;
  }
  if (synthetic_) return draw(val_, kPrompt, 0, 1).narrow(1, 0, 2).contiguous();
  // The start of a line of the validation text: a fortune's first words.
  auto data = val_.data_ptr<uint8_t>();
  const int64_t n = val_.size(0);
  int64_t start = 0;
  for (int64_t i = 0; i + 1 < n; ++i) {
    if (data[i] == '%' && data[i + 1] == '\n') {
      start = i + 2;
      break;
    }
  }
  const int64_t len = std::min<int64_t>(max_len, n - start);
  return val_.narrow(0, start, len).to(at::kLong).unsqueeze(0);
}

std::string TokenSource::describe() const {
  if (tokens_) {
    const TokenData& d = *tokens_;
    const int64_t windows = d.order->windows();
    return "train " + d.train->describe() + ": " + file_names(d.train_files) + "; validation " + d.val->describe() +
           ": " + file_names(d.val_files) + "; " + std::to_string(windows) + " windows of " +
           std::to_string(seq_len_ + 1) + " tokens per epoch (" + std::to_string(windows * seq_len_) +
           " tokens); vocabulary " + std::to_string(d.vocab) + " (" + d.vocab_origin + ")" +
           (d.decoder ? "; tokenizer " + d.tokenizer : "");
  }
  if (synthetic_) return "synthetic tokens (seed " + std::to_string(seed_) + ")";
  return path_ + ": " + std::to_string(train_.size(0) + val_.size(0)) + " bytes (" + std::to_string(train_.size(0)) +
         " train, " + std::to_string(val_.size(0)) + " validation)";
}

at::Tensor local_slice(const at::Tensor& global, int rank, int world, int64_t micro, int64_t n_micro) {
  const int64_t per_rank = global.size(0) / world;
  const int64_t per_micro = per_rank / n_micro;
  return global.narrow(0, rank * per_rank + micro * per_micro, per_micro);
}

}  // namespace train_gpt
