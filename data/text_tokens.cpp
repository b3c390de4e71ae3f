#include "fsdp/data/text_tokens.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "fsdp/data/documents.h"
#include "fsdp/data/piece_decoder.h"
#include "fsdp/data/tokenizer.h"

extern char** environ;

namespace fsdp::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kTextHint = " (give a readable text or JSON-lines file)";

void check_input(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw DataError("cannot read text file '" + path + "': " + std::strerror(errno) + kTextHint);
  }
  if (!S_ISREG(st.st_mode)) throw DataError("text file '" + path + "' is not a regular file" + kTextHint);
  if (::access(path.c_str(), R_OK) != 0) {
    throw DataError("cannot read text file '" + path + "': " + std::strerror(errno) + kTextHint);
  }
}

// Bytes, as fsdp-tokenize encodes them without --tokenizer: id 256, then the document's bytes.
std::vector<uint32_t> encode_bytes(const std::string& path, const std::string& field) {
  std::vector<uint32_t> out;
  read_documents(path, [&](RawDocument&& d, int64_t) {
    out.push_back(kByteSeparator);
    for (const char c : document_text(d, field)) out.push_back(static_cast<unsigned char>(c));
  });
  return out;
}

// A folder removed with everything in it when this goes out of scope.
struct TempFolder {
  std::string path;
  TempFolder() {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/fsdp-text-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) {
      throw DataError("cannot make a temporary folder " + pattern + ": " + std::strerror(errno) +
                      " (set TMPDIR to a writable folder)");
    }
    path = pattern;
  }
  ~TempFolder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The last non-empty line of a file ("" when none).
std::string last_line(const std::string& file) {
  std::ifstream f(file);
  std::string line, last;
  while (std::getline(f, line)) {
    if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
  }
  return last;
}

// SentencePiece through fsdp-tokenize in a child process; its shards read back into memory.
TextTokens encode_with_tool(const std::string& path, const TextEncoding& enc) {
  const std::string tool = enc.tool.empty() ? tokenize_tool() : enc.tool;
  if (::access(tool.c_str(), X_OK) != 0) {
    throw DataError("encoding '" + path + "' with SentencePiece needs fsdp-tokenize, and " + tool +
                    " is not executable (build or install it beside this program, set FSDP_TOKENIZE, or "
                    "tokenize first: fsdp-tokenize --tokenizer " +
                    enc.tokenizer + " ... then --data tokens:...)");
  }
  TempFolder dir;
  const std::string prefix = dir.path + "/text", log = dir.path + "/log";
  std::vector<std::string> args = {
      tool,      "--tokenizer", enc.tokenizer,    "--threads",  std::to_string(enc.threads),
      "--field", enc.field,     "--shard-tokens", "2147483647", "--out",
      prefix,    path};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, tool.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw DataError("cannot run " + tool + ": " + std::strerror(rc));
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string why = last_line(log);
    const std::string tag = "fsdp-tokenize: error: ";
    if (why.rfind(tag, 0) == 0) why = why.substr(tag.size());
    if (why.empty()) why = "it failed (wait status " + std::to_string(status) + ")";
    if (why.find(path) == std::string::npos) why = "encoding '" + path + "' with fsdp-tokenize: " + why;
    throw DataError(why);
  }
  TokenShards shards(expand_glob(prefix + "_*.bin"));
  TextTokens out;
  out.path = path;
  out.vocab = shards.header_vocab();
  std::vector<int64_t> wide(static_cast<size_t>(shards.size()));
  shards.read(0, shards.size(), wide.data());
  out.tokens.assign(wide.begin(), wide.end());
  return out;
}

}  // namespace

std::string tokenize_tool() {
  if (const char* env = std::getenv("FSDP_TOKENIZE"); env && *env) return env;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return (ec ? fs::path(".") : self.parent_path()) / "fsdp-tokenize";
}

TextTokens encode_text(const std::string& path, const TextEncoding& enc) {
  check_input(path);
  TextTokens out;
  if (enc.tokenizer.empty()) {
    out.path = path;
    out.tokens = encode_bytes(path, enc.field);
    out.vocab = kByteSeparator + 1;
  } else {
    if (fs::path(enc.tokenizer).extension() == ".json") {
      throw DataError("'" + enc.tokenizer +
                      "' is a Hugging Face tokenizer.json, which encodes in Python: run "
                      "scripts/prepare-hf-tokenizer.py and train on --data tokens:PREFIX_*.bin");
    }
    PieceDecoder::load(enc.tokenizer);  // a tokenizer.model, checked before the child runs
    out = encode_with_tool(path, enc);
  }
  if (out.tokens.empty()) throw DataError("text file '" + path + "' holds no documents" + kTextHint);
  return out;
}

std::unique_ptr<TokenShards> TextTokens::shards(int64_t begin, int64_t end) const {
  std::vector<std::unique_ptr<Shard>> one;
  one.push_back(std::make_unique<Shard>("text:" + path,
                                        std::vector<uint32_t>(tokens.begin() + begin, tokens.begin() + end), vocab));
  return std::make_unique<TokenShards>(std::move(one));
}

}  // namespace fsdp::data
