// safetensors format layer: header parsing/validation, a pread-based reader and a writer.
//
// The validation mirrors the reference implementation's (huggingface/safetensors `validate`):
// a file is accepted only if every tensor's bytes are exactly accounted for, so a damaged or
// hostile file fails here with a message instead of feeding garbage (or out-of-bounds offsets)
// to the loader. nlohmann-json stays private to this file.
#include "fsdp/checkpoint/safetensors.h"
#include "checkpoint/safetensors_format.h"

#include <zlib.h>
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <set>
#include <sstream>

namespace fsdp::safetensors {

// The format is little-endian; this library copies tensor bytes verbatim. (The compiler macro,
// not C++20's std::endian: the fuzz build compiles this file as C++17, see fuzz-safetensors.sh.)
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

namespace {

using json = nlohmann::json;

constexpr const char* kMetadataKey = "__metadata__";
// Deepest nesting a valid header needs is 3 (root -> entry -> shape array); extra unknown fields
// may nest a little, anything deeper is rejected before it costs memory.
constexpr std::size_t kMaxJsonDepth = 16;
// Names in messages are clipped: a hostile file can hold a name of megabytes.
constexpr std::size_t kMaxNameInMessage = 120;

std::string quoted(const std::string& name) {
  if (name.size() <= kMaxNameInMessage) return "'" + name + "'";
  return "'" + name.substr(0, kMaxNameInMessage) + "...' (" + std::to_string(name.size()) + " bytes)";
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw SafetensorsError(source + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& source, const std::string& name, const std::string& what) {
  fail(source, "tensor " + quoted(name) + ": " + what);
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// Strict UTF-8 (no overlongs, no surrogates, <= U+10FFFF). Returns the offset of the first bad
// byte, or npos.
size_t find_invalid_utf8(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else
      return i;
    if (n - i < len) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return i;
    i += len;
  }
  return std::string::npos;
}

size_t element_size(at::ScalarType dtype) { return c10::elementSize(dtype); }

// A JSON number that must be a non-negative integer (shape dims, data offsets).
uint64_t get_u64(const json& j, const std::string& source, const std::string& name, const char* field) {
  if (j.is_number_unsigned()) return j.get<uint64_t>();
  if (j.is_number_integer()) {
    int64_t v = j.get<int64_t>();
    if (v < 0) fail_tensor(source, name, std::string(field) + " holds negative value " + std::to_string(v));
    return static_cast<uint64_t>(v);
  }
  fail_tensor(source, name,
              std::string(field) + " must hold non-negative integers, got " + j.type_name() +
                  (j.is_number_float() ? " (fractional or out of range)" : ""));
}

// Parses the header JSON; rejects duplicate keys at any level (nlohmann would silently keep the
// last one, so two readers could disagree about which tensor a name means).
json parse_json(const char* first, const char* last, const std::string& source) {
  std::vector<std::set<std::string>> keys;  // one set per open object
  auto cb = [&](int depth, json::parse_event_t event, json& parsed) -> bool {
    if (static_cast<std::size_t>(depth) > kMaxJsonDepth)
      fail(source, "header JSON nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
    switch (event) {
      case json::parse_event_t::object_start: keys.emplace_back(); break;
      case json::parse_event_t::object_end:
        if (!keys.empty()) keys.pop_back();
        break;
      case json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!keys.empty() && !keys.back().insert(key).second)
          fail(source, "duplicate key " + quoted(key) + " in the header" +
                           (keys.size() == 1 ? " (two tensors with one name)" : ""));
        break;
      }
      default: break;
    }
    return true;
  };
  try {
    return json::parse(first, last, cb);
  } catch (const json::exception& e) {
    fail(source, std::string("header is not valid JSON: ") + e.what());
  }
}

void write_all(int fd, const void* data, size_t length, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (length > 0) {
    // Linux writes at most ~2 GiB per call; ask for 1 GiB and loop on short writes.
    ssize_t n = ::write(fd, p, std::min<size_t>(length, size_t{1} << 30));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, std::string("write failed: ") + std::strerror(errno));
    }
    if (n == 0) fail(path, "write returned 0 bytes (disk full?)");
    p += n;
    length -= static_cast<size_t>(n);
  }
}

