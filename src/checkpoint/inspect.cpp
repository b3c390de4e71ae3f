// Reading a checkpoint without its model (include/fsdp/checkpoint/inspect.h): the index says
// which file holds which box of each tensor and the CRC-32 of every 1 MiB block of each chunk.
// chunk_box() below is the only code that knows how an index chunk maps onto the global tensor;
// everything else works on boxes (offsets and sizes per dim).
#include "fsdp/checkpoint/inspect.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors_format.h"
#include "checkpoint_index.h"
#include "file_plan.h"
#include "fsdp/checkpoint/safetensors.h"

namespace fsdp::checkpoint {

namespace fs = std::filesystem;

namespace {

uint64_t numel_of(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

uint64_t element_bytes(const std::string& dtype) { return c10::elementSize(safetensors::dtype_from_name(dtype)); }

// A chunk's box (checkpoint_index.h: offsets and sizes in every dimension, format 2; a format-1
// row range is read as such a box; a 0-d tensor has an empty box of one element). The only place
// that reads Chunk's geometry.
ChunkInfo chunk_box(const detail::TensorRecord& record, const detail::Chunk& chunk) {
  ChunkInfo box;
  box.file = chunk.file;
  box.offsets = chunk.offsets;
  box.sizes = chunk.sizes;
  box.bytes = numel_of(box.sizes) * element_bytes(record.dtype);
  return box;
}

// A box is contiguous in its row-major tensor when every dim after the first it cuts is whole
// (dim-0 shards always are): then the chunk's bytes can go straight into place.
bool box_is_contiguous(const std::vector<int64_t>& shape, const ChunkInfo& box) {
  size_t d = 0;
  while (d < shape.size() && box.sizes[d] == 1) ++d;  // leading single-index dims
  for (size_t e = d + 1; e < shape.size(); ++e)
    if (box.offsets[e] != 0 || box.sizes[e] != shape[e]) return false;
  return true;
}

uint64_t box_start_element(const std::vector<int64_t>& shape, const ChunkInfo& box) {
  uint64_t index = 0;
  for (size_t d = 0; d < shape.size(); ++d)
    index = index * static_cast<uint64_t>(shape[d]) + static_cast<uint64_t>(box.offsets[d]);
  return index;
}

// The chunks must cover the tensor exactly once: inside it, pairwise disjoint, volumes summing
// to its numel. "" when they do, else what is wrong.
std::string tiling_problem(const TensorInfo& t) {
  uint64_t covered = 0;
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const auto& a = t.chunks[i];
    if (a.offsets.size() != t.shape.size()) return "a chunk has another rank than the tensor";
    for (size_t d = 0; d < t.shape.size(); ++d)
      if (a.offsets[d] < 0 || a.sizes[d] < 0 || a.offsets[d] + a.sizes[d] > t.shape[d])
        return "a chunk in " + a.file + " lies outside the tensor's shape " + shape_text(t.shape);
    for (size_t j = 0; j < i; ++j) {
      const auto& b = t.chunks[j];
      bool overlap = numel_of(a.sizes) > 0 && numel_of(b.sizes) > 0;
      for (size_t d = 0; d < t.shape.size() && overlap; ++d)
        overlap = a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
      if (overlap) return "chunks in " + b.file + " and " + a.file + " overlap";
    }
    covered += numel_of(a.sizes);
  }
  if (covered != numel_of(t.shape))
    return "its chunks hold " + std::to_string(covered) + " of its " + std::to_string(numel_of(t.shape)) +
           " elements (a gap)";
  return "";
}

}  // namespace

// Opens data files once each, refusing names that leave the directory. Outside the anonymous
// namespace: CheckpointReader::Impl holds one (a unity build would warn, -Wsubobject-linkage).
namespace detail {
class Files {
 public:
  explicit Files(std::string dir) : dir_(std::move(dir)) {}
  safetensors::Reader& open(const std::string& file) {
    auto& slot = readers_[file];
    if (!slot) {
      if (file.empty() || file.find('/') != std::string::npos || file.find("..") != std::string::npos)
        throw CheckpointError("checkpoint: the index of '" + dir_ + "' names a file outside the directory: '" + file +
                              "'");
      const fs::path path = fs::path(dir_) / file;
      std::error_code ec;
      if (!fs::exists(path, ec))
        throw CheckpointError("checkpoint: " + path.string() + " is missing (the index names it)");
      try {
        slot = std::make_unique<safetensors::Reader>(path.string());
      } catch (const safetensors::SafetensorsError& e) {
        throw CheckpointError(std::string("checkpoint: ") + e.what());
      }
    }
    return *slot;
  }

