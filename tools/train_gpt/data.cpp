#include "data.h"

#include "options.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

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

TokenSource::TokenSource(const std::string& path, int64_t seq_len, uint64_t seed)
    : path_(path), synthetic_(path == "synthetic"), seq_len_(seq_len), seed_(seed) {
  if (synthetic_) return;
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

at::Tensor TokenSource::train_batch(int64_t step, int64_t batch) const { return draw(train_, kTrain, step, batch); }
at::Tensor TokenSource::val_batch(int64_t index, int64_t batch) const { return draw(val_, kVal, index, batch); }

at::Tensor TokenSource::prompt(int64_t max_len) const {
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
