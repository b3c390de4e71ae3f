// Sharded save and load. See include/fsdp/checkpoint/checkpoint.h for the format and the commit
// protocol; the steps of a save are:
//   1. every rank stages the tensors it writes (async: copies on CPU, then a background thread),
//   2. rank 0 picks a save id (broadcast), every rank writes data-<id>-rank<r>.safetensors through
//      a temporary name + rename; the file's metadata lists its chunks and their block CRCs,
//   3. all ranks agree that every file was written (all-gather of failure flags),
//   4. rank 0 reads the files' headers, writes index.json.tmp, renames it over index.json (the
//      commit), then deletes the files the replaced index named and leftovers of saves that never
//      committed here (see "What a save may delete" in the header); the outcome is broadcast.
// A directory whose index.json exists but cannot be read is never saved into (checked by every
// rank before it writes, and by rank 0 again before the commit). A save that fails removes its
// own files: each rank its data file (and temporary), rank 0 its index.json.tmp.
// Collectives run on a dedicated process group, so a background save never interleaves with the
// training's collectives on the world group (what DCP's async_save does with its own Gloo group).
#include "fsdp/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "box.h"
#include "checkpoint/safetensors_format.h"
#include "checkpoint_index.h"
#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/comm/comm.h"
#include "fsdp/debug/fault_injection.h"
#include "fsdp/detail/checkpoint_files.h"
#include "fsdp/dist/runtime.h"
#include "state_items.h"

namespace fsdp::checkpoint {

namespace fs = std::filesystem;
using detail::Chunk;
using detail::FileChunk;
using detail::Index;
using detail::global_rank;
using detail::key_list;
using detail::LocalItem;
using detail::shape_text;

namespace {

// One group for all checkpoint traffic, created collectively at the first save after each
// init_distributed (the world group's identity tells when the runtime was re-initialised). A Gloo
// group of its own (dist::new_cpu_group): an async save's collectives run on their own connections,
// concurrently with training's, and every tensor it moves is on the CPU whatever the device.
std::shared_ptr<comm::Comm> checkpoint_comm() {
  static std::mutex mutex;
  static std::weak_ptr<comm::Comm> for_world;
  static std::shared_ptr<comm::Comm> group;
  static int generation = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (!dist::is_initialized()) {
    if (!group || !for_world.expired() || group->size() != 1) group = comm::Comm::single_process("checkpoint");
    for_world.reset();
    return group;
  }
  auto world = dist::world_comm();
  if (!group || for_world.lock() != world) {
    std::vector<int> ranks(world->size());
    for (int r = 0; r < world->size(); ++r) ranks[r] = r;
    group = dist::new_cpu_group(ranks, "checkpoint-" + std::to_string(generation++));
    for_world = world;
  }
  return group;
}

std::string error_text(int err) { return std::strerror(err); }

void fsync_path(const fs::path& path, bool directory) {
  if (auto why = detail::fsync_path(path, directory)) throw CheckpointError("checkpoint: " + *why);
}

void rename_or_throw(const fs::path& from, const fs::path& to) {
  std::error_code ec;
  fs::rename(from, to, ec);
  if (ec)
    throw CheckpointError("checkpoint: cannot rename '" + from.string() + "' to '" + to.string() +
                          "': " + ec.message());
}

std::string data_file_name(const std::string& save_id, int rank) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "data-%s-rank%05d.safetensors", save_id.c_str(), rank);
  return buf;
}

// A name only a save writes: data-<16 hex>-rank<5+ digits>.safetensors, optionally + ".tmp", or
// index.json.tmp. Files named otherwise are never deleted.
bool is_save_file_name(const std::string& name) {
  if (name == std::string(detail::kIndexFile) + ".tmp") return true;
  std::string rest = name;
  const std::string tmp = ".tmp";
  if (rest.size() > tmp.size() && rest.compare(rest.size() - tmp.size(), tmp.size(), tmp) == 0)
    rest.resize(rest.size() - tmp.size());
  const std::string prefix = "data-", suffix = ".safetensors";
  if (rest.size() < prefix.size() + 16 + 9 + suffix.size() || rest.compare(0, prefix.size(), prefix) != 0 ||
      rest.compare(rest.size() - suffix.size(), suffix.size(), suffix) != 0)
    return false;
  const std::string middle = rest.substr(prefix.size(), rest.size() - prefix.size() - suffix.size());
  if (middle.size() < 16 + 5 + 5 || middle.compare(16, 5, "-rank") != 0) return false;
  for (size_t i = 0; i < middle.size(); ++i) {
    if (i >= 16 && i < 21) continue;
    const char c = middle[i];
    const bool ok = i < 16 ? ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f')) : (c >= '0' && c <= '9');
    if (!ok) return false;
  }
  return true;
}

