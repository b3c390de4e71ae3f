#pragma once
// index.json: the commit record of a checkpoint directory. It names the data files of one save
// and, for every tensor, its dtype, global shape and the chunks (row ranges) that hold it, each
// with CRC-32s of its 1 MiB blocks. Rank 0 writes it last, via a temporary name and rename.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

constexpr const char* kIndexFile = "index.json";
constexpr const char* kFormat = "fsdp-checkpoint";
constexpr int kFormatVersion = 1;
// Checksum granularity: a rank reading part of a chunk verifies at most one extra block per end.
constexpr uint64_t kChecksumBlockBytes = 1 << 20;

struct Chunk {
  std::string file;        // data file name inside the checkpoint directory
  int64_t row_offset = 0;  // first global row
  int64_t rows = 0;
  std::vector<uint32_t> block_crc32;  // per kChecksumBlockBytes block of the chunk's bytes
};

struct TensorRecord {
  std::string dtype;  // safetensors dtype name
  std::vector<int64_t> global_shape;
  std::vector<Chunk> chunks;  // sorted by row_offset
};

struct Index {
  std::string save_id;
  int world_size = 0;
  std::vector<std::string> files;
  std::map<std::string, TensorRecord> tensors;
};

// The chunk list a rank stores in its data file's metadata (key kChunksMetadataKey), from which
// rank 0 assembles the index.
constexpr const char* kChunksMetadataKey = "fsdp.chunks";
struct FileChunk {
  std::string key;
  std::string dtype;
  std::vector<int64_t> global_shape;
  int64_t row_offset = 0;
  int64_t rows = 0;
  std::vector<uint32_t> block_crc32;
};
std::string encode_file_chunks(const std::vector<FileChunk>& chunks);
std::vector<FileChunk> decode_file_chunks(const std::string& json, const std::string& source);

std::string encode_index(const Index& index);
// Throws CheckpointError naming `source` when the JSON or its structure is wrong.
Index decode_index(const std::string& json, const std::string& source);

// Reads dir/index.json; throws CheckpointError when there is none (no committed checkpoint).
Index read_index(const std::string& dir);

}  // namespace fsdp::checkpoint::detail
