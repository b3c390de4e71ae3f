#include "fsdp/data/piece_decoder.h"

#include <fstream>
#include <sstream>

#include "fsdp/data/token_shards.h"

namespace fsdp::data {
namespace {

// Protobuf's wire format, just enough for ModelProto.pieces: a varint, and skipping a field.
struct Wire {
  const unsigned char* p;
  const unsigned char* end;
  bool ok = true;

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && p < end; shift += 7) {
      const unsigned char b = *p++;
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    ok = false;
    return 0;
  }
  // The bytes of a length-delimited field.
  std::string_view bytes() {
    const uint64_t n = varint();
    if (!ok || n > static_cast<uint64_t>(end - p)) {
      ok = false;
      return {};
    }
    std::string_view s(reinterpret_cast<const char*>(p), n);
    p += n;
    return s;
  }
  void skip(uint32_t wire_type) {
    switch (wire_type) {
      case 0: varint(); break;
      case 1: p = end - p >= 8 ? p + 8 : (ok = false, end); break;
      case 2: bytes(); break;
      case 5: p = end - p >= 4 ? p + 4 : (ok = false, end); break;
      default: ok = false;
    }
  }
};

}  // namespace

PieceDecoder PieceDecoder::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read tokenizer '" + path + "' (give a SentencePiece tokenizer.model file)");
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string data = buf.str();
  PieceDecoder dec;
  Wire w{reinterpret_cast<const unsigned char*>(data.data()),
         reinterpret_cast<const unsigned char*>(data.data()) + data.size()};
  while (w.ok && w.p < w.end) {
    const uint64_t key = w.varint();
    if (key == ((1 << 3) | 2)) {  // ModelProto field 1: repeated SentencePiece
      const std::string_view msg = w.bytes();
      Wire m{reinterpret_cast<const unsigned char*>(msg.data()),
             reinterpret_cast<const unsigned char*>(msg.data()) + msg.size()};
      Piece piece;
      while (m.ok && m.p < m.end) {
        const uint64_t k = m.varint();
        if (k == ((1 << 3) | 2)) {
          piece.text = std::string(m.bytes());
        } else if (k == ((3 << 3) | 0)) {  // type: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
          const uint64_t t = m.varint();
          piece.kind = t == 2             ? Kind::kUnknown
                       : t == 3 || t == 5 ? Kind::kControl
                       : t == 6           ? Kind::kByte
                                          : Kind::kNormal;
        } else {
          m.skip(static_cast<uint32_t>(k & 7));
        }
      }
      if (!m.ok) w.ok = false;
      if (piece.kind == Kind::kByte && piece.text.size() == 6) {  // "<0xNN>"
        piece.byte = static_cast<unsigned char>(std::stoi(piece.text.substr(3, 2), nullptr, 16));
      }
      dec.pieces_.push_back(std::move(piece));
    } else {
      w.skip(static_cast<uint32_t>(key & 7));
    }
  }
  if (!w.ok || dec.pieces_.empty()) {
    throw DataError("tokenizer '" + path +
                    "' is not a SentencePiece model (no pieces could be read; give a tokenizer.model file)");
  }
  return dec;
}

std::string PieceDecoder::decode(const std::vector<int64_t>& ids) const {
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space
  std::string out;
  for (const int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      out += "<id " + std::to_string(id) + ">";
      continue;
    }
    const Piece& p = pieces_[static_cast<size_t>(id)];
    switch (p.kind) {
      case Kind::kControl: break;
      case Kind::kUnknown: out += " \xE2\x81\x87 "; break;
      case Kind::kByte: out.push_back(static_cast<char>(p.byte)); break;
      case Kind::kNormal:
        for (size_t i = 0; i < p.text.size();) {
          if (p.text.compare(i, kSpace.size(), kSpace) == 0) {
            out.push_back(' ');
            i += kSpace.size();
          } else {
            out.push_back(p.text[i++]);
          }
        }
    }
  }
  if (!out.empty() && out[0] == ' ') out.erase(0, 1);  // the dummy prefix SentencePiece adds
  return out;
}

}  // namespace fsdp::data