// Deletes a regular file (never a directory or anything else), ignoring errors.
void remove_regular_file(const fs::path& path) {
  std::error_code ec;
  if (fs::is_regular_file(fs::symlink_status(path, ec))) fs::remove(path, ec);
}

bool index_file_exists(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(fs::path(dir) / detail::kIndexFile, ec));
}

// Why `dir`'s index.json cannot be read ("" when it reads), without the advice read_index adds.
std::string index_problem(const std::string& dir) {
  try {
    detail::read_index(dir);
    return "";
  } catch (const CheckpointError& e) {
    std::string text = e.what();
    if (text.rfind("checkpoint: ", 0) == 0) text = text.substr(12);
    for (const char* advice : {"; load an earlier checkpoint", "; fix its permissions"})
      if (auto at = text.rfind(advice); at != std::string::npos) text.resize(at);
    return text;
  }
}

// A save never writes into a directory whose index exists but cannot be read: its data files may
// be all that is left of that checkpoint.
void refuse_damaged_target(const std::string& dir) {
  if (!index_file_exists(dir)) return;
  const std::string problem = index_problem(dir);
  if (!problem.empty())
    throw CheckpointError("checkpoint: refusing to save into '" + dir + "': its index.json cannot be read (" + problem +
                          "); nothing in it was changed. Move the folder aside (or save elsewhere)");
}

// What an uncommitted directory holds, for reports.
std::string uncommitted_contents(const std::string& dir) {
  int data = 0, tmp = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!is_save_file_name(name)) continue;
    (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 ? tmp : data) += 1;
  }
  if (data == 0 && tmp == 0) return "no index.json and no checkpoint files";
  return "no index.json: a save interrupted before its commit (" + std::to_string(data) + " data file" +
         (data == 1 ? "" : "s") + ", " + std::to_string(tmp) + " temporary file" + (tmp == 1 ? "" : "s") + ")";
}

// Writes `text` to `path` (created or truncated) and fsyncs it; `fail_half_way` is the test hook
// that stops half way with ENOSPC.
void write_synced_file(const fs::path& path, const std::string& text, bool fail_half_way) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw CheckpointError("checkpoint: cannot write '" + path.string() + "': " + error_text(errno));
  const size_t length = fail_half_way ? text.size() / 2 : text.size();
  size_t done = 0;
  int err = 0;
  while (done < length) {
    const ssize_t n = ::write(fd, text.data() + done, length - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : ENOSPC;
      break;
    }
    done += static_cast<size_t>(n);
  }
  if (err == 0 && fail_half_way) err = ENOSPC;
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0)
    throw CheckpointError("checkpoint: cannot write '" + path.string() + "': " + error_text(err) +
                          (fail_half_way ? " (SaveFaults::fail_after_files, injected by a test)" : ""));
}

std::vector<uint32_t> block_crcs(const uint8_t* data, uint64_t bytes) {
  std::vector<uint32_t> crcs;
  for (uint64_t at = 0; at < bytes; at += detail::kChecksumBlockBytes)
    crcs.push_back(safetensors::crc32(data + at, std::min<uint64_t>(detail::kChecksumBlockBytes, bytes - at)));
  return crcs;
}

// ---- save ----------------------------------------------------------------------------------

std::mutex& save_faults_mutex() {
  static std::mutex m;
  return m;
}
SaveFaults& injected_save_faults() {
  static SaveFaults faults;
  return faults;
}

struct SavePlan {
  std::string dir;
  SaveFaults options;               // injected failures (fsdp/debug/fault_injection.h); none in training
  std::vector<std::string> extras;  // Stateful entry names, recorded in the index
  std::vector<LocalItem> items;     // only what this rank writes; `local` contiguous on CPU
};

