// Tests of the safetensors format layer: round trips of every dtype, partial reads, the exact
// on-disk layout (checked by an independent reader), one test per validation rule of
// parse_header, writer errors, crc32, and a replay of the fuzzer's corpus.
#include "checkpoint/safetensors_format.h"  // the parser and crc32 (src/: internals)

#include "minimal_safetensors_reader.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace st = fsdp::safetensors;
namespace fs = std::filesystem;

namespace {

// A fresh temporary directory per test, removed afterwards.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "fsdp_safetensors_XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_raw(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A file image: u64 length prefix (optionally lying), the header text, then `buffer` zero bytes.
std::vector<uint8_t> image(const std::string& header, uint64_t buffer, int64_t prefix = -1) {
  // Sized once, then filled: growing a vector here trips a GCC 12 false -Wstringop-overread.
  std::vector<uint8_t> out(8 + header.size() + buffer, 0);
  const uint64_t n = prefix < 0 ? header.size() : static_cast<uint64_t>(prefix);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  if (!header.empty()) std::memcpy(out.data() + 8, header.data(), header.size());
  return out;
}

st::Header parse(const std::vector<uint8_t>& bytes) {
  return st::parse_header(bytes.data(), bytes.size(), bytes.size(), "ckpt/rank0.safetensors");
}

// Every supported dtype with distinctive values, plus 0-d and empty tensors.
std::vector<st::NamedTensor> sample_tensors() {
  auto ramp = [](at::ScalarType dt, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return torch::arange(n, torch::kDouble).sub(n / 2).mul(0.75).to(dt).reshape(shape);
  };
  return {
      {"bool", torch::tensor({true, false, true, true}).reshape({2, 2})},
      {"u8", ramp(at::kDouble, {5}).abs().to(at::kByte)},
      {"i8", ramp(at::kChar, {3, 2})},
      {"i16", ramp(at::kShort, {4})},
      {"i32", ramp(at::kInt, {2, 3, 2})},
      {"i64", torch::tensor({int64_t{1} << 40, int64_t{-7}, int64_t{0}})},
      {"f16", ramp(at::kHalf, {3, 3})},
      {"bf16", ramp(at::kBFloat16, {7})},
      {"f32", ramp(at::kFloat, {2, 5})},
      {"f64", ramp(at::kDouble, {1, 1, 3})},
      {"scalar", torch::tensor(3.5, torch::kFloat)},                      // 0-d
      {"empty", torch::empty({0}, torch::kFloat)},                        // numel 0
      {"empty2d", torch::empty({4, 0}, torch::kBFloat16)},                // numel 0, non-trivial shape
      {"noncontig", torch::arange(12, torch::kInt).reshape({3, 4}).t()},  // written contiguous
  };
}

void expect_phrase(const std::vector<uint8_t>& bytes, const std::string& phrase) {
  try {
    parse(bytes);
    ADD_FAILURE() << "accepted a malformed header; expected an error containing: " << phrase;
  } catch (const st::SafetensorsError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(phrase), std::string::npos) << "message: " << msg << "\nwanted: " << phrase;
    EXPECT_EQ(msg.rfind("ckpt/rank0.safetensors: ", 0), 0u) << "message must name the source: " << msg;
  }
}

}  // namespace

// ---- round trips --------------------------------------------------------------------------------

