#pragma once
// safetensors: the file format of every checkpoint this library writes (no pickle: loading a
// file can never run code, and any safetensors reader can open it).
//
// Layout: u64 little-endian N, N bytes of JSON header, then the data buffer. The header maps each
// tensor name to {"dtype", "shape", "data_offsets": [begin, end)} (offsets relative to the buffer)
// plus an optional "__metadata__" string-to-string map. The reader checks everything a hostile or
// damaged file can get wrong (src/checkpoint/safetensors_format.h) before any byte of data is trusted.
#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdp::safetensors {

// Every problem with a file: the message names the file (when known), what is wrong and, where
// there is one, the fix.
class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "F32" <-> at::kFloat, ... (BOOL U8 I8 I16 I32 I64 F16 BF16 F32 F64). Throws for others.
std::string dtype_name(at::ScalarType dtype);
at::ScalarType dtype_from_name(const std::string& name);

struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets in the data buffer, [begin, end)
  uint64_t end = 0;
  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

struct Header {
  std::vector<TensorEntry> tensors;                        // sorted by begin offset
  std::map<std::string, std::string> metadata;             // "__metadata__"
  uint64_t data_start = 0;                                 // file offset of the data buffer (8 + N)
  const TensorEntry* find(const std::string& name) const;  // nullptr when absent
};

// Reads a safetensors file with positioned reads (no mmap; a rank reads only what it needs).
class Reader {
 public:
  explicit Reader(const std::string& path);  // opens and validates the header; throws SafetensorsError
  ~Reader();
  Reader(const Reader&) = delete;
  Reader& operator=(const Reader&) = delete;

  const Header& header() const { return header_; }
  const std::string& path() const { return path_; }
  // Throws SafetensorsError when `name` is absent (message lists a few present names).
  const TensorEntry& entry(const std::string& name) const;
  // The whole tensor as a new contiguous CPU tensor.
  at::Tensor read(const std::string& name) const;
  // `length` bytes starting `offset` bytes into tensor `name`'s data, into `dst`. Range checked.
  void read_bytes(const std::string& name, uint64_t offset, uint64_t length, void* dst) const;

 private:
  std::string path_;
  int fd_ = -1;
  Header header_;
};

// A tensor to write: any dtype above, any device/layout (copied to contiguous CPU when needed).
struct NamedTensor {
  std::string name;
  at::Tensor tensor;
};

// Writes a complete file at `path` (created or truncated), header padded with spaces so the data
// starts 8-byte aligned, tensors in the given order, then fsync. Not atomic by itself: callers
// that need atomicity write to a temporary name and rename (see checkpoint.h).
// Throws SafetensorsError on duplicate names, unsupported dtypes or I/O errors (with errno text).
void write_file(const std::string& path, const std::vector<NamedTensor>& tensors,
                const std::map<std::string, std::string>& metadata = {});

// Streams a file whose tensors are known up front by dtype and shape: the header is written when
// the writer is created, then each tensor's data in order, so the caller holds one tensor at a
// time (a rank exporting a model larger than its memory gathers and appends one parameter at a
// time). Same layout and checks as write_file.
struct TensorSpec {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
};
class StreamWriter {
 public:
  StreamWriter(const std::string& path, const std::vector<TensorSpec>& specs,
               const std::map<std::string, std::string>& metadata = {});
  ~StreamWriter();  // closes the file if finish() was not reached (it is then incomplete)
  StreamWriter(const StreamWriter&) = delete;
  StreamWriter& operator=(const StreamWriter&) = delete;

  // The next declared tensor's data; its dtype and shape must match the declaration.
  void append(const at::Tensor& tensor);
  // Every declared tensor appended: fsync and close. Throws otherwise.
  void finish();

 private:
  std::string path_;
  std::vector<TensorSpec> specs_;
  size_t next_ = 0;
  int fd_ = -1;
};

}  // namespace fsdp::safetensors