// Keys that not every rank holds (expert parallelism: each ep group holds its own experts): the
// writer rules pick one writer per box by global rank 0, which may hold no such key, leaving it
// unwritten. One small all-gather tells whether every rank holds the same keys (the usual case:
// nothing more); if not, the ranks exchange their key lists and each item's rule is applied with
// the lowest global rank holding its key in rank 0's place (DCP's dedup picks one writer alike).
void settle_writers(std::vector<LocalItem>& items, comm::Comm& group) {
  if (group.size() == 1) return;
  std::vector<std::string> keys;
  for (const auto& item : items) keys.push_back(item.key);
  std::sort(keys.begin(), keys.end());
  std::string joined;
  for (const auto& key : keys) joined += key + '\n';
  const at::Tensor mine = at::tensor(
      {static_cast<int64_t>(joined.size()), static_cast<int64_t>(safetensors::crc32(joined.data(), joined.size()))},
      at::kLong);
  at::Tensor sizes = at::empty({group.size() * 2}, at::kLong);
  group.all_gather_into_tensor(sizes, mine);
  const auto* s = sizes.data_ptr<int64_t>();
  bool same = true;
  int64_t longest = 0;
  for (int r = 0; r < group.size(); ++r) {
    same = same && s[2 * r] == s[0] && s[2 * r + 1] == s[1];
    longest = std::max(longest, s[2 * r]);
  }
  if (same) return;
  at::Tensor text = at::zeros({std::max<int64_t>(longest, 1)}, at::kByte);
  std::memcpy(text.data_ptr(), joined.data(), joined.size());
  at::Tensor all = at::empty({group.size() * text.numel()}, at::kByte);
  group.all_gather_into_tensor(all, text);
  std::map<std::string, int> first;  // key -> the lowest rank holding it
  for (int r = 0; r < group.size(); ++r) {
    const char* begin = reinterpret_cast<const char*>(all.data_ptr<uint8_t>()) + r * text.numel();
    const std::string list(begin, static_cast<size_t>(s[2 * r]));
    for (size_t at = 0, end; at < list.size(); at = end + 1) {
      end = list.find('\n', at);
      first.emplace(list.substr(at, end - at), r);  // ranks in ascending order: the first stays
    }
  }
  for (auto& item : items)
    if (item.writer_if_first) item.writer = item.writer_if_first(first.at(item.key));
}

SavePlan make_plan(const std::string& dir, const State& state, bool copy, comm::Comm& group) {
  const SaveFaults options = save_faults();
  if (!state.model && state.tensors.empty())
    throw CheckpointError(
        "checkpoint::save: State::model is null and State::tensors empty; pass the (sharded) model "
        "or the tensors to save");
  if (!state.model && state.optimizer)
    throw CheckpointError(
        "checkpoint::save: State::optimizer needs State::model (its state is saved by parameter name)");
  const int rank = global_rank();
  std::vector<LocalItem> all = state.model ? detail::model_items(*state.model, rank) : std::vector<LocalItem>{};
  auto tensors = detail::sharded_tensor_items(state.tensors, nullptr);
  all.insert(all.end(), std::make_move_iterator(tensors.begin()), std::make_move_iterator(tensors.end()));
  if (state.optimizer) {
    auto optim = detail::optimizer_save_items(*state.optimizer, *state.model, rank);
    all.insert(all.end(), std::make_move_iterator(optim.begin()), std::make_move_iterator(optim.end()));
  }
  auto extras = detail::extra_save_items(state.extras, rank);
  all.insert(all.end(), std::make_move_iterator(extras.begin()), std::make_move_iterator(extras.end()));
  settle_writers(all, group);

  SavePlan plan{dir, options, {}, {}};
  for (const auto& [name, stateful] : state.extras)
    if (stateful) plan.extras.push_back(name);
  std::set<std::string> seen;
  for (auto& item : all) {
    if (!seen.insert(item.key).second)
      throw CheckpointError("checkpoint::save: two tensors share the key '" + item.key +
                            "' (an extras name joined to one of its keys spells another entry's key; rename one)");
    if (!item.writer) continue;
    // Async saves copy now: training may change the tensors while the files are written.
    at::Tensor cpu = item.local.to(at::kCPU, /*non_blocking=*/false, /*copy=*/copy).contiguous();
    item.local = cpu;
    for (auto& piece : item.pieces)
      piece.local = piece.local.to(at::kCPU, /*non_blocking=*/false, /*copy=*/copy).contiguous();
    plan.items.push_back(std::move(item));
  }
  return plan;
}

std::string make_save_id(comm::Comm& group) {
  at::Tensor id = at::zeros({1}, at::kLong);
  if (group.rank() == 0) {
    std::random_device rd;
    const uint64_t bits =
        (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
    id[0] = static_cast<int64_t>(bits & 0x7fffffffffffffffULL);
  }
  group.broadcast(id, 0);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(id[0].item<int64_t>()));
  return buf;
}

