#include "checkpoint_index.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "box.h"
#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::checkpoint::detail {

using nlohmann::json;

namespace {

// Every structural problem of an index becomes one CheckpointError naming the file.
template <typename Fn>
auto parse_or_throw(const std::string& source, Fn&& fn) {
  try {
    return fn();
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    throw CheckpointError("checkpoint: " + source + " is damaged or not a checkpoint index (" + e.what() +
                          "); load an earlier checkpoint");
  }
}

json chunk_json(const std::string& file, const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes,
                const std::vector<uint32_t>& crcs, const std::string& entry = "") {
  json j{{"offsets", offsets}, {"sizes", sizes}, {"crc32", crcs}};
  if (!file.empty()) j["file"] = file;
  if (!entry.empty()) j["entry"] = entry;
  return j;
}

// A chunk's box: format 2's "offsets"/"sizes", or format 1's dim-0 row range read as the box
// [row_offset, 0, ...] of sizes [rows, shape[1], ...] (a 0-d tensor: one row, the empty box).
void chunk_box(const json& c, const std::vector<int64_t>& shape, std::vector<int64_t>& offsets,
               std::vector<int64_t>& sizes, const std::string& source) {
  if (!c.contains("row_offset")) {
    offsets = c.at("offsets").get<std::vector<int64_t>>();
    sizes = c.at("sizes").get<std::vector<int64_t>>();
    return;
  }
  const auto row_offset = c.at("row_offset").get<int64_t>();
  const auto rows = c.at("rows").get<int64_t>();
  if (shape.empty()) {
    if (row_offset != 0 || rows != 1)
      throw CheckpointError("checkpoint: " + source + " is damaged: a chunk of a 0-d tensor has rows " +
                            std::to_string(row_offset) + ".." + std::to_string(row_offset + rows) +
                            "; load an earlier checkpoint");
    offsets.clear();
    sizes.clear();
    return;
  }
  offsets.assign(shape.size(), 0);
  sizes = shape;
  offsets[0] = row_offset;
  sizes[0] = rows;
}

}  // namespace

std::string encode_file_chunks(const std::vector<FileChunk>& chunks) {
  json j = json::object();
  for (const auto& c : chunks) {
    json entry = chunk_json("", c.offsets, c.sizes, c.block_crc32);
    entry["dtype"] = c.dtype;
    entry["shape"] = c.global_shape;
    if (!c.entry.empty()) entry["key"] = c.key;  // a second chunk of the key: stored under c.entry
    j[c.entry.empty() ? c.key : c.entry] = std::move(entry);
  }
  return j.dump();
}

std::vector<FileChunk> decode_file_chunks(const std::string& text, const std::string& source) {
  return parse_or_throw(source, [&] {
    std::vector<FileChunk> chunks;
    const json parsed = json::parse(text);  // named: items() of a temporary would dangle
    for (const auto& [key, entry] : parsed.items()) {
      FileChunk c;
      c.key = entry.contains("key") ? entry.at("key").get<std::string>() : key;
      if (c.key != key) c.entry = key;
      c.dtype = entry.at("dtype").get<std::string>();
      c.global_shape = entry.at("shape").get<std::vector<int64_t>>();
      chunk_box(entry, c.global_shape, c.offsets, c.sizes, source);
      c.block_crc32 = entry.at("crc32").get<std::vector<uint32_t>>();
      chunks.push_back(std::move(c));
    }
    return chunks;
  });
}

std::string encode_index(const Index& index) {
  json tensors = json::object();
  for (const auto& [key, record] : index.tensors) {
    json chunks = json::array();
    for (const auto& c : record.chunks)
      chunks.push_back(chunk_json(c.file, c.offsets, c.sizes, c.block_crc32, c.entry));
    tensors[key] = {{"dtype", record.dtype}, {"shape", record.global_shape}, {"chunks", std::move(chunks)}};
  }
  json j{{"format", kFormat},
         {"version", kFormatVersion},
         {"save_id", index.save_id},
         {"world_size", index.world_size},
         {"checksum_block_bytes", kChecksumBlockBytes},
         {"files", index.files},
         {"extras", index.extras},
         {"tensors", std::move(tensors)}};
  return j.dump(1);
}