 private:
  std::string dir_;
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers_;
};
}  // namespace detail
using detail::Files;

namespace {

// Reads chunk `box` of `key` into `dst` (the chunk's bytes, row-major in its box), checking
// every block's CRC-32 against `crcs`.
void read_chunk(Files& files, const std::string& dir, const std::string& key, const std::string& dtype,
                const ChunkInfo& box, const std::vector<uint32_t>& crcs, uint8_t* dst) {
  safetensors::Reader& reader = files.open(box.file);
  const safetensors::TensorEntry* entry = reader.header().find(key);
  if (entry == nullptr)
    throw CheckpointError("checkpoint: " + reader.path() + ": '" + key +
                          "' is not in the file, but the index says it is");
  if (safetensors::dtype_name(entry->dtype) != dtype || entry->nbytes() != box.bytes)
    throw CheckpointError("checkpoint: " + reader.path() + ": '" + key + "' is " +
                          safetensors::dtype_name(entry->dtype) + ", " + std::to_string(entry->nbytes()) +
                          " bytes, but the index describes " + dtype + ", " + std::to_string(box.bytes) +
                          " bytes; the file does not belong to this index");
  const uint64_t B = detail::kChecksumBlockBytes;
  if (crcs.size() != (box.bytes + B - 1) / B)
    throw CheckpointError("checkpoint: " + dir + "/index.json: '" + key + "' lists " + std::to_string(crcs.size()) +
                          " checksums for " + std::to_string(box.bytes) + " bytes; the index is damaged");
  reader.read_bytes(key, 0, box.bytes, dst);
  for (uint64_t b = 0; b * B < box.bytes; ++b) {
    const uint64_t len = std::min(B, box.bytes - b * B);
    if (safetensors::crc32(dst + b * B, len) != crcs[b])
      throw CheckpointError("checkpoint: " + reader.path() + ": checksum mismatch in '" + key + "' (bytes " +
                            std::to_string(b * B) + ".." + std::to_string(b * B + len) +
                            " of the chunk): the file is corrupt");
  }
}

const detail::TensorRecord& record_of(const detail::Index& index, const std::string& dir, const std::string& key) {
  auto it = index.tensors.find(key);
  if (it == index.tensors.end())
    throw CheckpointError("checkpoint: '" + dir + "' has no tensor '" + key + "' (`fsdp-ckpt describe " + dir +
                          "` lists them)");
  return it->second;
}

TensorInfo tensor_info(const std::string& key, const detail::TensorRecord& record) {
  TensorInfo t;
  t.key = key;
  t.dtype = record.dtype;
  t.shape = record.global_shape;
  t.bytes = numel_of(t.shape) * element_bytes(t.dtype);
  for (const auto& chunk : record.chunks) t.chunks.push_back(chunk_box(record, chunk));
  return t;
}

at::Tensor assemble(Files& files, const std::string& dir, const TensorInfo& t, const detail::TensorRecord& record) {
  if (const std::string problem = tiling_problem(t); !problem.empty())
    throw CheckpointError("checkpoint: " + dir + "/index.json: '" + t.key + "': " + problem + "; the index is damaged");
  at::Tensor full = at::empty(t.shape, at::TensorOptions().dtype(safetensors::dtype_from_name(t.dtype)));
  auto* base = static_cast<uint8_t*>(full.data_ptr());
  const uint64_t elem = element_bytes(t.dtype);
  for (size_t i = 0; i < t.chunks.size(); ++i) {
    const ChunkInfo& box = t.chunks[i];
    if (box.bytes == 0) continue;
    if (box_is_contiguous(t.shape, box)) {
      read_chunk(files, dir, detail::entry_name(t.key, record.chunks[i]), t.dtype, box, record.chunks[i].block_crc32,
                 base + box_start_element(t.shape, box) * elem);
      continue;
    }
    at::Tensor part = at::empty(box.sizes, full.options());
    read_chunk(files, dir, detail::entry_name(t.key, record.chunks[i]), t.dtype, box, record.chunks[i].block_crc32,
               static_cast<uint8_t*>(part.data_ptr()));
    at::Tensor view = full;
    for (size_t d = 0; d < t.shape.size(); ++d)
      view = view.narrow(static_cast<int64_t>(d), box.offsets[d], box.sizes[d]);
    view.copy_(part);
  }
  return full;
}

CheckpointInfo info_from_index(const std::string& dir, const detail::Index& index) {
  CheckpointInfo info;
  info.dir = dir;
  info.save_id = index.save_id;
  info.world_size = index.world_size;
  info.files = index.files;
  info.extras = index.extras;
  for (const auto& file : index.files) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(dir) / file, ec);
    if (!ec) info.file_bytes[file] = size;
  }
  for (const auto& [key, record] : index.tensors) info.tensors.push_back(tensor_info(key, record));  // map: sorted
  return info;
}

}  // namespace

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