void write_rank_file(const SavePlan& plan, const std::string& save_id, int rank) {
  if (plan.options.abort_after_files == 0) std::abort();
  if (plan.options.fail_after_files == 0) {
    // As on a full disk: half a temporary file, then ENOSPC.
    const fs::path tmp = (fs::path(plan.dir) / data_file_name(save_id, rank)).string() + ".tmp";
    write_synced_file(tmp, std::string(4096, '\0'), /*fail_half_way=*/true);
  }
  std::vector<safetensors::NamedTensor> tensors;
  std::vector<FileChunk> chunks;
  for (const auto& item : plan.items) {
    // One chunk per box (a strided TP shard has several: the second and later are stored under
    // "<key>#<n>", named by the index's "entry").
    const auto pieces = detail::boxes(item);
    for (size_t n = 0; n < pieces.size(); ++n) {
      const at::Tensor& local = pieces[n].local;
      const auto bytes = static_cast<uint64_t>(local.nbytes());
      FileChunk c;
      c.key = item.key;
      c.entry = n == 0 ? "" : item.key + "#" + std::to_string(n);
      c.dtype = safetensors::dtype_name(local.scalar_type());
      c.global_shape = item.global_shape;
      c.offsets = pieces[n].offsets;
      c.sizes = local.sizes().vec();
      c.block_crc32 = block_crcs(static_cast<const uint8_t*>(local.data_ptr()), bytes);
      tensors.push_back({c.entry.empty() ? item.key : c.entry, local});
      chunks.push_back(std::move(c));
    }
  }
  const fs::path final_path = fs::path(plan.dir) / data_file_name(save_id, rank);
  const fs::path tmp_path = final_path.string() + ".tmp";
  safetensors::write_file(tmp_path.string(), tensors,
                          {{detail::kChunksMetadataKey, detail::encode_file_chunks(chunks)}});
  rename_or_throw(tmp_path, final_path);
  if (plan.options.abort_after_files == 1) std::abort();
}

// Rank 0: assemble the index from the files' own metadata and commit it.
Index build_index(const std::string& dir, const std::string& save_id, int world) {
  Index index;
  index.save_id = save_id;
  index.world_size = world;
  for (int r = 0; r < world; ++r) {
    const std::string name = data_file_name(save_id, r);
    safetensors::Reader reader((fs::path(dir) / name).string());
    index.files.push_back(name);
    auto found = reader.header().metadata.find(detail::kChunksMetadataKey);
    if (found == reader.header().metadata.end())
      throw CheckpointError("checkpoint: " + reader.path() + " lacks its chunk list");
    for (auto& c : detail::decode_file_chunks(found->second, reader.path())) {
      auto& record = index.tensors[c.key];
      if (record.chunks.empty()) {
        record.dtype = c.dtype;
        record.global_shape = c.global_shape;
      } else if (record.dtype != c.dtype || record.global_shape != c.global_shape) {
        throw CheckpointError("checkpoint: ranks disagree on the dtype or shape of '" + c.key + "'");
      }
      record.chunks.push_back(
          Chunk{name, std::move(c.offsets), std::move(c.sizes), std::move(c.block_crc32), std::move(c.entry)});
    }
  }
  for (auto& [key, record] : index.tensors) {
    std::sort(record.chunks.begin(), record.chunks.end(),
              [](const Chunk& a, const Chunk& b) { return a.offsets < b.offsets; });
    detail::check_tiling(
        "save to '" + dir + "'", key, record,
        "were the boxes the same on every rank, and each replicated box written once (ShardedTensor::write)?");
  }
  return index;
}

// Rank 0: writes index.json.tmp and renames it over index.json; `renamed` is set once the save is
// committed (errors after that do not undo it). Then deletes what the replaced index named and
// leftovers of saves that never committed here: nothing else.
void commit_index(const SavePlan& plan, const Index& index, bool& renamed) {
  const std::string& dir = plan.dir;
  const fs::path final_path = fs::path(dir) / detail::kIndexFile;
  const fs::path tmp_path = final_path.string() + ".tmp";
  std::optional<Index> replaced;
  if (index_file_exists(dir)) {
    refuse_damaged_target(dir);  // it may have been damaged while the data files were written
    replaced = detail::read_index(dir);
  }
  write_synced_file(tmp_path, detail::encode_index(index), plan.options.fail_after_files == 1);
  rename_or_throw(tmp_path, final_path);
  renamed = true;
  fsync_path(dir, true);
  std::set<std::string> keep(index.files.begin(), index.files.end());
  keep.insert(detail::kIndexFile);
  if (replaced) {
    for (const auto& name : replaced->files)
      if (!keep.count(name) && name.find('/') == std::string::npos && name != "." && name != "..")
        remove_regular_file(fs::path(dir) / name);
  }
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!keep.count(name) && is_save_file_name(name)) remove_regular_file(entry.path());
  }
}

// A save that did not commit: this rank removes the files it wrote (the save id is fresh, so
// nothing else carries it).
void remove_own_files(const std::string& dir, const std::string& save_id, int rank) {
  const fs::path final_path = fs::path(dir) / data_file_name(save_id, rank);
  remove_regular_file(final_path.string() + ".tmp");
  remove_regular_file(final_path);
}

