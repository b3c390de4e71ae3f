#include "fsdp/data/tokenizer.h"

#include <sentencepiece_processor.h>

#include "fsdp/data/token_shards.h"

namespace fsdp::data {
namespace {

class ByteTokenizer : public Tokenizer {
 public:
  int64_t vocab_size() const override { return kByteSeparator + 1; }
  int64_t bos_id() const override { return kByteSeparator; }
  int64_t eos_id() const override { return -1; }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    for (const char c : text) out.push_back(static_cast<unsigned char>(c));
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    for (const int64_t id : ids) {
      if (id >= 0 && id < 256) {
        out.push_back(static_cast<char>(id));
      } else if (id == kByteSeparator) {
        out += "<|endoftext|>";
      } else {
        out += "<id " + std::to_string(id) + ">";
      }
    }
    return out;
  }
  std::string describe() const override { return "bytes (vocabulary 257, documents preceded by id 256)"; }
};

class SentencePieceTokenizer : public Tokenizer {
 public:
  explicit SentencePieceTokenizer(const std::string& path) : path_(path) {
    const auto status = sp_.Load(path);
    if (!status.ok()) {
      throw DataError("cannot load SentencePiece model '" + path + "': " + status.ToString() +
                      " (give a tokenizer.model file, e.g. from a Llama 2 or Mistral folder, or one spm_train wrote)");
    }
  }
  int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  int64_t bos_id() const override { return sp_.bos_id(); }
  int64_t eos_id() const override { return sp_.eos_id(); }
  void encode(std::string_view text, std::vector<uint32_t>& out) const override {
    std::vector<int> ids;
    const auto status = sp_.Encode(text, &ids);
    if (!status.ok()) throw std::runtime_error("SentencePiece could not encode a document: " + status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }
  std::string decode(const std::vector<int64_t>& ids) const override {
    std::string out;
    std::vector<int> run;  // consecutive in-vocabulary ids decode together (pieces join up)
    auto flush = [&] {
      std::string text;
      if (!run.empty() && sp_.Decode(run, &text).ok()) out += text;
      run.clear();
    };
    for (const int64_t id : ids) {
      if (id >= 0 && id < vocab_size()) {
        run.push_back(static_cast<int>(id));
      } else {
        flush();
        out += "<id " + std::to_string(id) + ">";
      }
    }
    flush();
    return out;
  }
  std::string describe() const override {
    return "SentencePiece " + path_ + " (vocabulary " + std::to_string(vocab_size()) + ", bos " +
           std::to_string(bos_id()) + ", eos " + std::to_string(eos_id()) + ")";
  }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::bytes() { return std::make_unique<ByteTokenizer>(); }

std::unique_ptr<Tokenizer> Tokenizer::load(const std::string& path) {
  return std::make_unique<SentencePieceTokenizer>(path);
}

void Tokenizer::encode_document(std::string_view text, std::vector<uint32_t>& out) const {
  if (bos_id() >= 0) out.push_back(static_cast<uint32_t>(bos_id()));
  encode(text, out);
  if (eos_id() >= 0) out.push_back(static_cast<uint32_t>(eos_id()));
}

}  // namespace fsdp::data