TEST(Safetensors, RoundTripEveryDtype) {
  TempDir dir;
  const auto tensors = sample_tensors();
  const std::map<std::string, std::string> meta = {{"format", "pt"}, {"step", "42"}, {"ünï", "çødé"}};
  st::write_file(dir.file("a.safetensors"), tensors, meta);

  st::Reader r(dir.file("a.safetensors"));
  EXPECT_EQ(r.header().metadata, meta);
  EXPECT_EQ(r.header().data_start % 8, 0u);
  ASSERT_EQ(r.header().tensors.size(), tensors.size());
  for (size_t i = 1; i < r.header().tensors.size(); ++i)
    EXPECT_LE(r.header().tensors[i - 1].end, r.header().tensors[i].begin) << "sorted by begin";
  for (const auto& nt : tensors) {
    SCOPED_TRACE(nt.name);
    const st::TensorEntry& e = r.entry(nt.name);
    EXPECT_EQ(e.dtype, nt.tensor.scalar_type());
    EXPECT_EQ(e.shape, nt.tensor.sizes().vec());
    EXPECT_EQ(e.numel(), nt.tensor.numel());
    EXPECT_EQ(e.nbytes(), static_cast<uint64_t>(nt.tensor.numel()) * nt.tensor.element_size());
    at::Tensor t = r.read(nt.name);
    EXPECT_EQ(t.scalar_type(), nt.tensor.scalar_type());
    EXPECT_EQ(t.sizes(), nt.tensor.sizes());
    EXPECT_TRUE(t.is_contiguous());
    EXPECT_TRUE(t.device().is_cpu());
    EXPECT_TRUE(torch::equal(t, nt.tensor));
  }
}

TEST(Safetensors, EmptyFileAndMetadataOnly) {
  TempDir dir;
  st::write_file(dir.file("e.safetensors"), {});
  st::Reader r(dir.file("e.safetensors"));
  EXPECT_TRUE(r.header().tensors.empty());
  EXPECT_TRUE(r.header().metadata.empty());

  st::write_file(dir.file("m.safetensors"), {}, {{"k", "v"}});
  st::Reader m(dir.file("m.safetensors"));
  EXPECT_EQ(m.header().metadata.at("k"), "v");
}