// Reads exactly `length` bytes at `offset`, looping over short reads and EINTR.
void pread_all(int fd, void* dst, size_t length, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (length > 0) {
    ssize_t n = ::pread(fd, p, std::min<size_t>(length, size_t{1} << 30), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(path, std::string("read failed: ") + std::strerror(errno));
    }
    if (n == 0)
      fail(path, "file truncated while reading (" + std::to_string(length) + " bytes missing at offset " +
                     std::to_string(offset) + ")");
    p += n;
    offset += static_cast<uint64_t>(n);
    length -= static_cast<size_t>(n);
  }
}

}  // namespace

// ---- dtypes -----------------------------------------------------------------------------------

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBool: return "BOOL";
    case at::kByte: return "U8";
    case at::kChar: return "I8";
    case at::kShort: return "I16";
    case at::kInt: return "I32";
    case at::kLong: return "I64";
    case at::kHalf: return "F16";
    case at::kBFloat16: return "BF16";
    case at::kFloat: return "F32";
    case at::kDouble: return "F64";
    default:
      throw SafetensorsError(std::string("dtype ") + c10::toString(dtype) +
                             " has no safetensors equivalent here (supported: BOOL U8 I8 I16 "
                             "I32 I64 F16 BF16 F32 F64)");
  }
}

at::ScalarType dtype_from_name(const std::string& name) {
  static const std::pair<const char*, at::ScalarType> kTable[] = {
      {"BOOL", at::kBool}, {"U8", at::kByte},  {"I8", at::kChar},       {"I16", at::kShort}, {"I32", at::kInt},
      {"I64", at::kLong},  {"F16", at::kHalf}, {"BF16", at::kBFloat16}, {"F32", at::kFloat}, {"F64", at::kDouble}};
  for (const auto& [n, t] : kTable)
    if (name == n) return t;
  throw SafetensorsError("unsupported dtype " + quoted(name) + " (supported: BOOL U8 I8 I16 I32 I64 F16 BF16 F32 F64)");
}

// ---- header -----------------------------------------------------------------------------------

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated by parse_header: cannot overflow
  return n;
}