const TensorInfo* CheckpointInfo::find(const std::string& key) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), key,
                             [](const TensorInfo& t, const std::string& k) { return t.key < k; });
  return it != tensors.end() && it->key == key ? &*it : nullptr;
}

CheckpointInfo inspect_checkpoint(const std::string& dir) { return info_from_index(dir, detail::read_index(dir)); }

struct CheckpointReader::Impl {
  explicit Impl(const std::string& d) : dir(d), index(detail::read_index(d)), files(d) {}
  std::string dir;
  detail::Index index;
  Files files;
  CheckpointInfo info;
};

CheckpointReader::CheckpointReader(const std::string& dir) : impl_(std::make_unique<Impl>(dir)) {
  impl_->info = info_from_index(dir, impl_->index);
}
CheckpointReader::~CheckpointReader() = default;

const CheckpointInfo& CheckpointReader::info() const { return impl_->info; }

at::Tensor CheckpointReader::read(const std::string& key) {
  const auto& record = record_of(impl_->index, impl_->dir, key);
  return assemble(impl_->files, impl_->dir, tensor_info(key, record), record);
}

at::Tensor read_full_tensor(const std::string& dir, const std::string& key) { return CheckpointReader(dir).read(key); }

std::string VerifyProblem::text() const {
  std::string out = file.empty() ? "" : file + ": ";
  if (!key.empty()) out += "'" + key + "': ";
  return out + what;
}