TEST(Safetensors, ReadBytesPartialRanges) {
  TempDir dir;
  at::Tensor w = torch::arange(10, torch::kInt);
  st::write_file(dir.file("p.safetensors"), {{"a", torch::ones({3})}, {"w", w}});
  st::Reader r(dir.file("p.safetensors"));
  const int32_t* src = w.data_ptr<int32_t>();
  for (uint64_t off : {0, 4, 12, 36}) {
    for (uint64_t len : {0, 4, 8}) {
      if (off + len > 40) continue;
      std::vector<uint8_t> buf(len + 1, 0xAB);
      r.read_bytes("w", off, len, buf.data());
      EXPECT_EQ(std::memcmp(buf.data(), reinterpret_cast<const uint8_t*>(src) + off, len), 0);
      EXPECT_EQ(buf[len], 0xAB) << "wrote past the requested length";
    }
  }
  std::vector<uint8_t> whole(40);
  r.read_bytes("w", 0, 40, whole.data());
  EXPECT_EQ(std::memcmp(whole.data(), src, 40), 0);

  uint8_t b[64];
  EXPECT_THROW(r.read_bytes("w", 0, 41, b), st::SafetensorsError);
  EXPECT_THROW(r.read_bytes("w", 41, 0, b), st::SafetensorsError);
  EXPECT_THROW(r.read_bytes("w", 36, 8, b), st::SafetensorsError);
  // offset + length wraps around 2^64: must be caught, not read.
  EXPECT_THROW(r.read_bytes("w", 8, UINT64_MAX - 4, b), st::SafetensorsError);
  EXPECT_THROW(r.read_bytes("w", UINT64_MAX, 2, b), st::SafetensorsError);
  try {
    r.read_bytes("w", 36, 8, b);
  } catch (const st::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("outside its 40 bytes"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, MissingTensorListsPresentNames) {
  TempDir dir;
  st::write_file(dir.file("n.safetensors"), {{"alpha", torch::ones({1})}, {"beta", torch::ones({1})}});
  st::Reader r(dir.file("n.safetensors"));
  EXPECT_EQ(r.header().find("gamma"), nullptr);
  try {
    r.read("gamma");
    FAIL() << "read of an absent tensor succeeded";
  } catch (const st::SafetensorsError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("no tensor 'gamma'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'alpha'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir.file("n.safetensors")), std::string::npos) << msg;
  }
}

TEST(Safetensors, BoolBytesAreNormalised) {
  TempDir dir;
  const std::string h = R"({"b":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})";
  auto bytes = image(h, 0);
  bytes.push_back(0);
  bytes.push_back(2);  // not a valid bool byte: read as true
  bytes.push_back(1);
  write_raw(dir.file("b.safetensors"), bytes);
  st::Reader r(dir.file("b.safetensors"));
  at::Tensor t = r.read("b");
  ASSERT_EQ(t.scalar_type(), at::kBool);
  const uint8_t* raw = reinterpret_cast<const uint8_t*>(t.data_ptr());
  EXPECT_EQ(raw[0], 0);
  EXPECT_EQ(raw[1], 1);
  EXPECT_EQ(raw[2], 1);
}

// ---- layout, checked without our own parser -----------------------------------------------------

TEST(Safetensors, IndependentReaderAgrees) {
  TempDir dir;
  const auto tensors = sample_tensors();
  const std::map<std::string, std::string> meta = {{"note", "quote \" backslash \\ tab \t"}};
  st::write_file(dir.file("x.safetensors"), tensors, meta);

  std::map<std::string, std::string> got_meta;
  auto got = minimal_read_safetensors(dir.file("x.safetensors"), &got_meta);
  EXPECT_EQ(got_meta, meta);
  ASSERT_EQ(got.size(), tensors.size());
  uint64_t expected_begin = 0;
  for (const auto& nt : tensors) {  // written in the given order, back to back
    SCOPED_TRACE(nt.name);
    const MinimalTensor& t = got.at(nt.name);
    EXPECT_EQ(t.dtype, st::dtype_name(nt.tensor.scalar_type()));
    EXPECT_EQ(t.shape, nt.tensor.sizes().vec());
    at::Tensor c = nt.tensor.contiguous();
    ASSERT_EQ(t.bytes.size(), static_cast<size_t>(c.numel()) * c.element_size());
    if (!t.bytes.empty()) {  // memcmp's pointers must not be null, even for no bytes (an empty tensor has none)
      EXPECT_EQ(std::memcmp(t.bytes.data(), c.data_ptr(), t.bytes.size()), 0);
    }
    EXPECT_EQ(t.data_begin, expected_begin);
    expected_begin = t.data_end;
  }
}

TEST(Safetensors, ByteExactLayout) {
  TempDir dir;
  st::write_file(dir.file("l.safetensors"), {{"w", torch::tensor({1.0f, -2.0f})}});
  const auto bytes = read_all(dir.file("l.safetensors"));
  const std::string json = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const size_t padded = (json.size() + 7) / 8 * 8;
  ASSERT_EQ(bytes.size(), 8 + padded + 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  EXPECT_EQ(n, padded);
  EXPECT_EQ((8 + n) % 8, 0u) << "data buffer must start 8-byte aligned";
  EXPECT_EQ(std::string(bytes.begin() + 8, bytes.begin() + 8 + json.size()), json);
  for (size_t i = 8 + json.size(); i < 8 + padded; ++i) EXPECT_EQ(bytes[i], ' ') << "padding byte " << i;
  const float expect[2] = {1.0f, -2.0f};
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + padded, expect, 8), 0);
}

// ---- validation: one case per rule ---------------------------------------------------------------

TEST(SafetensorsHeader, AcceptsValidEdgeCases) {
  // Empty header, padding, empty tensors sharing an offset with real ones, 0-d tensors.
  EXPECT_TRUE(parse(image("{}", 0)).tensors.empty());
  EXPECT_TRUE(parse(image("{}      ", 0)).tensors.empty());
  auto h = parse(image(R"({"z":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4]},)"
                       R"("s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                       R"("t":{"dtype":"I8","shape":[2],"data_offsets":[4,6]},)"
                       R"("e":{"dtype":"U8","shape":[0],"data_offsets":[6,6]},)"
                       R"("__metadata__":{"a":"b"}})",
                       6));
  ASSERT_EQ(h.tensors.size(), 4u);
  EXPECT_EQ(h.tensors[0].name, "s");
  EXPECT_EQ(h.tensors[1].name, "z");
  EXPECT_EQ(h.tensors[2].name, "t");
  EXPECT_EQ(h.tensors[3].name, "e");
  EXPECT_EQ(h.metadata.at("a"), "b");
  ASSERT_NE(h.find("t"), nullptr);
  EXPECT_EQ(h.find("t")->dtype, at::kChar);
  EXPECT_EQ(h.find("s")->numel(), 1);
  // A zero dim makes the tensor empty even when the other dims are huge.
  EXPECT_NO_THROW(parse(
      image(R"({"x":{"dtype":"F64","shape":[4611686018427387904,4611686018427387904,0],"data_offsets":[0,0]}})", 0)));
}

TEST(SafetensorsHeader, RejectsMalformed) {
  const std::string ok_entry = R"("dtype":"F32","shape":[2,2],"data_offsets":[0,16])";
  auto one = [](const std::string& body) { return "{\"w\":{" + body + "}}"; };
  struct Case {
    const char* what;
    std::vector<uint8_t> bytes;
    std::string phrase;
  };
  const std::vector<Case> cases = {
      {"shorter than the prefix", {1, 2, 3}, "truncated"},
      {"empty", {}, "truncated"},
      {"prefix beyond file", image("{}", 0, 100), "truncated"},
      {"prefix over the limit", image("{}", 0, int64_t{200'000'000}), "exceeds the format's limit"},
      {"prefix huge", image("{}", 0, INT64_MAX), "exceeds the format's limit"},
      {"empty header", image("", 0), "not valid JSON"},
      {"bad json", image("{\"w\":", 0), "not valid JSON"},
      {"garbage after json", image("{}x", 0), "not valid JSON"},
      {"nul padding", image(std::string("{}\0\0", 4), 0), "not valid JSON"},
      {"not an object", image("[1,2]", 0), "not a JSON object"},
      {"string root", image("\"x\"", 0), "not a JSON object"},
      {"bad utf8", image("{\"\xff\":1}", 0), "not valid UTF-8"},
      {"overlong utf8", image("{\"\xc0\xaf\":1}", 0), "not valid UTF-8"},
      {"entry not object", image(R"({"w":[1]})", 0), "tensor 'w': entry must be an object"},
      {"missing dtype", image(one(R"("shape":[1],"data_offsets":[0,4])"), 4), "missing field 'dtype'"},
      {"missing shape", image(one(R"("dtype":"F32","data_offsets":[0,4])"), 4), "missing field 'shape'"},
      {"missing offsets", image(one(R"("dtype":"F32","shape":[1])"), 4), "missing field 'data_offsets'"},
      {"dtype not string", image(one(R"("dtype":1,"shape":[1],"data_offsets":[0,4])"), 4), "dtype must be a string"},
      {"shape not array", image(one(R"("dtype":"F32","shape":1,"data_offsets":[0,4])"), 4), "shape must be an array"},
      {"offsets not pair", image(one(R"("dtype":"F32","shape":[1],"data_offsets":[0])"), 4),
       "data_offsets must be an array of two"},
      {"offsets not array", image(one(R"("dtype":"F32","shape":[1],"data_offsets":4)"), 4),
       "data_offsets must be an array of two"},
      {"shape float", image(one(R"("dtype":"F32","shape":[1.5],"data_offsets":[0,4])"), 4),
       "shape must hold non-negative integers"},
      {"shape string", image(one(R"("dtype":"F32","shape":["1"],"data_offsets":[0,4])"), 4),
       "shape must hold non-negative integers"},
      {"offset float", image(one(R"("dtype":"F32","shape":[1],"data_offsets":[0,4.0])"), 4),
       "data_offsets must hold non-negative integers"},
      {"offset negative", image(one(R"("dtype":"F32","shape":[1],"data_offsets":[-4,0])"), 4),
       "data_offsets holds negative value -4"},
      {"unknown dtype", image(one(R"("dtype":"C64","shape":[1],"data_offsets":[0,8])"), 8), "unsupported dtype 'C64'"},
      {"negative shape", image(one(R"("dtype":"F32","shape":[-1],"data_offsets":[0,4])"), 4),
       "shape holds negative value -1"},
      {"numel overflow", image(one(R"("dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1])"), 1),
       "overflows the element count"},
      {"numel over int64", image(one(R"("dtype":"U8","shape":[9223372036854775807,2],"data_offsets":[0,1])"), 1),
       "overflows the element count"},
      {"bytes overflow", image(one(R"("dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,1])"), 1),
       "overflows the byte size"},
      {"dim over int64", image(one(R"("dtype":"U8","shape":[9223372036854775808],"data_offsets":[0,1])"), 1),
       "too large"},
      {"end before begin", image(one(R"("dtype":"F32","shape":[0],"data_offsets":[8,4])"), 8), "end before begin"},
      {"size mismatch", image(one(R"("dtype":"F32","shape":[2,2],"data_offsets":[0,12])"), 12),
       "tensor 'w': data_offsets [0, 12) hold 12 bytes but F32 shape [2, 2] needs 16"},
      {"beyond buffer", image(one(ok_entry), 8), "beyond the data buffer of 8 bytes"},
      {"trailing bytes", image(one(ok_entry), 20), "trailing bytes"},
      {"hole at start", image(one(R"("dtype":"F32","shape":[1],"data_offsets":[4,8])"), 8), "leaving a hole"},
      {"hole between",
       image(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
           12),
       "tensor 'b': data_offsets begin at 8 leaving a hole"},
      {"overlap",
       image(
           R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           8),
       "overlap"},
      {"aliasing",
       image(
           R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})",
           4),
       "overlap"},
      {"duplicate tensor",
       image(
           R"({"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
           8),
       "duplicate key 'w'"},
      {"duplicate field", image(one(R"("dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4])"), 4),
       "duplicate key 'dtype'"},
      {"duplicate metadata", image(R"({"__metadata__":{"k":"a","k":"b"}})", 0), "duplicate key 'k'"},
      {"metadata value", image(R"({"__metadata__":{"k":1}})", 0), "__metadata__ value for 'k' must be a string"},
      {"metadata not object", image(R"({"__metadata__":["k"]})", 0), "__metadata__ must be an object"},
      {"deep nesting", image("{\"w\":{\"x\":" + std::string(40, '[') + std::string(40, ']') + "}}", 0), "nests deeper"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    expect_phrase(c.bytes, c.phrase);
  }
}

TEST(SafetensorsHeader, TooFewBytesGiven) {
  // The caller passed less than 8 + N bytes of a longer file: an error, never an overread.
  auto bytes = image(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1);
  try {
    st::parse_header(bytes.data(), 20, bytes.size(), "f");
    FAIL();
  } catch (const st::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("were given"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsReader, RejectsBadFiles) {
  TempDir dir;
  EXPECT_THROW(st::Reader(dir.file("absent.safetensors")), st::SafetensorsError);
  write_raw(dir.file("short"), {1, 2});
  EXPECT_THROW(st::Reader(dir.file("short")), st::SafetensorsError);
  write_raw(dir.file("huge_prefix"), image("{}", 0, INT64_MAX));
  EXPECT_THROW(st::Reader(dir.file("huge_prefix")), st::SafetensorsError);

  // A file cut after its header: the header claims bytes the file no longer holds.
  st::write_file(dir.file("cut.safetensors"), {{"w", torch::ones({16})}});
  auto bytes = read_all(dir.file("cut.safetensors"));
  bytes.resize(bytes.size() - 10);
  write_raw(dir.file("cut.safetensors"), bytes);
  try {
    st::Reader r(dir.file("cut.safetensors"));
    FAIL();
  } catch (const st::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("beyond the data buffer"), std::string::npos) << e.what();
  }
}

TEST(SafetensorsReader, TruncatedWhileOpen) {
  TempDir dir;
  const std::string path = dir.file("t.safetensors");
  st::write_file(path, {{"w", torch::ones({16})}});
  st::Reader r(path);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(r.header().data_start + 8)), 0);
  try {
    r.read("w");
    FAIL();
  } catch (const st::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("file truncated while reading"), std::string::npos) << e.what();
  }
}