void write_and_commit(const SavePlan& plan, comm::Comm& group) {
  const std::string save_id = make_save_id(group);
  const int rank = group.rank(), world = group.size();

  std::string local_error;
  try {
    refuse_damaged_target(plan.dir);
    fs::create_directories(plan.dir);
    write_rank_file(plan, save_id, rank);
  } catch (const std::exception& e) {
    local_error = e.what();
  }
  at::Tensor failed = at::zeros({world}, at::kLong);
  group.all_gather_into_tensor(failed, at::full({1}, local_error.empty() ? 0 : 1, at::kLong));
  std::string failed_ranks;
  for (int r = 0; r < world; ++r)
    if (failed[r].item<int64_t>()) failed_ranks += (failed_ranks.empty() ? "" : ", ") + std::to_string(r);
  if (!failed_ranks.empty()) {
    remove_own_files(plan.dir, save_id, rank);
    throw CheckpointError("checkpoint: save to '" + plan.dir + "' failed on rank(s) " + failed_ranks +
                          (local_error.empty() ? "" : " (here: " + local_error + ")") +
                          "; nothing was committed, the save's files were removed and the directory's "
                          "previous checkpoint is untouched");
  }

  // 0: not committed (every rank removes its file), 1: committed, 2: committed, then an error.
  at::Tensor outcome = at::zeros({1}, at::kLong);
  std::string commit_error;
  if (rank == 0) {
    bool renamed = false;
    try {
      Index index = build_index(plan.dir, save_id, world);
      index.extras = plan.extras;
      commit_index(plan, index, renamed);
      outcome[0] = 1;
    } catch (const std::exception& e) {
      commit_error = e.what();
      outcome[0] = renamed ? 2 : 0;
      if (!renamed) remove_regular_file(fs::path(plan.dir) / (std::string(detail::kIndexFile) + ".tmp"));
    }
  }
  group.broadcast(outcome, 0);
  const int64_t result = outcome[0].item<int64_t>();
  if (result == 0) {
    remove_own_files(plan.dir, save_id, rank);
    throw CheckpointError(rank == 0 ? commit_error +
                                          "; nothing was committed, the save's files were removed and the "
                                          "directory's previous checkpoint is untouched"
                                    : "checkpoint: rank 0 could not commit the save to '" + plan.dir +
                                          "' (see rank 0's error); nothing was committed, the save's files were "
                                          "removed and the previous checkpoint is untouched");
  }
  if (result == 2)
    throw CheckpointError(rank == 0 ? commit_error + " (after the commit: the new checkpoint is in place)"
                                    : "checkpoint: rank 0 failed after committing the save to '" + plan.dir +
                                          "' (see rank 0's error)");
}

// At most one save in flight; a new save (sync or async) first waits for the previous one.
struct InFlight {
  std::mutex mutex;
  std::thread thread;
  ~InFlight() {
    if (thread.joinable()) thread.join();
  }
};
InFlight& in_flight() {
  static InFlight slot;
  return slot;
}
void wait_for_previous_save() {
  auto& slot = in_flight();
  std::lock_guard<std::mutex> lock(slot.mutex);
  if (slot.thread.joinable()) slot.thread.join();
}

// ---- load ----------------------------------------------------------------------------------

class ChunkReader {
 public:
  explicit ChunkReader(std::string dir) : dir_(std::move(dir)) {}
  uint64_t bytes_read() const { return bytes_read_; }

  // Copies the box of `key` that starts at `offsets` into `dst` (a CPU tensor of the box's sizes,
  // any strides): from every chunk that overlaps the box, only the part inside it.
  void read_box(const std::string& key, const detail::TensorRecord& record, const std::vector<int64_t>& offsets,
                const at::Tensor& dst) {
    const std::vector<int64_t> sizes = dst.sizes().vec();
    const int64_t element = static_cast<int64_t>(dst.element_size());
    int64_t covered = 0;
    std::vector<int64_t> lo, n;
    for (const auto& chunk : record.chunks) {
      if (!detail::intersect(offsets, sizes, chunk.offsets, chunk.sizes, lo, n)) continue;
      at::Tensor target = dst;
      std::vector<int64_t> rel(lo.size());
      for (size_t d = 0; d < lo.size(); ++d) {
        target = target.narrow(static_cast<int64_t>(d), lo[d] - offsets[d], n[d]);
        rel[d] = lo[d] - chunk.offsets[d];
      }
      read_chunk_region(key, chunk, element, rel, n, target);
      covered += detail::volume(n);
    }
    if (covered != detail::volume(sizes))
      throw CheckpointError("checkpoint: '" + dir_ + "' does not hold all of the box at " + detail::dims_text(offsets) +
                            " of '" + key +
                            "' (chunks overlap or leave gaps); the index is damaged, load an earlier checkpoint");
  }