VerifyReport verify_checkpoint(const std::string& dir, const VerifyOptions& options) {
  VerifyReport report;
  detail::Index index;
  try {
    index = detail::read_index(dir);
  } catch (const CheckpointError& e) {
    report.problems.push_back({detail::kIndexFile, "", e.what()});
    return report;
  }
  auto add = [&](VerifyProblem p) {
    report.problems.push_back(std::move(p));
    return options.stop_at_first;
  };
  // Every data file: present and with a valid header (a truncated file fails here).
  Files files(dir);
  std::set<std::string> bad_files;
  for (const auto& file : index.files) {
    try {
      files.open(file);
    } catch (const CheckpointError& e) {
      bad_files.insert(file);
      if (add({file, "", e.what()})) return report;
    }
  }
  // Every tensor: its chunks tile it, and every block of every chunk matches its CRC-32.
  const uint64_t B = detail::kChecksumBlockBytes;
  std::vector<uint8_t> buffer;
  for (const auto& [key, record] : index.tensors) {
    const TensorInfo t = tensor_info(key, record);
    if (const std::string problem = tiling_problem(t); !problem.empty()) {
      if (add({detail::kIndexFile, key, problem + "; the index is damaged"})) return report;
      continue;
    }
    for (size_t i = 0; i < t.chunks.size(); ++i) {
      const ChunkInfo& box = t.chunks[i];
      if (bad_files.count(box.file)) continue;  // reported above
      try {
        safetensors::Reader& reader = files.open(box.file);
        const std::string& name = detail::entry_name(key, record.chunks[i]);
        const safetensors::TensorEntry* entry = reader.header().find(name);
        if (entry == nullptr) throw CheckpointError("not in the file, but the index says it is");
        if (safetensors::dtype_name(entry->dtype) != t.dtype || entry->nbytes() != box.bytes)
          throw CheckpointError("the file holds " + safetensors::dtype_name(entry->dtype) + ", " +
                                std::to_string(entry->nbytes()) + " bytes; the index describes " + t.dtype + ", " +
                                std::to_string(box.bytes) + " bytes (the file does not belong to this index)");
        const auto& crcs = record.chunks[i].block_crc32;
        if (crcs.size() != (box.bytes + B - 1) / B)
          throw CheckpointError("the index lists " + std::to_string(crcs.size()) + " checksums for " +
                                std::to_string(box.bytes) + " bytes (the index is damaged)");
        for (uint64_t b = 0; b * B < box.bytes; ++b) {
          const uint64_t len = std::min(B, box.bytes - b * B);
          buffer.resize(len);
          reader.read_bytes(name, b * B, len, buffer.data());
          if (safetensors::crc32(buffer.data(), len) != crcs[b])
            throw CheckpointError("checksum mismatch in bytes " + std::to_string(b * B) + ".." +
                                  std::to_string(b * B + len) + " of its chunk: the file is corrupt");
          report.bytes_checked += len;
        }
      } catch (const std::exception& e) {
        std::string what = e.what();
        if (what.rfind("checkpoint: ", 0) == 0) what = what.substr(12);
        if (add({box.file, key, what})) return report;
      }
    }
    ++report.tensors_checked;
    if (options.on_tensor) options.on_tensor(key, t.bytes);
  }
  return report;
}

namespace {

// A tensor consolidate_checkpoint writes, with its name in the output.
struct ConsolidateItem {
  const TensorInfo* tensor;
  std::string name;
};

std::vector<ConsolidateItem> consolidate_items(const CheckpointReader& reader, const std::string& dir,
                                               const ConsolidateOptions& options) {
  const std::string prefix = "model.";
  std::vector<ConsolidateItem> items;
  for (const auto& t : reader.info().tensors) {
    if (options.all_tensors)
      items.push_back({&t, t.key});
    else if (t.key.rfind(prefix, 0) == 0)
      items.push_back({&t, t.key.substr(prefix.size())});
  }
  if (items.empty())
    throw CheckpointError("consolidate: '" + dir +
                          "' holds no model tensors (\"model.\" keys); pass all_tensors "
                          "(fsdp-ckpt consolidate --all) to write every tensor");
  return items;
}

// Writes one output file (through a temporary renamed into place); records its tensors in
// weight_map and total.
void write_consolidated_file(CheckpointReader& reader, const std::vector<ConsolidateItem>& items,
                             const std::vector<size_t>& file, const fs::path& path, const std::string& file_name,
                             std::map<std::string, std::string>& weight_map, uint64_t& total) {
  std::error_code ec;
  const std::string tmp = path.string() + ".tmp";
  try {
    std::vector<safetensors::TensorSpec> specs;
    for (size_t i : file)
      specs.push_back({items[i].name, safetensors::dtype_from_name(items[i].tensor->dtype), items[i].tensor->shape});
    safetensors::StreamWriter writer(tmp, specs, {{"format", "pt"}});
    for (size_t i : file) {
      writer.append(reader.read(items[i].tensor->key));  // one full tensor in memory at a time
      weight_map[items[i].name] = file_name;
      total += items[i].tensor->bytes;
    }
    writer.finish();
  } catch (const std::exception& e) {
    fs::remove(tmp, ec);
    const std::string what = e.what();
    throw CheckpointError(
        what.rfind("checkpoint: ", 0) == 0 ? what : "consolidate: writing '" + path.string() + "' failed: " + what);
  }
  fs::rename(tmp, path, ec);
  if (ec) throw CheckpointError("consolidate: cannot rename '" + tmp + "' to '" + path.string() + "': " + ec.message());
}

// The Hugging Face index: {"metadata": {"total_size": N}, "weight_map": {name: file}}.
std::string write_consolidated_index(const fs::path& target, const std::map<std::string, std::string>& weight_map,
                                     uint64_t total) {
  std::error_code ec;
  const std::string json = nlohmann::json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2);
  const fs::path index_path = target.parent_path() / (target.filename().string() + ".index.json");
  const std::string tmp = index_path.string() + ".tmp";
  {
    std::ofstream o(tmp, std::ios::trunc | std::ios::binary);
    o << json;
    o.flush();
    if (!o) throw CheckpointError("consolidate: cannot write '" + tmp + "'");
  }
  fs::rename(tmp, index_path, ec);
  if (ec) throw CheckpointError("consolidate: cannot rename '" + tmp + "': " + ec.message());
  return index_path.string();
}

}  // namespace

