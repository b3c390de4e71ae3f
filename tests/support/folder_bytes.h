#pragma once
// A folder's contents as bytes, for tests that check a refused operation left it untouched
// ("byte-identical afterwards"): tests/models/test_llama_hf.cpp, tests/trainer/test_train_gpt_export.cpp.
//
// Example:
//   const auto before = fsdp::testing::folder_bytes(dir);
//   ... an export refused ...
//   EXPECT_EQ(fsdp::testing::folder_bytes(dir), before);
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>

namespace fsdp::testing {

// Every regular file under `dir` (relative path -> bytes); symlinks are not followed (neither
// folders nor files reached through one).
inline std::map<std::string, std::string> folder_bytes(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!fs::is_regular_file(e.symlink_status())) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[fs::relative(e.path(), dir).string()] = std::string(std::istreambuf_iterator<char>(in), {});
  }
  return out;
}

// The names directly in `dir`.
inline std::set<std::string> names_in(const std::filesystem::path& dir) {
  std::set<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

}  // namespace fsdp::testing