 private:
  // Reads the region (rel, n) of `chunk` (offsets relative to the chunk) into `target`: the
  // region's contiguous byte runs, reading each touched 1 MiB checksum block once (in windows of
  // at most kWindowBlocks) and verifying it.
  void read_chunk_region(const std::string& key, const Chunk& chunk, int64_t element, const std::vector<int64_t>& rel,
                         const std::vector<int64_t>& n, const at::Tensor& target) {
    safetensors::Reader& reader = open(chunk.file);
    const std::string& name = detail::entry_name(key, chunk);
    const auto& entry = reader.entry(name);
    const uint64_t chunk_bytes = static_cast<uint64_t>(detail::volume(chunk.sizes) * element);
    const uint64_t B = detail::kChecksumBlockBytes;
    if (entry.nbytes() != chunk_bytes || chunk.block_crc32.size() != (chunk_bytes + B - 1) / B)
      throw CheckpointError("checkpoint: " + reader.path() + ": '" + key + "' holds " + std::to_string(entry.nbytes()) +
                            " bytes but the index describes " + std::to_string(chunk_bytes) +
                            "; the file does not belong to this index, load an earlier checkpoint");
    const detail::Runs runs(chunk.sizes, rel, n, element);
    const uint64_t run = runs.run_bytes();
    // The blocks the runs touch, as ranges [first, end) of consecutive blocks.
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    for (int64_t j = 0; j < runs.count(); ++j) {
      const uint64_t begin = runs.offset(j) / B, end = (runs.offset(j) + run + B - 1) / B;
      if (!ranges.empty() && begin <= ranges.back().second)
        ranges.back().second = std::max(ranges.back().second, end);
      else
        ranges.emplace_back(begin, end);
    }
    // Runs land in `target` directly when its region is contiguous, else in a staging copy.
    const bool direct = target.is_contiguous();
    at::Tensor staging = direct ? target : at::empty(n, target.options());
    auto* out = static_cast<uint8_t*>(staging.data_ptr());
    int64_t j = 0;  // the first run not yet copied completely
    for (const auto& [first, end] : ranges) {
      for (uint64_t w = first; w < end; w += kWindowBlocks) {
        const uint64_t w_end = std::min(end, w + kWindowBlocks);
        const uint64_t read_begin = w * B, read_end = std::min(w_end * B, chunk_bytes);
        buffer_.resize(read_end - read_begin);
        reader.read_bytes(name, read_begin, buffer_.size(), buffer_.data());
        bytes_read_ += buffer_.size();
        for (uint64_t b = w; b < w_end; ++b) {
          const uint64_t off = b * B - read_begin, len = std::min(B, chunk_bytes - b * B);
          if (safetensors::crc32(buffer_.data() + off, len) != chunk.block_crc32[b])
            throw CheckpointError("checkpoint: " + reader.path() + ": checksum mismatch in '" + key + "' (bytes " +
                                  std::to_string(b * B) + ".." + std::to_string(b * B + len) +
                                  " of the chunk): the file is corrupt; load an earlier checkpoint");
        }
        // Copy the parts of runs inside this window; a run may continue into the next one.
        for (; j < runs.count(); ++j) {
          const uint64_t s = runs.offset(j), e = s + run;
          if (s >= read_end) break;
          const uint64_t from = std::max(s, read_begin), to = std::min(e, read_end);
          std::memcpy(out + static_cast<uint64_t>(j) * run + (from - s), buffer_.data() + (from - read_begin),
                      to - from);
          if (e > read_end) break;
        }
      }
    }
    if (!direct) target.copy_(staging);
  }

  static constexpr uint64_t kWindowBlocks = 16;  // at most 16 MiB read at once

  safetensors::Reader& open(const std::string& file) {
    auto& slot = readers_[file];
    if (!slot) {
      if (file.find('/') != std::string::npos || file.find("..") != std::string::npos)
        throw CheckpointError("checkpoint: the index names a file outside the directory: '" + file + "'");
      try {
        slot = std::make_unique<safetensors::Reader>((fs::path(dir_) / file).string());
      } catch (const safetensors::SafetensorsError& e) {
        throw CheckpointError(std::string("checkpoint: ") + e.what() + "; load an earlier checkpoint");
      }
    }
    return *slot;
  }

  std::string dir_;
  std::map<std::string, std::unique_ptr<safetensors::Reader>> readers_;
  std::vector<uint8_t> buffer_;
  uint64_t bytes_read_ = 0;
};

void check_model_keys(const std::string& dir, const Index& index, const std::vector<LocalItem>& items, bool has_model,
                      bool strict) {
  std::set<std::string> state_keys;
  for (const auto& item : items) state_keys.insert(item.key);
  std::vector<std::string> missing, unexpected;
  for (const auto& key : state_keys)
    if (!index.tensors.count(key)) missing.push_back(key);
  auto under = [](const std::string& key, const char* prefix) { return key.rfind(prefix, 0) == 0; };
  for (const auto& [key, record] : index.tensors) {
    if (state_keys.count(key)) continue;
    const bool model_key = under(key, "model.");
    if ((model_key && has_model) || (!model_key && !under(key, "optim.") && !under(key, "extra.")))
      unexpected.push_back(key);
  }
  if (strict && (!missing.empty() || !unexpected.empty()))
    throw CheckpointError("checkpoint: '" + dir + "' does not match the model: " +
                          (missing.empty() ? "" : "missing from the checkpoint: " + key_list(missing)) +
                          (!missing.empty() && !unexpected.empty() ? "; " : "") +
                          (unexpected.empty() ? "" : "not in the model: " + key_list(unexpected)) +
                          ". Was it saved from another model? (LoadOptions::strict = false loads the keys both have)");
}