const TensorEntry* Header::find(const std::string& name) const {
  for (const auto& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

namespace {

// Reads and bounds-checks the 8-byte little-endian header length prefix.
uint64_t read_header_length(const uint8_t* bytes, size_t size, uint64_t file_size, const std::string& source) {
  if (size < 8 || file_size < 8)
    fail(source, "truncated: " + std::to_string(std::min<uint64_t>(size, file_size)) +
                     " bytes, less than the 8-byte header length prefix");
  uint64_t n = 0;
  std::memcpy(&n, bytes, 8);  // little-endian host (static_assert above)
  if (n > kMaxHeaderBytes)
    fail(source, "header length " + std::to_string(n) + " exceeds the format's limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes (not a safetensors file?)");
  if (n > file_size - 8)
    fail(source, "truncated: header length " + std::to_string(n) + " but the file holds only " +
                     std::to_string(file_size - 8) + " bytes after the length prefix");
  if (size - 8 < n)
    fail(source,
         "truncated: only " + std::to_string(size) + " of the " + std::to_string(8 + n) + " header bytes were given");
  return n;
}

// The header text as a JSON object: strict UTF-8, no NUL byte, no duplicate key.
json parse_header_object(const uint8_t* text, uint64_t n, const std::string& source) {
  if (size_t bad = find_invalid_utf8(text, n); bad != std::string::npos)
    fail(source, "header is not valid UTF-8 (byte " + std::to_string(bad) + ")");

  // nlohmann stops at a NUL byte as if the input ended there; JSON never holds a raw NUL, and
  // ignoring what follows one would let two readers see different headers.
  if (const void* nul = std::memchr(text, 0, n))
    fail(source,
         "header is not valid JSON: NUL byte at offset " + std::to_string(static_cast<const uint8_t*>(nul) - text));
  json root = parse_json(reinterpret_cast<const char*>(text), reinterpret_cast<const char*>(text + n), source);
  if (!root.is_object()) fail(source, std::string("header is not a JSON object (got ") + root.type_name() + ")");
  return root;
}

void read_metadata(const json& value, Header& h, const std::string& source) {
  if (!value.is_object())
    fail(source, std::string("__metadata__ must be an object of strings, got ") + value.type_name());
  for (auto& [k, v] : value.items()) {
    if (!v.is_string()) fail(source, "__metadata__ value for " + quoted(k) + " must be a string, got " + v.type_name());
    h.metadata.emplace(k, v.get<std::string>());
  }
}

// The three fields of a tensor entry, each present and of the right JSON type.
struct EntryFields {
  const json& dtype;
  const json& shape;
  const json& offsets;
};

EntryFields entry_fields(const std::string& name, const json& value, const std::string& source) {
  if (!value.is_object()) fail_tensor(source, name, std::string("entry must be an object, got ") + value.type_name());
  auto dtype_it = value.find("dtype");
  auto shape_it = value.find("shape");
  auto offsets_it = value.find("data_offsets");
  if (dtype_it == value.end() || shape_it == value.end() || offsets_it == value.end())
    fail_tensor(source, name,
                "entry is missing field '" +
                    std::string(dtype_it == value.end()   ? "dtype"
                                : shape_it == value.end() ? "shape"
                                                          : "data_offsets") +
                    "'");
  if (!dtype_it->is_string())
    fail_tensor(source, name, std::string("dtype must be a string, got ") + dtype_it->type_name());
  if (!shape_it->is_array())
    fail_tensor(source, name, std::string("shape must be an array, got ") + shape_it->type_name());
  if (!offsets_it->is_array() || offsets_it->size() != 2)
    fail_tensor(source, name, "data_offsets must be an array of two integers [begin, end]");
  return {*dtype_it, *shape_it, *offsets_it};
}

// numel * element size with checked arithmetic. A zero dim makes the tensor empty whatever the
// other dims are, so it is checked first (no spurious overflow). Fills e.shape.
uint64_t read_shape_bytes(const json& shape, TensorEntry& e, const std::string& source) {
  const std::string& name = e.name;
  bool empty = false;
  e.shape.reserve(shape.size());
  for (const auto& d : shape) {
    uint64_t v = get_u64(d, source, name, "shape");
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail_tensor(source, name, "shape dimension " + std::to_string(v) + " is too large");
    e.shape.push_back(static_cast<int64_t>(v));
    empty = empty || v == 0;
  }
  uint64_t numel = empty ? 0 : 1;
  for (int64_t d : e.shape) {
    if (empty) break;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(d), &numel) ||
        numel > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      fail_tensor(source, name, "shape " + shape_str(e.shape) + " overflows the element count");
  }
  uint64_t need = 0;
  if (__builtin_mul_overflow(numel, element_size(e.dtype), &need))
    fail_tensor(source, name, "shape " + shape_str(e.shape) + " overflows the byte size");
  return need;
}

// Fills e.begin/e.end and checks they lie in the buffer and span exactly `need` bytes.
void read_offsets(const json& offsets, uint64_t need, uint64_t buffer_size, TensorEntry& e, const std::string& source) {
  const std::string& name = e.name;
  e.begin = get_u64(offsets[0], source, name, "data_offsets");
  e.end = get_u64(offsets[1], source, name, "data_offsets");
  const std::string range = "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) + ")";
  if (e.end < e.begin) fail_tensor(source, name, range + " end before begin");
  if (e.end > buffer_size)
    fail_tensor(source, name,
                range + " run beyond the data buffer of " + std::to_string(buffer_size) + " bytes (file truncated?)");
  if (e.end - e.begin != need)
    fail_tensor(source, name,
                range + " hold " + std::to_string(e.end - e.begin) + " bytes but " + dtype_name(e.dtype) + " shape " +
                    shape_str(e.shape) + " needs " + std::to_string(need));
}

TensorEntry parse_tensor_entry(const std::string& name, const json& value, uint64_t buffer_size,
                               const std::string& source) {
  const EntryFields fields = entry_fields(name, value, source);
  TensorEntry e;
  e.name = name;
  try {
    e.dtype = dtype_from_name(fields.dtype.get<std::string>());
  } catch (const SafetensorsError& err) {
    fail_tensor(source, name, err.what());
  }
  const uint64_t need = read_shape_bytes(fields.shape, e, source);
  read_offsets(fields.offsets, need, buffer_size, e, source);
  return e;
}

// Sorted by (begin, end): empty tensors sharing an offset with a real one come first. The
// entries must tile the buffer exactly from 0: no overlap (two tensors aliasing the same
// bytes), no hole and no trailing bytes (data nobody accounts for).
void check_tiling(std::vector<TensorEntry>& tensors, uint64_t buffer_size, const std::string& source) {
  std::sort(tensors.begin(), tensors.end(), [](const TensorEntry& a, const TensorEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t expected = 0;
  for (const auto& e : tensors) {
    if (e.begin < expected)
      fail_tensor(source, e.name,
                  "data_offsets [" + std::to_string(e.begin) + ", " + std::to_string(e.end) +
                      ") overlap the previous tensor " + "(which ends at " + std::to_string(expected) + ")");
    if (e.begin > expected)
      fail_tensor(source, e.name,
                  "data_offsets begin at " + std::to_string(e.begin) + " leaving a hole: the previous tensor ends at " +
                      std::to_string(expected));
    expected = e.end;
  }
  if (expected != buffer_size)
    fail(source, "data buffer holds " + std::to_string(buffer_size) + " bytes but the tensors " + "cover " +
                     std::to_string(expected) + " (trailing bytes after the last tensor)");
}

}  // namespace

Header parse_header(const uint8_t* bytes, size_t size, uint64_t file_size, const std::string& source) {
  const uint64_t n = read_header_length(bytes, size, file_size, source);
  json root = parse_header_object(bytes + 8, n, source);

  Header h;
  h.data_start = 8 + n;
  const uint64_t buffer_size = file_size - h.data_start;
  h.tensors.reserve(root.size());
  for (auto& [name, value] : root.items()) {
    if (name == kMetadataKey)
      read_metadata(value, h, source);
    else
      h.tensors.push_back(parse_tensor_entry(name, value, buffer_size, source));
  }
  check_tiling(h.tensors, buffer_size, source);
  return h;
}

// ---- reader -----------------------------------------------------------------------------------

Reader::Reader(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
  try {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) fail(path, "not a regular file");
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    if (file_size < 8)
      fail(path, "truncated: " + std::to_string(file_size) + " bytes, less than the 8-byte header length prefix");
    std::vector<uint8_t> buf(8);
    pread_all(fd_, buf.data(), 8, 0, path);
    uint64_t n = 0;
    std::memcpy(&n, buf.data(), 8);
    // Only read the header when its length is plausible; parse_header reports the rest.
    if (n <= kMaxHeaderBytes && n <= file_size - 8) {
      buf.resize(8 + n);
      pread_all(fd_, buf.data() + 8, n, 8, path);
    }
    header_ = parse_header(buf.data(), buf.size(), file_size, path);
  } catch (...) {
    ::close(fd_);
    fd_ = -1;
    throw;
  }
}

Reader::~Reader() {
  if (fd_ >= 0) ::close(fd_);
}

const TensorEntry& Reader::entry(const std::string& name) const {
  if (const TensorEntry* e = header_.find(name)) return *e;
  std::string present;
  size_t shown = 0;
  for (const auto& t : header_.tensors) {
    if (shown == 5) {
      present += ", ...";
      break;
    }
    present += (shown++ ? ", " : "") + quoted(t.name);
  }
  fail(path_, "no tensor " + quoted(name) + " in the file (it holds " + std::to_string(header_.tensors.size()) +
                  " tensors" + (present.empty() ? "" : ": " + present) + ")");
}

at::Tensor Reader::read(const std::string& name) const {
  const TensorEntry& e = entry(name);
  // Bools are read as bytes and normalised: a byte other than 0/1 in a bool tensor is undefined
  // behaviour in the kernels that consume it.
  const bool is_bool = e.dtype == at::kBool;
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(is_bool ? at::kByte : e.dtype));
  if (e.nbytes() > 0) read_bytes(name, 0, e.nbytes(), t.data_ptr());
  return is_bool ? t.ne(0) : t;
}

