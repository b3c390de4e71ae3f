// fsdp-tokenize end to end: its shards equal shards written here by an independent reference
// (our own document splitting and encoding, llm.c's header layout from shard_writer.h), byte for
// byte, for bytes and for a SentencePiece model, whatever --threads; SentencePiece ids also equal
// Debian's spm_encode; bad input is one line, exit 2, and no shard written.
#include <gtest/gtest.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "shard_writer.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;
using fsdp_data_test::write_shard;

const std::string kTool = FSDP_TOKENIZE_PATH;

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

std::string quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

Result run(const std::string& args) {
  Result r;
  FILE* p = ::popen(("timeout 60 " + kTool + " " + args + " 2>&1").c_str(), "r");
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The documents of the corpus, as the reference sees them.
const std::vector<std::string> kParagraphs = {"The first paragraph.\nIts second line.",
                                              "Second: caf\xC3\xA9 \xE2\x82\xAC 42", "  indented third\n\tand a tab"};
const std::vector<std::string> kRecords = {"a JSON document", "with \"quotes\" and \\ backslash",
                                           "\xC3\xBC"
                                           "ber",
                                           "last one"};

// a.txt: the paragraphs separated by one or more blank lines; b.jsonl: one record per line.
void write_corpus(const fsdp::testing::TempDir& dir) {
  std::ofstream a(dir / "a.txt");
  a << "\n" << kParagraphs[0] << "\n\n\n" << kParagraphs[1] << "\n\n" << kParagraphs[2] << "\n";
  std::ofstream b(dir / "b.jsonl");
  for (const auto& r : kRecords) {
    std::string escaped;
    for (char c : r) escaped += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
    b << "{\"id\": 1, \"text\": \"" << escaped << "\"}\n";
  }
}

// The reference: each document's ids in order, cut into shards of `per_shard`, written with
// llm.c's layout; returns the expected shard files' contents.
std::vector<std::string> reference(const fsdp::testing::TempDir& dir, const std::vector<std::vector<uint32_t>>& docs,
                                   size_t per_shard, int32_t vocab) {
  std::vector<uint32_t> all;
  for (const auto& d : docs) all.insert(all.end(), d.begin(), d.end());
  std::vector<std::string> out;
  for (size_t i = 0; i < all.size(); i += per_shard) {
    const std::vector<uint32_t> part(all.begin() + static_cast<std::ptrdiff_t>(i),
                                     all.begin() + static_cast<std::ptrdiff_t>(std::min(all.size(), i + per_shard)));
    write_shard(dir / "reference.bin", part, false, vocab);
    out.push_back(slurp(dir / "reference.bin"));
  }
  return out;
}

void expect_shards(const std::string& prefix, const std::vector<std::string>& want) {
  for (size_t i = 0; i < want.size(); ++i) {
    char name[32];
    std::snprintf(name, sizeof name, "_%06zu.bin", i);
    ASSERT_TRUE(fs::exists(prefix + name)) << prefix + name;
    EXPECT_TRUE(slurp(prefix + name) == want[i]) << prefix + name << " differs from the reference";
  }
  char next[32];
  std::snprintf(next, sizeof next, "_%06zu.bin", want.size());
  EXPECT_FALSE(fs::exists(prefix + next)) << "one shard too many";
}

TEST(FsdpTokenize, ByteShardsEqualTheReferenceWhateverTheThreads) {
  fsdp::testing::TempDir dir("tokenize_test");
  write_corpus(dir);
  std::vector<std::vector<uint32_t>> docs;
  for (const auto* list : {&kParagraphs, &kRecords}) {
    for (const auto& text : *list) {
      std::vector<uint32_t> ids = {256};  // bytes: id 256 precedes each document
      for (unsigned char c : text) ids.push_back(c);
      docs.push_back(ids);
    }
  }
  const auto want = reference(dir, docs, 40, 257);
  ASSERT_GE(want.size(), 3u);
  for (const int threads : {1, 3}) {
    const std::string prefix = dir / ("bytes_t" + std::to_string(threads));
    const auto r = run("--threads " + std::to_string(threads) + " --shard-tokens 40 --out " + quote(prefix) + " " +
                       quote(dir / "a.txt") + " " + quote(dir / "b.jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_NE(r.output.find("2 files, 7 documents"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("(uint16, vocabulary 257)"), std::string::npos) << r.output;
    expect_shards(prefix, want);
  }
}

TEST(FsdpTokenize, SentencePieceShardsEqualTheReferenceAndSpmEncode) {
  fsdp::testing::TempDir dir("tokenize_test");
  write_corpus(dir);
  {
    std::ofstream train(dir / "train.txt");
    for (int i = 0; i < 100; ++i) train << "The quick brown fox " << i << " jumps over the lazy dog.\n";
    for (const auto& p : kParagraphs) train << p << "\n";
  }
  const auto trained = sentencepiece::SentencePieceTrainer::Train(
      "--input=" + (dir / "train.txt") + " --model_prefix=" + (dir / "m") +
      " --vocab_size=320 --model_type=bpe --byte_fallback=true --minloglevel=2");
  ASSERT_TRUE(trained.ok()) << trained.ToString();
  sentencepiece::SentencePieceProcessor sp;
  ASSERT_TRUE(sp.Load(dir / "m.model").ok());
  std::vector<std::vector<uint32_t>> docs;
  for (const auto* list : {&kParagraphs, &kRecords}) {
    for (const auto& text : *list) {
      std::vector<int> ids;
      ASSERT_TRUE(sp.Encode(text, &ids).ok());
      std::vector<uint32_t> doc = {static_cast<uint32_t>(sp.bos_id())};
      doc.insert(doc.end(), ids.begin(), ids.end());
      doc.push_back(static_cast<uint32_t>(sp.eos_id()));
      docs.push_back(doc);
    }
  }
  // spm_encode (Debian's sentencepiece) on the single-line records: the same ids.
  if (std::system("command -v spm_encode >/dev/null") == 0) {
    {
      std::ofstream lines(dir / "records.txt");
      for (const auto& r : kRecords) lines << r << "\n";
    }
    const std::string cmd = "spm_encode --model=" + quote(dir / "m.model") + " --output_format=id < " +
                            quote(dir / "records.txt") + " > " + quote(dir / "records.ids");
    ASSERT_EQ(std::system(cmd.c_str()), 0);
    std::ifstream ids(dir / "records.ids");
    std::string line;
    for (size_t i = 0; i < kRecords.size(); ++i) {
      ASSERT_TRUE(std::getline(ids, line));
      std::string mine;
      const auto& doc = docs[kParagraphs.size() + i];
      for (size_t k = 1; k + 1 < doc.size(); ++k) mine += (k > 1 ? " " : "") + std::to_string(doc[k]);
      EXPECT_EQ(line, mine) << kRecords[i];
    }
  } else {
    GTEST_LOG_(INFO) << "spm_encode not installed: the cross-check against it is skipped";
  }
  const auto want = reference(dir, docs, 25, 320);
  for (const int threads : {1, 4}) {
    const std::string prefix = dir / ("spm_t" + std::to_string(threads));
    const auto r =
        run("--tokenizer " + quote(dir / "m.model") + " --threads " + std::to_string(threads) +
            " --shard-tokens 25 --out " + quote(prefix) + " " + quote(dir / "a.txt") + " " + quote(dir / "b.jsonl"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    expect_shards(prefix, want);
  }
}

TEST(FsdpTokenize, BadInputIsOneLineExitTwoAndNoShardWritten) {
  fsdp::testing::TempDir dir("tokenize_test");
  write_corpus(dir);
  std::ofstream(dir / "bad.jsonl") << "{\"text\": \"fine\"}\n{\"text\": unquoted}\n";
  std::ofstream(dir / "nofield.jsonl") << "{\"text\": \"fine\"}\n{\"body\": \"x\"}\n";
  std::ofstream(dir / "empty.txt") << "\n\n";
  write_shard(dir / "old_000000.bin", {1, 2, 3});
  const std::string a = quote(dir / "a.txt");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {quote(dir / "missing.txt"), "cannot read input"},
      {a + " " + quote(dir / "bad.jsonl"), "bad.jsonl:2: not JSON"},
      {quote(dir / "nofield.jsonl"), "nofield.jsonl:2: no string field \"text\" (give --field NAME)"},
      {"--tokenizer " + a + " " + a, "cannot load SentencePiece model"},
      {quote(dir / "empty.txt"), "no documents in the input"},
      {"--shard-tokens 0 " + a, "--shard-tokens"},
  };
  for (const auto& [args, message] : cases) {
    const auto r = run("--out " + quote(dir / "x") + " " + args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("fsdp-tokenize: error: "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << message << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    for (const auto& e : fs::directory_iterator(dir.path)) {
      EXPECT_NE(e.path().filename().string().rfind("x_", 0), 0u) << "written: " << e.path() << " for " << message;
    }
  }
  // Shards of an earlier run under the same prefix are refused, not mixed with.
  const auto r = run("--out " + quote(dir / "old") + " " + a);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("old_000000.bin exists"), std::string::npos) << r.output;
}

// An output prefix that already has shards (any of them, not only PREFIX_000000.bin) is refused
// and left as it was; --overwrite replaces every one of them (the stale ones beyond the new run's
// count removed); a folder given as --out is refused in one line.
TEST(FsdpTokenize, ExistingShardsNeedOverwriteWhichRemovesThemAll) {
  fsdp::testing::TempDir dir("tokenize_test");
  write_corpus(dir);
  const std::string a = quote(dir / "a.txt"), prefix = dir / "x";
  write_shard(dir / "x_000003.bin", {7, 8, 9});  // a stale shard of an earlier, longer run
  write_shard(dir / "x_val_000000.bin", {1});    // another prefix's
  const std::string stale = slurp(dir / "x_000003.bin");
  auto r = run("--out " + quote(prefix) + " " + a);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("x_000003.bin exists (1 shard of an earlier run"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("give --overwrite"), std::string::npos) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  EXPECT_FALSE(fs::exists(prefix + "_000000.bin"));
  EXPECT_EQ(slurp(dir / "x_000003.bin"), stale);
  // --overwrite: the new run's shards, and none of the old ones.
  r = run("--overwrite --shard-tokens 30 --out " + quote(prefix) + " " + a);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(prefix + "_000000.bin"));
  EXPECT_FALSE(fs::exists(prefix + "_000003.bin")) << "a stale shard survived --overwrite";
  EXPECT_TRUE(fs::exists(dir / "x_val_000000.bin")) << "another prefix's shard was removed";
  size_t first_run = 0;
  while (fs::exists(prefix + "_00000" + std::to_string(first_run) + ".bin")) ++first_run;
  ASSERT_GT(first_run, 1u);
  r = run("--overwrite --out " + quote(prefix) + " " + a);  // one shard now: the others go
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(prefix + "_000000.bin"));
  EXPECT_FALSE(fs::exists(prefix + "_000001.bin"));
  // A folder, with or without the slash, is not a prefix.
  for (const std::string& out : {dir.path + "/", dir.path}) {
    r = run("--out " + quote(out) + " " + a);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("names a folder, not a prefix"), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
  EXPECT_FALSE(fs::exists(dir / "_000000.bin"));
}

}  // namespace