void load_item(ChunkReader& reader, const std::string& dir, const Index& index, LocalItem& item) {
  const auto& record = index.tensors.at(item.key);
  const std::string dtype = safetensors::dtype_name(item.local.scalar_type());
  if (record.dtype != dtype)
    throw CheckpointError("checkpoint: '" + item.key + "' is " + record.dtype + " in '" + dir + "' but " + dtype +
                          " in the model; build the model with the dtype it was saved with");
  if (record.global_shape != item.global_shape)
    throw CheckpointError("checkpoint: '" + item.key + "' has shape " + shape_text(record.global_shape) + " in '" +
                          dir + "' but " + shape_text(item.global_shape) +
                          " in the model; the checkpoint is from another model configuration");
  for (const auto& piece : detail::boxes(item)) {  // a strided TP shard: several boxes
    if (piece.local.numel() == 0) continue;
    const bool direct = piece.local.device().is_cpu() && piece.local.is_contiguous();
    at::Tensor staging = direct ? piece.local : at::empty(piece.local.sizes(), piece.local.options().device(at::kCPU));
    reader.read_box(item.key, record, piece.offsets, staging);
    if (!direct) {
      at::NoGradGuard no_grad;
      piece.local.copy_(staging);
    }
  }
}

}  // namespace

// ---- public API ----------------------------------------------------------------------------

void set_save_faults(const SaveFaults& faults) {
  std::lock_guard<std::mutex> lock(save_faults_mutex());
  injected_save_faults() = faults;
}

SaveFaults save_faults() {
  std::lock_guard<std::mutex> lock(save_faults_mutex());
  return injected_save_faults();
}

void save(const std::string& dir, const State& state) {
  wait_for_previous_save();
  auto group = checkpoint_comm();
  write_and_commit(make_plan(dir, state, /*copy=*/false, *group), *group);
}