void Reader::read_bytes(const std::string& name, uint64_t offset, uint64_t length, void* dst) const {
  const TensorEntry& e = entry(name);
  if (offset > e.nbytes() || length > e.nbytes() - offset)
    fail(path_, "tensor " + quoted(name) + ": byte range [" + std::to_string(offset) + ", +" + std::to_string(length) +
                    ") is outside its " + std::to_string(e.nbytes()) + " bytes");
  if (length == 0) return;
  pread_all(fd_, dst, length, header_.data_start + e.begin + offset, path_);
}

// ---- writer -----------------------------------------------------------------------------------

StreamWriter::StreamWriter(const std::string& path, const std::vector<TensorSpec>& specs,
                           const std::map<std::string, std::string>& metadata)
    : path_(path), specs_(specs) {
  // Validate and encode the whole header before the file is touched.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& spec : specs_) {
    if (spec.name == kMetadataKey) fail(path, "tensor name '__metadata__' is reserved by the format");
    if (!names.insert(spec.name).second) fail(path, "duplicate tensor name " + quoted(spec.name));
    std::string dtype;
    try {
      dtype = dtype_name(spec.dtype);
    } catch (const SafetensorsError& err) {
      fail_tensor(path, spec.name, err.what());
    }
    uint64_t nbytes = element_size(spec.dtype);
    for (int64_t d : spec.shape) {
      if (d < 0 || __builtin_mul_overflow(nbytes, static_cast<uint64_t>(d), &nbytes))
        fail_tensor(path, spec.name, "shape " + shape_str(spec.shape) + " is negative or too large");
    }
    header[spec.name] = {{"dtype", dtype}, {"shape", spec.shape}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text;
  try {
    text = header.dump();  // compact; throws on names or metadata that are not valid UTF-8
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("cannot encode the header: ") + e.what());
  }
  // Pad with spaces (valid JSON whitespace) so the data buffer starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  std::string prefix(8, '\0');
  std::memcpy(prefix.data(), &n, 8);

  fd_ = ::open(path.c_str(), O_CREAT | O_TRUNC | O_WRONLY | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(path, std::string("cannot create: ") + std::strerror(errno));
  write_all(fd_, prefix.data(), prefix.size(), path);
  write_all(fd_, text.data(), text.size(), path);
}

StreamWriter::~StreamWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void StreamWriter::append(const at::Tensor& tensor) {
  if (fd_ < 0) fail(path_, "append after the file was finished or failed");
  if (next_ >= specs_.size())
    fail(path_, "more tensors appended than the " + std::to_string(specs_.size()) + " declared");
  const TensorSpec& spec = specs_[next_];
  if (!tensor.defined() || tensor.layout() != at::kStrided)
    fail_tensor(path_, spec.name, "undefined or non-dense tensor");
  if (tensor.scalar_type() != spec.dtype || tensor.sizes().vec() != spec.shape)
    fail_tensor(path_, spec.name,
                "appended tensor is " + dtype_name(tensor.scalar_type()) + " " + shape_str(tensor.sizes().vec()) +
                    " but the header declared " + dtype_name(spec.dtype) + " " + shape_str(spec.shape));
  const at::Tensor t = tensor.to(at::kCPU).contiguous();
  write_all(fd_, t.data_ptr(), static_cast<size_t>(t.numel()) * t.element_size(), path_);
  ++next_;
}

void StreamWriter::finish() {
  if (fd_ < 0) fail(path_, "finish after the file was finished or failed");
  if (next_ != specs_.size())
    fail(path_, "only " + std::to_string(next_) + " of the " + std::to_string(specs_.size()) +
                    " declared tensors were appended");
  const int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path_, std::string("fsync failed: ") + std::strerror(err));
  }
  // close can report a deferred write error (NFS and friends).
  if (::close(fd) != 0) fail(path_, std::string("close failed: ") + std::strerror(errno));
}