Index decode_index(const std::string& text, const std::string& source) {
  return parse_or_throw(source, [&] {
    const json j = json::parse(text);
    if (j.at("format").get<std::string>() != kFormat)
      throw CheckpointError("checkpoint: " + source + " is not an fsdp checkpoint index (format '" +
                            j.at("format").get<std::string>() + "')");
    const int version = j.at("version").get<int>();
    if (version < kOldestFormatVersion || version > kFormatVersion)
      throw CheckpointError("checkpoint: " + source + " has format version " + std::to_string(version) +
                            " but this library reads versions " + std::to_string(kOldestFormatVersion) + " to " +
                            std::to_string(kFormatVersion) +
                            (version > kFormatVersion ? "; load it with a newer build of the library" : ""));
    if (j.at("checksum_block_bytes").get<uint64_t>() != kChecksumBlockBytes)
      throw CheckpointError("checkpoint: " + source + " uses another checksum block size");
    Index index;
    index.save_id = j.at("save_id").get<std::string>();
    index.world_size = j.at("world_size").get<int>();
    index.files = j.at("files").get<std::vector<std::string>>();
    index.extras = j.at("extras").get<std::vector<std::string>>();
    for (const auto& [key, entry] : j.at("tensors").items()) {
      TensorRecord record;
      record.dtype = entry.at("dtype").get<std::string>();
      record.global_shape = entry.at("shape").get<std::vector<int64_t>>();
      for (const auto& c : entry.at("chunks")) {
        Chunk chunk;
        chunk.file = c.at("file").get<std::string>();
        if (version == 1 && !c.contains("row_offset"))
          throw CheckpointError("checkpoint: " + source +
                                " (format 1) has a chunk without row_offset; load an earlier checkpoint");
        chunk_box(c, record.global_shape, chunk.offsets, chunk.sizes, source);
        chunk.block_crc32 = c.at("crc32").get<std::vector<uint32_t>>();
        if (c.contains("entry")) chunk.entry = c.at("entry").get<std::string>();
        record.chunks.push_back(std::move(chunk));
      }
      index.tensors.emplace(key, std::move(record));
    }
    return index;
  });
}

void check_tiling(const std::string& source, const std::string& key, const TensorRecord& record,
                  const std::string& advice) {
  std::vector<std::vector<int64_t>> offsets, sizes;
  for (const auto& c : record.chunks) {
    offsets.push_back(c.offsets);
    sizes.push_back(c.sizes);
  }
  const std::string problem = tiling_problem(record.global_shape, offsets, sizes);
  if (!problem.empty())
    throw CheckpointError("checkpoint: " + source + ": the chunks of '" + key + "' (shape " +
                          dims_text(record.global_shape) + ") do not tile it exactly: " + problem + "; " + advice);
}

Index read_index(const std::string& dir) {
  const auto path = std::filesystem::path(dir) / kIndexFile;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    std::error_code ec;
    if (std::filesystem::exists(path, ec)) {
      throw CheckpointError("checkpoint: " + path.string() + " exists but cannot be read (" +
                            (std::filesystem::is_directory(path, ec) ? std::string("it is a directory")
                                                                     : std::string(std::strerror(err))) +
                            "); fix its permissions, or load an earlier checkpoint");
    }
    const bool exists = std::filesystem::is_directory(dir);
    throw CheckpointError("checkpoint: no committed checkpoint in '" + dir + "' (" +
                          (exists ? "no index.json: the directory holds no save, or only an interrupted one"
                                  : "the directory does not exist") +
                          "); pass a directory written by fsdp::checkpoint::save, or use latest_checkpoint(root)");
  }
  std::stringstream text;
  text << in.rdbuf();
  return decode_index(text.str(), path.string());
}

}  // namespace fsdp::checkpoint::detail
