// fsdp_data's token shards: llm.c's two header variants, reads across shards, every bad input's
// one line, and the training order (a permutation per epoch, a function of (seed, step)).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>

#include "fsdp/data/token_shards.h"
#include "shard_writer.h"
#include "test_helpers.h"

namespace {

using namespace fsdp::data;
using fsdp_data_test::write_shard;

std::vector<uint32_t> iota_tokens(uint32_t n, uint32_t from = 0) {
  std::vector<uint32_t> v(n);
  std::iota(v.begin(), v.end(), from);
  return v;
}

TEST(TokenShards, ReadsBothFormatsAsOneStream) {
  fsdp::testing::TempDir dir("data_test");
  write_shard(dir / "a_000000.bin", iota_tokens(10), false, 300);      // uint16
  write_shard(dir / "a_000001.bin", iota_tokens(7, 100000), true, 0);  // uint32, ids beyond uint16
  write_shard(dir / "a_000002.bin", iota_tokens(5, 20), false, 300);
  const auto paths = expand_glob(dir / "a_*.bin");
  ASSERT_EQ(paths.size(), 3u);
  EXPECT_EQ(paths[0], dir / "a_000000.bin");  // sorted by name
  TokenShards s(paths);
  EXPECT_EQ(s.size(), 22);
  EXPECT_EQ(s.shards()[0]->token_bytes(), 2);
  EXPECT_EQ(s.shards()[1]->token_bytes(), 4);
  EXPECT_EQ(s.header_vocab(), 0);  // the middle shard records none
  std::string where;
  EXPECT_EQ(s.max_token(&where), 100006u);
  EXPECT_EQ(where, dir / "a_000001.bin");
  std::vector<int64_t> got(10);
  s.read(6, 10, got.data());  // spans all three shards
  const std::vector<int64_t> want = {6, 7, 8, 9, 100000, 100001, 100002, 100003, 100004, 100005};
  EXPECT_EQ(got, want);
  EXPECT_EQ(s.describe(), "3 shards, 22 tokens (uint16 and uint32)");
}

TEST(TokenShards, WindowsOverlapByOneToken) {
  fsdp::testing::TempDir dir("data_test");
  write_shard(dir / "w.bin", iota_tokens(13));
  TokenShards s({dir / "w.bin"});
  EXPECT_EQ(window_count(13, 4), 3);  // [0..4], [4..8], [8..12]
  std::vector<int64_t> rows(2 * 5);
  s.read_windows({2, 0}, 4, rows.data());
  const std::vector<int64_t> want = {8, 9, 10, 11, 12, 0, 1, 2, 3, 4};
  EXPECT_EQ(rows, want);
}

TEST(TokenShards, HeaderVocabIsTheLargestRecorded) {
  fsdp::testing::TempDir dir("data_test");
  write_shard(dir / "v_0.bin", iota_tokens(4), false, 300);
  write_shard(dir / "v_1.bin", iota_tokens(4), false, 512);
  TokenShards s(expand_glob(dir / "v_*.bin"));
  EXPECT_EQ(s.header_vocab(), 512);
}

TEST(TokenShards, BadInputIsOneLineNamingTheProblem) {
  fsdp::testing::TempDir dir("data_test");
  write_shard(dir / "magic.bin", iota_tokens(4), false, 0, 12345);
  write_shard(dir / "version16.bin", iota_tokens(4), false, 0, 20240520, 2);
  write_shard(dir / "version32.bin", iota_tokens(4), true, 0, 20240801, 1);
  write_shard(dir / "count.bin", iota_tokens(4), false, 0, 0, 0, 5);
  std::ofstream(dir / "short.bin") << "tiny";
  write_shard(dir / "big_id.bin", {1, 2, 700, 3});
  EXPECT_ERROR_CONTAINS(Shard(dir / "magic.bin"), "has magic 12345, not llm.c's 20240520 (uint16 tokens) or 20240801");
  EXPECT_ERROR_CONTAINS(Shard(dir / "version16.bin"), "has version 2 with GPT-2 magic 20240520, expected 1");
  EXPECT_ERROR_CONTAINS(Shard(dir / "version32.bin"), "has version 1 with Llama 3 magic 20240801, expected 7");
  EXPECT_ERROR_CONTAINS(Shard(dir / "count.bin"), "says 5 tokens (10 bytes) but holds 8 bytes after its header");
  EXPECT_ERROR_CONTAINS(Shard(dir / "short.bin"), "has 4 bytes, less than llm.c's 1024-byte header");
  EXPECT_ERROR_CONTAINS(Shard(dir / "missing.bin"), "cannot read token shard");
  EXPECT_ERROR_CONTAINS(Shard(dir.path), "is not a regular file");
  EXPECT_ERROR_CONTAINS(expand_glob(dir / "none_*.bin"), "no file matches");
  EXPECT_ERROR_CONTAINS(expand_glob(dir / "missing.bin"), "No such file");
  TokenShards big({dir / "big_id.bin"});
  EXPECT_ERROR_CONTAINS(big.check_vocab(700), "holds token id 700, at or above the model's vocabulary of 700");
  EXPECT_NO_THROW(big.check_vocab(701));
  EXPECT_NO_THROW(big.check_vocab(70000));  // uint16: every id fits, no pass needed
  EXPECT_ERROR_CONTAINS(WindowSampler(32, 4, 8, 0), "32 training tokens are fewer than one batch");
  EXPECT_NO_THROW(WindowSampler(33, 4, 8, 0));  // 8 windows of 5 tokens: exactly one batch
  EXPECT_ERROR_CONTAINS(validation_windows(20, 4, 8, 0), "20 validation tokens are fewer than one batch");
  // Each message is one line.
  try {
    Shard s(dir / "count.bin");
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
  }
}

// A shard truncated while it is being read (another job rewriting it, a full disk): the next read
// past its new end is a DataError naming the file, where a memory mapping raised SIGBUS. Reads
// before the new end, and max_token before the truncation, stay as they were.
TEST(TokenShards, ShardTruncatedWhileOpenIsAnErrorNamingIt) {
  fsdp::testing::TempDir dir("data_test");
  for (const bool u32 : {false, true}) {
    const std::string path = dir / (u32 ? "u32.bin" : "u16.bin");
    write_shard(path, iota_tokens(5000), u32);
    TokenShards shards({path});
    EXPECT_EQ(shards.max_token(), 4999u);
    std::vector<int64_t> out(10);
    shards.read(4990, 10, out.data());
    EXPECT_EQ(out.front(), 4990);
    EXPECT_EQ(out.back(), 4999);
    std::filesystem::resize_file(path, kHeaderBytes + 1000 * (u32 ? 4 : 2));  // 1000 tokens left
    shards.read(990, 10, out.data());
    EXPECT_EQ(out.back(), 999);
    EXPECT_ERROR_CONTAINS(shards.read(4990, 10, out.data()),
                          "token shard '" + path + "' changed under the running job: it had " +
                              std::to_string(kHeaderBytes + 5000 * (u32 ? 4 : 2)) + " bytes at start and has " +
                              std::to_string(kHeaderBytes + 1000 * (u32 ? 4 : 2)) + " bytes now");
    std::filesystem::resize_file(path, 0);
    EXPECT_ERROR_CONTAINS(shards.read(0, 1, out.data()), "changed under the running job");
  }
}

TEST(WindowSampler, EachEpochIsAPermutationOfTheWindows) {
  WindowSampler w(1001, 10, 4, 7);  // 100 windows
  ASSERT_EQ(w.windows(), 100);
  std::vector<std::vector<uint32_t>> epochs;
  for (int e = 0; e < 3; ++e) {
    auto p = w.permutation(e);
    auto sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<uint32_t> all(100);
    std::iota(all.begin(), all.end(), 0u);
    EXPECT_EQ(sorted, all) << "epoch " << e;
    epochs.push_back(p);
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
  EXPECT_NE(WindowSampler(1001, 10, 4, 8).permutation(0), epochs[0]);  // another seed
  // The stream of rows is epoch 0's permutation, then epoch 1's: step 25 (rows 100..103) starts epoch 1.
  const auto b24 = w.batch_windows(24), b25 = w.batch_windows(25);
  EXPECT_EQ(b24, (std::vector<int64_t>{epochs[0][96], epochs[0][97], epochs[0][98], epochs[0][99]}));
  EXPECT_EQ(b25, (std::vector<int64_t>{epochs[1][0], epochs[1][1], epochs[1][2], epochs[1][3]}));
  EXPECT_EQ(w.position(25), (Position{1, 0}));
  EXPECT_EQ(w.position(26), (Position{1, 4}));
}

TEST(WindowSampler, BatchesStraddleEpochsAndDependOnlyOnSeedAndStep) {
  WindowSampler a(31, 3, 4, 5);  // 10 windows: a batch of 4 straddles epochs at step 2 (rows 8..11)
  const auto e0 = a.permutation(0), e1 = a.permutation(1);
  EXPECT_EQ(a.batch_windows(2), (std::vector<int64_t>{e0[8], e0[9], e1[0], e1[1]}));
  EXPECT_EQ(a.position(2), (Position{0, 8}));
  // Another sampler asked in another order (as a resumed run would) gives the same batches.
  WindowSampler b(31, 3, 4, 5);
  for (int s : {7, 3, 0, 2}) EXPECT_EQ(b.batch_windows(s), a.batch_windows(s)) << "step " << s;
}

TEST(Validation, ConsecutiveWindowsFromTheStart) {
  EXPECT_EQ(validation_windows(41, 4, 3, 0), (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(validation_windows(41, 4, 3, 1), (std::vector<int64_t>{3, 4, 5}));
  EXPECT_EQ(validation_windows(41, 4, 3, 3), (std::vector<int64_t>{9, 0, 1}));  // 10 windows: wraps
}

}  // namespace