void write_file(const std::string& path, const std::vector<NamedTensor>& tensors,
                const std::map<std::string, std::string>& metadata) {
  std::vector<TensorSpec> specs;
  specs.reserve(tensors.size());
  for (const auto& nt : tensors) {
    if (!nt.tensor.defined()) fail_tensor(path, nt.name, "undefined tensor");
    if (nt.tensor.layout() != at::kStrided) fail_tensor(path, nt.name, "only dense (strided) tensors can be written");
    specs.push_back({nt.name, nt.tensor.scalar_type(), nt.tensor.sizes().vec()});
  }
  StreamWriter writer(path, specs, metadata);
  for (const auto& nt : tensors) writer.append(nt.tensor);
  writer.finish();
}

// ---- crc32 ------------------------------------------------------------------------------------

uint32_t crc32(const void* data, size_t length, uint32_t crc) {
  const auto* p = static_cast<const Bytef*>(data);
  uLong c = crc;
  // zlib takes a uInt length: feed ranges over 4 GiB in chunks.
  while (length > 0) {
    const uInt chunk = static_cast<uInt>(std::min<size_t>(length, size_t{1} << 30));
    c = ::crc32(c, p, chunk);
    p += chunk;
    length -= chunk;
  }
  return static_cast<uint32_t>(c);
}

}  // namespace fsdp::safetensors
