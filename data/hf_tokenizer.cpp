#include "fsdp/data/hf_tokenizer.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "fsdp/data/token_shards.h"

namespace fsdp::data {
namespace {

using nlohmann::json;

constexpr const char* kHfHint = " (give a Hugging Face tokenizer.json with a BPE model, e.g. GPT-2's or Llama 3's)";

// GPT-2's bytes_to_unicode, inverted: code point -> byte.
const std::unordered_map<uint32_t, unsigned char>& unicode_to_byte() {
  static const auto table = [] {
    std::unordered_map<uint32_t, unsigned char> t;
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      t[printable ? b : 256 + n++] = static_cast<unsigned char>(b);
    }
    return t;
  }();
  return table;
}

// The next code point of UTF-8 text at i (advancing i); a stray byte is taken as itself.
uint32_t next_code_point(const std::string& s, size_t& i, size_t* len) {
  const auto c = static_cast<unsigned char>(s[i]);
  const int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + static_cast<size_t>(n) > s.size() || (n == 1 && c >= 0x80)) {
    *len = 1;
    ++i;
    return c;
  }
  uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
  for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + static_cast<size_t>(k)]) & 0x3F);
  *len = static_cast<size_t>(n);
  i += static_cast<size_t>(n);
  return cp;
}

// The decoder types a "decoder" entry names, flattened through "Sequence".
void decoder_types(const json& d, std::vector<std::string>& out) {
  if (!d.is_object() || !d.contains("type") || !d["type"].is_string()) return;
  const std::string type = d["type"].get<std::string>();
  if (type == "Sequence" && d.contains("decoders") && d["decoders"].is_array()) {
    for (const auto& sub : d["decoders"]) decoder_types(sub, out);
  } else if (type == "Replace" && d.contains("pattern") && d["pattern"].is_object() &&
             d["pattern"].value("String", "") == "\xE2\x96\x81") {
    out.push_back("Metaspace");  // Replace "▁" -> " ": Llama 2's spelling of Metaspace
  } else {
    out.push_back(type);
  }
}

bool has(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

}  // namespace

HfTokenizerDecoder HfTokenizerDecoder::load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read tokenizer '" + path + "'" + kHfHint);
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    throw DataError("tokenizer '" + path + "' is not JSON (" + e.what() + ")" + kHfHint);
  }
  if (!j.is_object() || !j.contains("model") || !j["model"].is_object() || !j["model"].contains("vocab") ||
      !j["model"]["vocab"].is_object()) {
    throw DataError("tokenizer '" + path + "' has no model.vocab object: not a Hugging Face tokenizer.json" + kHfHint);
  }
  const json& model = j["model"];
  const std::string type = model.value("type", "BPE");
  if (type != "BPE") {
    throw DataError("tokenizer '" + path + "' has a " + type + " model; only BPE tokenizers decode here" + kHfHint);
  }
  HfTokenizerDecoder dec;
  auto put = [&](int64_t id, const std::string& text, bool added) {
    if (id < 0 || id >= (int64_t{1} << 24)) {
      throw DataError("tokenizer '" + path + "' gives \"" + text + "\" the id " + std::to_string(id) +
                      ", outside [0, 2^24)" + kHfHint);
    }
    if (static_cast<size_t>(id) >= dec.tokens_.size()) dec.tokens_.resize(static_cast<size_t>(id) + 1);
    dec.tokens_[static_cast<size_t>(id)] = {text, true, added};
  };
  for (const auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer()) {
      throw DataError("tokenizer '" + path + "': model.vocab[\"" + text + "\"] is not an integer id" + kHfHint);
    }
    put(id.get<int64_t>(), text, false);
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const auto& t : j["added_tokens"]) {
      if (t.is_object() && t.contains("id") && t["id"].is_number_integer() && t.contains("content") &&
          t["content"].is_string()) {
        put(t["id"].get<int64_t>(), t["content"].get<std::string>(), true);
      }
    }
  }
  if (dec.tokens_.empty()) throw DataError("tokenizer '" + path + "' has an empty vocabulary" + kHfHint);
  std::vector<std::string> types;
  if (j.contains("decoder")) decoder_types(j["decoder"], types);
  dec.byte_fallback_ = model.value("byte_fallback", false) || has(types, "ByteFallback");
  if (has(types, "ByteLevel")) {
    dec.byte_level_ = true;
  } else if (!has(types, "Metaspace")) {
    std::string names;
    for (const auto& t : types) names += (names.empty() ? "" : ", ") + t;
    throw DataError("tokenizer '" + path + "' has decoder " + (names.empty() ? "none" : names) +
                    "; train_gpt decodes ByteLevel (GPT-2, Llama 3) and Metaspace (Llama 2, Mistral) BPE "
                    "tokenizers (give --tokenizer a tokenizer.model for SentencePiece models, or leave it out)");
  }
  return dec;
}

std::string HfTokenizerDecoder::decode(const std::vector<int64_t>& ids) const {
  static const std::string kSpace = "\xE2\x96\x81";  // U+2581
  const auto& to_byte = unicode_to_byte();
  std::string out;
  for (const int64_t id : ids) {
    if (id < 0 || id >= vocab_size() || !tokens_[static_cast<size_t>(id)].known) {
      out += "<id " + std::to_string(id) + ">";
      continue;
    }
    const Token& t = tokens_[static_cast<size_t>(id)];
    if (t.added) {
      out += t.text;
    } else if (byte_level_) {
      for (size_t i = 0; i < t.text.size();) {
        const size_t at = i;
        size_t len = 0;
        const uint32_t cp = next_code_point(t.text, i, &len);
        const auto b = to_byte.find(cp);
        if (b != to_byte.end()) {
          out.push_back(static_cast<char>(b->second));
        } else {
          out.append(t.text, at, len);  // not in the table: the character itself, as tokenizers does
        }
      }
    } else if (byte_fallback_ && t.text.size() == 6 && t.text.rfind("<0x", 0) == 0 && t.text[5] == '>') {
      out.push_back(static_cast<char>(std::stoi(t.text.substr(3, 2), nullptr, 16)));
    } else {
      for (size_t i = 0; i < t.text.size();) {
        if (t.text.compare(i, kSpace.size(), kSpace) == 0) {
          out.push_back(' ');
          i += kSpace.size();
        } else {
          out.push_back(t.text[i++]);
        }
      }
    }
  }
  if (!byte_level_ && !out.empty() && out[0] == ' ') out.erase(0, 1);  // Strip / Metaspace's leading space
  return out;
}

SampleDecoder SampleDecoder::load(const std::string& path) {
  SampleDecoder d;
  if (std::filesystem::path(path).extension() == ".json") {
    d.hf_ = std::make_shared<HfTokenizerDecoder>(HfTokenizerDecoder::load(path));
  } else {
    d.piece_ = std::make_shared<PieceDecoder>(PieceDecoder::load(path));
  }
  return d;
}

std::string SampleDecoder::decode(const std::vector<int64_t>& ids) const {
  return hf_ ? hf_->decode(ids) : piece_->decode(ids);
}

int64_t SampleDecoder::vocab_size() const { return hf_ ? hf_->vocab_size() : piece_->vocab_size(); }

std::string SampleDecoder::kind() const {
  if (hf_)
    return std::string("Hugging Face tokenizer.json (") + (hf_->byte_level() ? "byte-level" : "Metaspace") + " BPE)";
  return "SentencePiece tokenizer.model";
}

}  // namespace fsdp::data