AsyncSave async_save(const std::string& dir, const State& state) {
  wait_for_previous_save();
  auto group = checkpoint_comm();
  auto plan = std::make_shared<SavePlan>(make_plan(dir, state, /*copy=*/true, *group));
  auto promise = std::make_shared<std::promise<void>>();
  std::shared_future<void> done = promise->get_future().share();
  auto& slot = in_flight();
  std::lock_guard<std::mutex> lock(slot.mutex);
  slot.thread = std::thread([plan, group, promise] {
    try {
      write_and_commit(*plan, *group);
      promise->set_value();
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
  });
  return AsyncSave(std::move(done));
}

void AsyncSave::wait() {
  if (!done_.valid()) return;
  done_.get();
}

bool AsyncSave::ready() const {
  return done_.valid() && done_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
}

LoadStats load(const std::string& dir, const State& state, const LoadOptions& options) {
  if (!state.model && state.tensors.empty())
    throw CheckpointError(
        "checkpoint::load: State::model is null and State::tensors empty; pass the (sharded) model "
        "or the tensors to load");
  if (!state.model && state.optimizer)
    throw CheckpointError(
        "checkpoint::load: State::optimizer needs State::model (its state is loaded by parameter name)");
  wait_for_previous_save();  // loading what an in-flight save is writing would race
  const Index index = detail::read_index(dir);
  // Chunks must tile each tensor exactly (a damaged or hand-edited index must not load garbage).
  for (const auto& [key, record] : index.tensors)
    detail::check_tiling("'" + dir + "'", key, record, "the index is damaged, load an earlier checkpoint");
  std::vector<LocalItem> items =
      state.model ? detail::model_items(*state.model, global_rank()) : std::vector<LocalItem>{};
  auto tensors = detail::sharded_tensor_items(state.tensors, nullptr);
  items.insert(items.end(), std::make_move_iterator(tensors.begin()), std::make_move_iterator(tensors.end()));
  {
    std::set<std::string> seen;
    for (const auto& item : items)
      if (!seen.insert(item.key).second)
        throw CheckpointError("checkpoint::load: two tensors of the state share the key '" + item.key +
                              "' (a State::tensors key spells a model key; rename it)");
  }
  check_model_keys(dir, index, items, state.model != nullptr, options.strict);
  if (state.optimizer && options.load_optimizer) {
    auto optim = detail::optimizer_load_items(*state.optimizer, *state.model,
                                              [&](const std::string& key) { return index.tensors.count(key) > 0; });
    items.insert(items.end(), std::make_move_iterator(optim.begin()), std::make_move_iterator(optim.end()));
  }
  ChunkReader reader(dir);
  for (auto& item : items) {
    if (!index.tensors.count(item.key)) continue;  // missing keys were refused above when strict
    load_item(reader, dir, index, item);
    if (item.on_loaded) item.on_loaded();
  }
  for (const auto& [name, stateful] : state.extras) {
    if (!stateful) continue;
    const std::string prefix = "extra." + name + ".";
    std::map<std::string, at::Tensor> values;
    for (const auto& [key, record] : index.tensors) {
      if (key.rfind(prefix, 0) != 0) continue;
      LocalItem item;
      item.key = key;
      item.global_shape = record.global_shape;
      item.offsets.assign(record.global_shape.size(), 0);
      item.local =
          at::empty(record.global_shape, at::TensorOptions().dtype(safetensors::dtype_from_name(record.dtype)));
      load_item(reader, dir, index, item);
      values.emplace(key.substr(prefix.size()), item.local);
    }
    const bool saved = std::find(index.extras.begin(), index.extras.end(), name) != index.extras.end();
    if (!saved && options.strict)
      throw CheckpointError("checkpoint: '" + dir + "' has no values for extras entry '" + name +
                            "'; it was saved without it (LoadOptions::strict = false skips it)");
    if (saved) stateful->load_state_dict(values);
  }
  return LoadStats{reader.bytes_read()};
}

bool is_committed(const std::string& dir) {
  try {
    detail::read_index(dir);
    return true;
  } catch (const CheckpointError&) {
    return false;
  }
}

const char* to_string(CheckpointStatus status) {
  switch (status) {
    case CheckpointStatus::committed: return "committed";
    case CheckpointStatus::uncommitted: return "uncommitted";
    case CheckpointStatus::damaged: return "damaged";
  }
  return "?";
}

std::vector<CheckpointCandidate> scan_checkpoints(const std::string& root) {
  std::vector<CheckpointCandidate> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    std::error_code entry_ec;
    if (!entry.is_directory(entry_ec)) continue;
    CheckpointCandidate c;
    c.path = entry.path().string();
    if (!index_file_exists(c.path)) {
      c.status = CheckpointStatus::uncommitted;
      c.problem = uncommitted_contents(c.path);
    } else {
      c.problem = index_problem(c.path);
      c.status = c.problem.empty() ? CheckpointStatus::committed : CheckpointStatus::damaged;
    }
    out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointCandidate& a, const CheckpointCandidate& b) {
    return fs::path(a.path).filename().string() < fs::path(b.path).filename().string();
  });
  return out;
}

std::optional<std::string> latest_checkpoint(const std::string& root) {
  const auto all = scan_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->status == CheckpointStatus::committed) return it->path;
    if (it->status == CheckpointStatus::damaged)
      throw CheckpointError("checkpoint: '" + it->path + "' is damaged: " + it->problem +
                            "; its files were left as they are. Not falling back to an older checkpoint: load one "
                            "by its path, or move the damaged folder aside");
  }
  return std::nullopt;
}

std::map<std::string, TensorMeta> describe(const std::string& dir) {
  std::map<std::string, TensorMeta> out;
  for (const auto& [key, record] : detail::read_index(dir).tensors)
    out[key] = TensorMeta{record.dtype, record.global_shape};
  return out;
}

std::map<std::string, at::Tensor> ScalarState::state_dict() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, value] : ints) out[name] = at::scalar_tensor(value, at::kLong);
  for (const auto& [name, value] : doubles) out[name] = at::scalar_tensor(value, at::kDouble);
  return out;
}

void ScalarState::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  for (const auto& [name, value] : state) {
    if (value.numel() != 1) throw CheckpointError("checkpoint: ScalarState value '" + name + "' is not a scalar");
    if (value.scalar_type() == at::kLong)
      ints[name] = value.item<int64_t>();
    else
      doubles[name] = value.item<double>();
  }
}

std::map<std::string, at::Tensor> CpuRngState::state_dict() const {
  return {{"cpu", at::detail::getDefaultCPUGenerator().get_state()}};
}

void CpuRngState::load_state_dict(const std::map<std::string, at::Tensor>& state) {
  auto found = state.find("cpu");
  if (found == state.end())
    throw CheckpointError("checkpoint: CpuRngState: the checkpoint holds no 'cpu' generator state");
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(found->second);
}

namespace detail {

std::optional<std::string> fsync_path(const std::filesystem::path& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_DIRECTORY : 0) | O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "cannot open '" + path.string() + "' to sync it: " + std::strerror(errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return "fsync of '" + path.string() + "' failed: " + std::strerror(err);
  return std::nullopt;
}

}  // namespace detail

}  // namespace fsdp::checkpoint
