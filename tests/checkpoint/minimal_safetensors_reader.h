#pragma once
// An independent, minimal safetensors reader for tests: it shares no code with
// fsdp::safetensors (own file reading, own tiny JSON parser), so a file our writer produces and
// this reader accepts is evidence the layout follows the format, not just that the writer and
// the reader agree with each other. Deliberately small; it trusts its input more than the real
// reader and throws std::runtime_error on anything it does not understand.
//
//   std::map<std::string, std::string> meta;
//   auto tensors = minimal_read_safetensors("x.safetensors", &meta);
//   tensors.at("w").dtype == "F32"; tensors.at("w").shape; tensors.at("w").bytes;
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

struct MinimalTensor {
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // the tensor's raw little-endian data
  uint64_t data_begin = 0;     // offsets as written in the header (relative to the buffer)
  uint64_t data_end = 0;
};

namespace minimal_safetensors_detail {

// A JSON value reduced to what the format uses: objects, arrays, strings, integers.
struct Value {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  int64_t number = 0;
  std::string str;
  std::vector<Value> items;
  std::vector<std::pair<std::string, Value>> members;  // in file order
};

class Parser {
 public:
  explicit Parser(const std::string& s) : s_(s) {}
  Value parse_document() {
    Value v = value();
    ws();
    if (i_ != s_.size()) error("trailing characters");
    return v;
  }

 private:
  [[noreturn]] void error(const std::string& what) {
    throw std::runtime_error("minimal_read_safetensors: JSON " + what + " at " + std::to_string(i_));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) error("unexpected end");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) error(std::string("expected '") + c + "'");
    ++i_;
  }
  static void put_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }
  uint32_t hex4() {
    if (s_.size() - i_ < 4) error("short \\u escape");
    uint32_t v = std::stoul(s_.substr(i_, 4), nullptr, 16);
    i_ += 4;
    return v;
  }
  std::string string() {
    expect('"');
    std::string out;
    while (true) {
      if (i_ >= s_.size()) error("unterminated string");
      char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) error("unterminated escape");
      char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && s_.compare(i_, 2, "\\u") == 0) {  // surrogate pair
            i_ += 2;
            cp = 0x10000 + ((cp - 0xD800) << 10) + (hex4() - 0xDC00);
          }
          put_utf8(out, cp);
          break;
        }
        default: error("bad escape");
      }
    }
  }
  Value value() {
    Value v;
    char c = peek();
    if (c == '{') {
      v.kind = Value::Object;
      ++i_;
      if (peek() == '}') {
        ++i_;
        return v;
      }
      while (true) {
        std::string key = string();
        expect(':');
        v.members.emplace_back(std::move(key), value());
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      v.kind = Value::Array;
      ++i_;
      if (peek() == ']') {
        ++i_;
        return v;
      }
      while (true) {
        v.items.push_back(value());
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') {
      v.kind = Value::String;
      v.str = string();
      return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) {  // the format only has integers
      size_t start = i_++;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      v.kind = Value::Number;
      v.number = std::stoll(s_.substr(start, i_ - start));
      return v;
    }
    for (const char* lit : {"true", "false", "null"}) {
      if (s_.compare(i_, std::strlen(lit), lit) == 0) {
        i_ += std::strlen(lit);
        v.kind = lit[0] == 'n' ? Value::Null : Value::Bool;
        return v;
      }
    }
    error("unexpected character");
  }

  const std::string& s_;
  size_t i_ = 0;
};

inline const Value& member(const Value& obj, const std::string& key) {
  for (const auto& [k, v] : obj.members)
    if (k == key) return v;
  throw std::runtime_error("minimal_read_safetensors: missing field " + key);
}

}  // namespace minimal_safetensors_detail

// Reads every tensor of a safetensors file; `metadata` (optional) receives "__metadata__".
inline std::map<std::string, MinimalTensor> minimal_read_safetensors(
    const std::string& path, std::map<std::string, std::string>* metadata = nullptr) {
  namespace d = minimal_safetensors_detail;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("minimal_read_safetensors: cannot open " + path);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (file.size() < 8) throw std::runtime_error("minimal_read_safetensors: file too short");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(file[i]);  // explicit LE
  if (n > file.size() - 8) throw std::runtime_error("minimal_read_safetensors: header too long");
  const std::string text = file.substr(8, n);
  const size_t data_start = 8 + n;

  const d::Value root = d::Parser(text).parse_document();
  if (root.kind != d::Value::Object) throw std::runtime_error("minimal_read_safetensors: not an object");
  std::map<std::string, MinimalTensor> out;
  for (const auto& [name, v] : root.members) {
    if (name == "__metadata__") {
      if (metadata)
        for (const auto& [k, s] : v.members) (*metadata)[k] = s.str;
      continue;
    }
    MinimalTensor t;
    t.dtype = d::member(v, "dtype").str;
    for (const auto& dim : d::member(v, "shape").items) t.shape.push_back(dim.number);
    const auto& offsets = d::member(v, "data_offsets").items;
    if (offsets.size() != 2) throw std::runtime_error("minimal_read_safetensors: bad data_offsets");
    t.data_begin = static_cast<uint64_t>(offsets[0].number);
    t.data_end = static_cast<uint64_t>(offsets[1].number);
    if (t.data_end < t.data_begin || data_start + t.data_end > file.size())
      throw std::runtime_error("minimal_read_safetensors: data_offsets outside the file");
    t.bytes.assign(file.begin() + data_start + t.data_begin, file.begin() + data_start + t.data_end);
    out.emplace(name, std::move(t));
  }
  return out;
}
