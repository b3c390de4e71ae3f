#pragma once
// Writes llm.c token shards for the tests, independently of the code under test: the header as
// llm.c's dev/data/data_common.py lays it out (256 little-endian int32: magic, version, count).
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace fsdp_data_test {

// `u32`: the Llama 3 variant (magic 20240801, version 7, uint32 tokens), else GPT-2's
// (20240520, 1, uint16). `vocab` goes to header[3] (0: none, as llm.c writes).
inline void write_shard(const std::string& path, const std::vector<uint32_t>& tokens, bool u32 = false,
                        int32_t vocab = 0, int32_t magic = 0, int32_t version = 0, int32_t count = -1) {
  int32_t header[256] = {};
  header[0] = magic ? magic : (u32 ? 20240801 : 20240520);
  header[1] = version ? version : (u32 ? 7 : 1);
  header[2] = count >= 0 ? count : static_cast<int32_t>(tokens.size());
  header[3] = vocab;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof header);
  for (const uint32_t t : tokens) {
    if (u32) {
      out.write(reinterpret_cast<const char*>(&t), 4);
    } else {
      const auto s = static_cast<uint16_t>(t);
      out.write(reinterpret_cast<const char*>(&s), 2);
    }
  }
}

}  // namespace fsdp_data_test
