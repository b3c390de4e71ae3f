// How export_safetensors and consolidate_checkpoint split a model's tensors into safetensors files
// (Hugging Face's sharded layout: "model-00001-of-00003.safetensors" and an index).
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

namespace fsdp::checkpoint::detail {

// Tensors (by their byte sizes, in order) grouped into files of at most `max_file_bytes` each
// (0: one file); a tensor larger than the limit gets a file of its own. Indices into `bytes`.
inline std::vector<std::vector<size_t>> plan_files(const std::vector<uint64_t>& bytes, uint64_t max_file_bytes) {
  std::vector<std::vector<size_t>> files(1);
  uint64_t in_file = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (max_file_bytes && in_file > 0 && in_file + bytes[i] > max_file_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(i);
    in_file += bytes[i];
  }
  return files;
}

// File f of `count` written for `target`: target's own name when there is one file, else
// "<stem>-00001-of-00003.safetensors".
inline std::string planned_file_name(const std::filesystem::path& target, size_t f, size_t count) {
  if (count == 1) return target.filename().string();
  char buf[64];
  std::snprintf(buf, sizeof(buf), "-%05zu-of-%05zu.safetensors", f + 1, count);
  return target.stem().string() + buf;
}

}  // namespace fsdp::checkpoint::detail