std::vector<std::string> consolidate_checkpoint(const std::string& dir, const std::string& out,
                                                const ConsolidateOptions& options) {
  CheckpointReader reader(dir);
  const std::vector<ConsolidateItem> items = consolidate_items(reader, dir, options);
  // Files planned from the sizes, as export_safetensors plans them.
  std::vector<uint64_t> sizes;
  for (const auto& item : items) sizes.push_back(item.tensor->bytes);
  const auto plan = detail::plan_files(sizes, options.max_shard_bytes);
  const fs::path target(out);
  std::error_code ec;
  if (!target.parent_path().empty()) fs::create_directories(target.parent_path(), ec);
  std::vector<std::string> written;
  std::map<std::string, std::string> weight_map;
  uint64_t total = 0;
  for (size_t f = 0; f < plan.size(); ++f) {
    const std::string name = detail::planned_file_name(target, f, plan.size());
    const fs::path path = target.parent_path() / name;
    write_consolidated_file(reader, items, plan[f], path, name, weight_map, total);
    written.push_back(path.string());
  }
  if (plan.size() > 1) written.push_back(write_consolidated_index(target, weight_map, total));
  return written;
}

DiffReport diff_checkpoints(const std::string& dir_a, const std::string& dir_b, const DiffOptions& options) {
  CheckpointReader a(dir_a), b(dir_b);
  std::set<std::string> keys;
  for (const auto& t : a.info().tensors) keys.insert(t.key);
  for (const auto& t : b.info().tensors) keys.insert(t.key);
  DiffReport report;
  for (const auto& key : keys) {
    TensorDiff d;
    d.key = key;
    const TensorInfo* ta = a.info().find(key);
    const TensorInfo* tb = b.info().find(key);
    if (!ta)
      d.mismatch = "only in B";
    else if (!tb)
      d.mismatch = "only in A";
    else if (ta->shape != tb->shape)
      d.mismatch = "shape " + shape_text(ta->shape) + " vs " + shape_text(tb->shape);
    else if (ta->dtype != tb->dtype)
      d.mismatch = "dtype " + ta->dtype + " vs " + tb->dtype;
    if (d.mismatch.empty()) {
      const at::Tensor va = a.read(key).flatten(), vb = b.read(key).flatten();
      constexpr int64_t kSlice = 1 << 20;  // elements converted to double at a time
      for (int64_t at = 0; at < va.numel(); at += kSlice) {
        const int64_t n = std::min(kSlice, va.numel() - at);
        const at::Tensor x = va.narrow(0, at, n).to(at::kDouble), y = vb.narrow(0, at, n).to(at::kDouble);
        at::Tensor diff = (x - y).abs();
        diff.masked_fill_(at::isnan(x) & at::isnan(y), 0.0);
        diff.masked_fill_(at::isnan(x) ^ at::isnan(y), std::numeric_limits<double>::infinity());
        diff.masked_fill_(at::isnan(diff), 0.0);  // inf - inf of the same sign
        d.max_abs_diff = std::max(d.max_abs_diff, diff.max().item<double>());
      }
    }
    d.differs = !d.mismatch.empty() || d.max_abs_diff > options.atol;
    report.differing += d.differs ? 1 : 0;
    report.tensors.push_back(std::move(d));
  }
  return report;
}

}  // namespace fsdp::checkpoint
