// fsdp-tokenize: text files or JSON lines -> llm.c token shards, for train_gpt --data tokens:...
//
//   fsdp-tokenize --out data/corpus_train corpus.txt              # bytes: data/corpus_train_000000.bin
//   fsdp-tokenize --tokenizer tokenizer.model --threads 8 --field text --out data/web_val web_val.jsonl
//
// Documents: in a text file, runs of lines separated by blank lines; in a JSON-lines file (.jsonl,
// .json, .ndjson), the string --field of each line. Each document is encoded on its own and
// preceded by the tokenizer's BOS and followed by its EOS (those it has: SentencePiece's <s> and
// </s>; for bytes, id 256 before each document). The threads encode a batch of documents at a
// time and the ids are written in document order, so the output is byte-identical whatever
// --threads. Shards hold --shard-tokens tokens each (the last one the rest), uint16 when the
// vocabulary fits (llm.c's GPT-2 header) and uint32 otherwise (its Llama 3 header); header[3]
// records the vocabulary size. They are written under temporary names and renamed in at the end:
// a failed run leaves no shard behind.
#include <unistd.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/data/documents.h"
#include "fsdp/data/token_shards.h"
#include "fsdp/data/tokenizer.h"

namespace {

namespace fs = std::filesystem;
using fsdp::data::Tokenizer;

// Options, e.g. fsdp-tokenize --tokenizer tokenizer.model --threads 4 --out data/x_train in.jsonl.
// Example: Options o; o.out = "data/x"; o.inputs = {"a.txt"};
struct Options {
  std::string tokenizer;  // "": bytes
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string field = "text";
  int64_t shard_tokens = 100'000'000;  // llm.c's shard size
  std::string out;
  bool overwrite = false;  // replace the shards of an earlier run under --out (all of them)
  std::vector<std::string> inputs;
};

// Bad input: one line, exit 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

using fsdp::data::RawDocument;

// Encodes a batch of documents on `threads` threads; result[i] holds document i's ids.
std::vector<std::vector<uint32_t>> encode_batch(const Tokenizer& tok, const std::vector<RawDocument>& docs,
                                                const std::string& field, int threads) {
  std::vector<std::vector<uint32_t>> result(docs.size());
  std::vector<std::string> errors(docs.size());
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < docs.size(); i = next++) {
      try {
        tok.encode_document(fsdp::data::document_text(docs[i], field), result[i]);
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (const auto& e : errors) {
    if (!e.empty()) throw InputError(e);  // the first in document order
  }
  return result;
}

// Fills shards of exactly `shard_tokens` tokens (the last one the rest) under temporary names.
class ShardWriter {
 public:
  ShardWriter(const Options& o, int64_t vocab) : o_(o), vocab_(vocab), u32_(vocab > 65536) {}
  ~ShardWriter() {
    for (const auto& t : temps_) fs::remove(t);  // not committed: a failed run leaves nothing
  }
  void append(const std::vector<uint32_t>& ids) {
    for (size_t i = 0; i < ids.size();) {
      const size_t take = std::min(ids.size() - i, static_cast<size_t>(o_.shard_tokens) - buf_.size());
      buf_.insert(buf_.end(), ids.begin() + static_cast<std::ptrdiff_t>(i),
                  ids.begin() + static_cast<std::ptrdiff_t>(i + take));
      i += take;
      total_ += static_cast<int64_t>(take);
      if (buf_.size() == static_cast<size_t>(o_.shard_tokens)) flush();
    }
  }
  // Writes the last shard and renames every shard in (over the earlier run's of the same names);
  // then removes the earlier run's shards beyond them (`old`: --overwrite's). Returns the names.
  std::vector<std::string> commit(const std::vector<std::string>& old) {
    if (!buf_.empty()) flush();
    std::vector<std::string> names;
    for (size_t i = 0; i < temps_.size(); ++i) {
      names.push_back(shard_name(o_.out, i));
      fs::rename(temps_[i], names.back());
    }
    temps_.clear();
    for (const auto& f : old) {
      if (std::find(names.begin(), names.end(), f) == names.end()) fs::remove(f);
    }
    return names;
  }
  int64_t total() const { return total_; }
  bool u32() const { return u32_; }

  static std::string shard_name(const std::string& prefix, size_t i) {
    char suffix[32];
    std::snprintf(suffix, sizeof suffix, "_%06zu.bin", i);
    return prefix + suffix;
  }

 private:
  void flush() {
    const std::string tmp = shard_name(o_.out, temps_.size()) + ".tmp";
    temps_.push_back(tmp);
    int32_t header[fsdp::data::kHeaderInts] = {};
    header[0] = u32_ ? fsdp::data::kLlama3Magic : fsdp::data::kGpt2Magic;
    header[1] = u32_ ? fsdp::data::kLlama3Version : fsdp::data::kGpt2Version;
    header[2] = static_cast<int32_t>(buf_.size());
    header[fsdp::data::kVocabSlot] = static_cast<int32_t>(vocab_);
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(header), sizeof header);
    if (u32_) {
      f.write(reinterpret_cast<const char*>(buf_.data()), static_cast<std::streamsize>(buf_.size() * 4));
    } else {
      const std::vector<uint16_t> narrow(buf_.begin(), buf_.end());
      f.write(reinterpret_cast<const char*>(narrow.data()), static_cast<std::streamsize>(narrow.size() * 2));
    }
    f.close();
    if (!f) throw std::runtime_error("cannot write " + tmp + ": disk full or not writable");
    buf_.clear();
  }

  const Options& o_;
  int64_t vocab_;
  bool u32_;
  std::vector<uint32_t> buf_;
  std::vector<std::string> temps_;
  int64_t total_ = 0;
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The shards an earlier run wrote under `prefix`: PREFIX_<6 or more digits>.bin, sorted.
std::vector<std::string> shards_of(const std::string& prefix) {
  const fs::path p(prefix);
  const fs::path dir = p.parent_path().empty() ? fs::path(".") : p.parent_path();
  const std::string stem = p.filename().string() + "_";
  auto is_shard = [&](const std::string& f) {  // stem + at least 6 digits + ".bin"
    if (f.size() < stem.size() + 10 || f.compare(0, stem.size(), stem) != 0 || !f.ends_with(".bin")) return false;
    return std::all_of(f.begin() + static_cast<std::ptrdiff_t>(stem.size()), f.end() - 4,
                       [](char c) { return c >= '0' && c <= '9'; });
  };
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    if (is_shard(f)) out.push_back(p.parent_path().empty() ? f : (p.parent_path() / f).string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Checks that need no work: inputs readable, --out a prefix in an existing folder, no shards of
// an earlier run under it (unless --overwrite). Throws InputError.
void check_inputs(const Options& o) {
  if (o.shard_tokens > INT32_MAX) throw InputError("--shard-tokens must be at most 2^31 - 1 (llm.c's int32 count)");
  for (const auto& in : o.inputs) {
    std::error_code ec;
    if (!fs::is_regular_file(in, ec)) throw InputError("cannot read input '" + in + "': not a readable regular file");
    if (!std::ifstream(in)) throw InputError("cannot read input '" + in + "'");
  }
  std::error_code ec;
  if (o.out.empty() || o.out.back() == '/' || fs::is_directory(o.out, ec)) {
    throw InputError("--out " + o.out + " names a folder, not a prefix: give a prefix inside it, e.g. --out " +
                     (fs::path(o.out) / "corpus_train").lexically_normal().string() +
                     " (shards corpus_train_000000.bin, ...)");
  }
  const fs::path dir = fs::path(o.out).parent_path();
  if (!dir.empty() && !fs::is_directory(dir)) {
    throw InputError("--out " + o.out + ": folder " + dir.string() + " does not exist (create it first)");
  }
  const std::vector<std::string> old = shards_of(o.out);
  if (!old.empty() && !o.overwrite) {
    throw InputError(old.front() + " exists (" + std::to_string(old.size()) + " shard" + (old.size() == 1 ? "" : "s") +
                     " of an earlier run: " + o.out +
                     "_*.bin): give --overwrite to replace them all, or another --out (a stale shard would join "
                     "the glob)");
  }
}

int run(const Options& o) {
  check_inputs(o);
  const std::unique_ptr<Tokenizer> tok = o.tokenizer.empty() ? Tokenizer::bytes() : Tokenizer::load(o.tokenizer);
  int64_t total_bytes = 0;
  for (const auto& in : o.inputs) total_bytes += static_cast<int64_t>(fs::file_size(in));
  ShardWriter writer(o, tok->vocab_size());
  const bool tty = ::isatty(2);
  const double t0 = now_s();
  double last_print = t0;
  int64_t read_bytes = 0, documents = 0;
  std::vector<RawDocument> batch;
  size_t batch_bytes = 0;
  constexpr size_t kBatchBytes = 8 << 20;  // per round of the threads
  auto progress = [&](bool final) {
    const double t = now_s();
    if (!final && t - last_print < (tty ? 0.5 : 5.0)) return;  // a log gets a line every 5 s
    last_print = t;
    std::fprintf(stderr, "%sfsdp-tokenize: %.1f/%.1f MB (%3.0f%%), %lld tokens, %.1f MB/s%s", tty ? "\r" : "",
                 static_cast<double>(read_bytes) / 1e6, static_cast<double>(total_bytes) / 1e6,
                 total_bytes ? 100.0 * static_cast<double>(read_bytes) / static_cast<double>(total_bytes) : 100.0,
                 static_cast<long long>(writer.total()), static_cast<double>(read_bytes) / 1e6 / std::max(t - t0, 1e-9),
                 final || !tty ? "\n" : "");
  };
  auto run_batch = [&] {
    for (const auto& ids : encode_batch(*tok, batch, o.field, o.threads)) writer.append(ids);
    documents += static_cast<int64_t>(batch.size());
    batch.clear();
    batch_bytes = 0;
    progress(false);
  };
  auto add = [&](RawDocument&& d) {
    batch_bytes += d.raw.size();
    batch.push_back(std::move(d));
    if (batch_bytes >= kBatchBytes) run_batch();
  };
  for (const auto& in : o.inputs) {
    const int64_t before = read_bytes;
    fsdp::data::read_documents(in, [&](RawDocument&& d, int64_t file_bytes) {
      read_bytes = before + file_bytes;
      add(std::move(d));
    });
  }
  if (!batch.empty()) run_batch();
  if (writer.total() == 0) throw InputError("no documents in the input: nothing to write");
  read_bytes = total_bytes;
  progress(true);
  const bool u32 = writer.u32();
  // --overwrite: the earlier run's shards go only now, once the new ones are written.
  const auto names = writer.commit(o.overwrite ? shards_of(o.out) : std::vector<std::string>{});
  const double secs = now_s() - t0;
  std::printf(
      "fsdp-tokenize: %zu file%s, %lld documents, %lld tokens -> %zu shard%s %s%s (%s, vocabulary %lld) in %.2f s "
      "(%.1f MB/s of text)\n",
      o.inputs.size(), o.inputs.size() == 1 ? "" : "s", static_cast<long long>(documents),
      static_cast<long long>(writer.total()), names.size(), names.size() == 1 ? "" : "s", names.front().c_str(),
      names.size() > 1 ? (" .. " + names.back()).c_str() : "", u32 ? "uint32" : "uint16",
      static_cast<long long>(tok->vocab_size()), secs, static_cast<double>(total_bytes) / 1e6 / std::max(secs, 1e-9));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{
      "fsdp-tokenize: text files or JSON lines -> llm.c token shards (PREFIX_000000.bin, ...) for\n"
      "train_gpt --data tokens:'PREFIX_*.bin'. Documents: in text files, runs of lines separated by\n"
      "blank lines; in .jsonl/.json/.ndjson files, the --field string of each line. Each document is\n"
      "encoded alone, preceded by the tokenizer's BOS and followed by its EOS (bytes: id 256 precedes\n"
      "each document, vocabulary 257). uint16 tokens (llm.c's GPT-2 header) when the vocabulary fits,\n"
      "else uint32 (its Llama 3 header); header[3] holds the vocabulary size. The output is the same\n"
      "byte for byte whatever --threads. Name validation shards *_val_* (e.g. --out data/x_val).",
      "fsdp-tokenize"};
  app.option_defaults()->always_capture_default();
  app.add_option("--tokenizer", o.tokenizer, "A SentencePiece tokenizer.model (default: bytes)");
  app.add_option("--threads", o.threads, "Encoding threads")->check(CLI::Range(1, 1024));
  app.add_option("--field", o.field, "The JSON field holding each document's text");
  app.add_option("--shard-tokens", o.shard_tokens, "Tokens per shard (the last one holds the rest)")
      ->check(CLI::Range(int64_t{1}, int64_t{INT32_MAX}));
  app.add_option("--out", o.out, "Output prefix: PREFIX_000000.bin, PREFIX_000001.bin, ...")->required();
  app.add_flag("--overwrite", o.overwrite,
               "Replace the shards an earlier run wrote under --out (every PREFIX_*.bin; removed once the new "
               "ones are written)");
  app.add_option("files", o.inputs, "Text or JSON-lines files")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::fprintf(stderr, "fsdp-tokenize: error: %s (see --help)\n", msg.c_str());
    return 2;
  }
  try {
    return run(o);
  } catch (const InputError& e) {
    std::fprintf(stderr, "fsdp-tokenize: error: %s\n", e.what());
    return 2;
  } catch (const fsdp::data::DataError& e) {
    std::fprintf(stderr, "fsdp-tokenize: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fsdp-tokenize: error: %s\n", e.what());
    return 1;
  }
}