// ---- writer errors -----------------------------------------------------------------------------

TEST(SafetensorsWriter, RejectsBadInput) {
  TempDir dir;
  const std::string p = dir.file("w.safetensors");
  EXPECT_THROW(st::write_file(p, {{"a", torch::ones({1})}, {"a", torch::ones({1})}}), st::SafetensorsError);
  EXPECT_THROW(st::write_file(p, {{"__metadata__", torch::ones({1})}}), st::SafetensorsError);
  EXPECT_THROW(st::write_file(p, {{"c", torch::ones({1}, torch::kComplexFloat)}}), st::SafetensorsError);
  EXPECT_THROW(st::write_file(p, {{"u", at::Tensor()}}), st::SafetensorsError);
  EXPECT_THROW(st::write_file(p, {{std::string("bad\xff"), torch::ones({1})}}), st::SafetensorsError);
  try {
    st::write_file(dir.file("no/such/dir/x.safetensors"), {});
    FAIL();
  } catch (const st::SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, DtypeNames) {
  for (const char* n : {"BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64"})
    EXPECT_EQ(st::dtype_name(st::dtype_from_name(n)), n);
  EXPECT_THROW(st::dtype_from_name("F8_E4M3"), st::SafetensorsError);
  EXPECT_THROW(st::dtype_name(at::kComplexDouble), st::SafetensorsError);
}

TEST(Safetensors, Crc32) {
  const char* s = "123456789";
  EXPECT_EQ(st::crc32(s, 9), 0xCBF43926u);                       // the standard check value
  EXPECT_EQ(st::crc32(s + 4, 5, st::crc32(s, 4)), 0xCBF43926u);  // chaining
  EXPECT_EQ(st::crc32(nullptr, 0), 0u);
}

// ---- fuzz corpus replay --------------------------------------------------------------------------

TEST(SafetensorsCorpus, NoCrash) {
  // Every input the fuzzer kept must parse or fail with SafetensorsError (any other exception, a
  // crash or a sanitizer report is a regression). The floor catches an emptied corpus.
  size_t files = 0, accepted = 0;
  for (const auto& e : fs::directory_iterator(FSDP_FUZZ_CORPUS_DIR)) {
    if (!e.is_regular_file()) continue;
    ++files;
    const auto bytes = read_all(e.path().string());
    try {
      st::Header h = st::parse_header(bytes.data(), bytes.size(), bytes.size(), e.path().string());
      for (const auto& t : h.tensors) EXPECT_EQ(h.find(t.name), &t);
      ++accepted;
    } catch (const st::SafetensorsError&) {
    } catch (const std::exception& ex) {
      ADD_FAILURE() << e.path() << ": not a SafetensorsError: " << ex.what();
    }
  }
  EXPECT_GE(files, 20u) << "fuzz corpus " << FSDP_FUZZ_CORPUS_DIR << " is (nearly) empty";
  EXPECT_GE(accepted, 3u) << "corpus holds too few valid files to seed the fuzzer";
}

// The streaming writer: header up front, tensors appended one by one, checked against the header.
TEST(SafetensorsStreamWriter, AppendsInOrderAndChecksEachTensor) {
  const std::string path = ::testing::TempDir() + "stream_writer.safetensors";
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3}), b = at::arange(4, at::kLong);
  {
    fsdp::safetensors::StreamWriter w(path, {{"a", at::kFloat, {2, 3}}, {"b", at::kLong, {4}}}, {{"k", "v"}});
    w.append(a);
    w.append(b);
    w.finish();
  }
  fsdp::safetensors::Reader r(path);
  EXPECT_TRUE(at::equal(r.read("a"), a));
  EXPECT_TRUE(at::equal(r.read("b"), b));
  EXPECT_EQ(r.header().metadata.at("k"), "v");

  fsdp::safetensors::StreamWriter w(path, {{"a", at::kFloat, {2, 3}}, {"b", at::kLong, {4}}});
  EXPECT_THROW(w.append(b), fsdp::safetensors::SafetensorsError);  // declared F32 [2, 3]
  w.append(a);
  EXPECT_THROW(w.finish(), fsdp::safetensors::SafetensorsError);  // 'b' never appended
}
