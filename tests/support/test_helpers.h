#pragma once
// Small helpers shared by the test suites: a temporary folder removed at scope exit, "expect an
// error whose message contains ...", and a rank worker's setting from the environment. Use these
// instead of a copy per test file.
//
//   fsdp::testing::TempDir dir("checkpoint_test");       // /tmp/checkpoint_test_XXXXXX
//   std::string path = dir / "step_000001";
//   fsdp::testing::expect_error([&] { load(path); }, "no committed checkpoint");   // in a rank worker
//   EXPECT_ERROR_CONTAINS(load(path), "no committed checkpoint");                  // in a TEST
//   const std::string mode = fsdp::testing::env("CASE", "plain");   // RanksOptions::env's value
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>

#include <gtest/gtest.h>

namespace fsdp::testing {

// A fresh directory (mkdtemp) under the system temporary folder, removed with its contents when
// the object goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "fsdp_test") {
    std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "_XXXXXX")).string();
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (std::filesystem::path(path) / name).string(); }

  std::string path;
};

// Runs `fn`; throws std::runtime_error unless it threw an exception whose what() contains
// `needle`. Meant for rank workers (a throw fails the rank) and plain code alike.
inline void expect_error(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
  } catch (const std::exception& e) {
    if (std::string(e.what()).find(needle) == std::string::npos)
      throw std::runtime_error("error '" + std::string(e.what()) + "' lacks '" + needle + "'");
    return;
  }
  throw std::runtime_error("expected an error containing '" + needle + "', but nothing was thrown");
}

// The environment variable `name` (a rank worker's case, set through RanksOptions::env), or
// `fallback` when it is unset.
inline std::string env(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

}  // namespace fsdp::testing

// In a TEST body: the statement must throw an exception whose message contains `needle`.
#define EXPECT_ERROR_CONTAINS(statement, needle)                                                \
  do {                                                                                          \
    try {                                                                                       \
      statement;                                                                                \
      ADD_FAILURE() << "expected an error containing '" << (needle) << "': nothing was thrown"; \
    } catch (const std::exception& fsdp_e_) {                                                   \
      EXPECT_NE(std::string(fsdp_e_.what()).find(needle), std::string::npos)                    \
          << "error '" << fsdp_e_.what() << "' lacks '" << (needle) << "'";                     \
    }                                                                                           \
  } while (0)
