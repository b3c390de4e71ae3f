#pragma once
// index.json: the commit record of a checkpoint directory. It names the data files of one save
// and, for every tensor, its dtype, global shape and the chunks (boxes: offsets and sizes in every
// dimension, as DCP's chunk metadata) that hold it, each with CRC-32s of its 1 MiB blocks. Rank 0
// writes it last, via a temporary name and rename.
//
// Format versions: 2 (written now) records each chunk as {"offsets": [...], "sizes": [...]};
// 1 (before N-dimensional chunks) as dim-0 row ranges {"row_offset", "rows"}, which are read as
// the boxes [row_offset, 0, ...] of sizes [rows, shape[1], ...] (a 0-d tensor: the empty box).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

constexpr const char* kIndexFile = "index.json";
constexpr const char* kFormat = "fsdp-checkpoint";
constexpr int kFormatVersion = 2;        // written
constexpr int kOldestFormatVersion = 1;  // still read
// Checksum granularity: a rank reading part of a chunk verifies at most one extra block per end.
constexpr uint64_t kChecksumBlockBytes = 1 << 20;

struct Chunk {
  std::string file;                   // data file name inside the checkpoint directory
  std::vector<int64_t> offsets;       // the chunk's box in the global tensor, one per dimension
  std::vector<int64_t> sizes;         // (empty for a 0-d tensor); its bytes are the box row-major
  std::vector<uint32_t> block_crc32;  // per kChecksumBlockBytes block of the chunk's bytes
  // The chunk's tensor name in its file: "" for the key itself; a rank's second and later chunks
  // of one key (a strided tensor-parallel shard) are "<key>#<n>" (index field "entry").
  std::string entry;
};
// The name to read chunk `c` of `key` by in its file.
inline const std::string& entry_name(const std::string& key, const Chunk& c) { return c.entry.empty() ? key : c.entry; }

struct TensorRecord {
  std::string dtype;  // safetensors dtype name
  std::vector<int64_t> global_shape;
  std::vector<Chunk> chunks;  // sorted by offsets
};

struct Index {
  std::string save_id;
  int world_size = 0;
  std::vector<std::string> files;
  std::map<std::string, TensorRecord> tensors;
  std::vector<std::string> extras;  // names of the Stateful entries saved (even when empty)
};

// The chunk list a rank stores in its data file's metadata (key kChunksMetadataKey), from which
// rank 0 assembles the index.
constexpr const char* kChunksMetadataKey = "fsdp.chunks";
struct FileChunk {
  std::string key;
  std::string dtype;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  std::vector<uint32_t> block_crc32;
  std::string entry;  // as Chunk::entry ("" : the key)
};
std::string encode_file_chunks(const std::vector<FileChunk>& chunks);
std::vector<FileChunk> decode_file_chunks(const std::string& json, const std::string& source);

std::string encode_index(const Index& index);
// Throws CheckpointError naming `source` when the JSON or its structure is wrong.
Index decode_index(const std::string& json, const std::string& source);

// Throws CheckpointError naming `source` and `key` unless the chunks of `record` tile its global
// shape exactly (inside it, no overlaps, no gaps); `advice` ends the message.
void check_tiling(const std::string& source, const std::string& key, const TensorRecord& record,
                  const std::string& advice);

// Reads dir/index.json; throws CheckpointError when there is none (no committed checkpoint).
Index read_index(const std::string& dir);

}  // namespace fsdp::checkpoint::detail
