#pragma once
// Reading a sharded checkpoint without the model that wrote it: what it holds, whether every
// byte is intact, and any tensor in full. The library under the `fsdp-ckpt` command
// (tools/fsdp_ckpt/); nothing here is collective and nothing needs a process group.
//
// Example:
//   namespace ckpt = fsdp::checkpoint;
//   const ckpt::CheckpointInfo info = ckpt::inspect_checkpoint("ckpt/step_000100");
//   for (const auto& t : info.tensors) std::cout << t.key << " " << t.dtype << "\n";
//   at::Tensor w = ckpt::read_full_tensor("ckpt/step_000100", "model.lm_head.weight");
//   const ckpt::VerifyReport report = ckpt::verify_checkpoint("ckpt/step_000100");
//   if (!report.ok()) std::cerr << report.problems.front().text() << "\n";
//
// Memory: read_full_tensor holds the tensor it returns plus at most one chunk of it (none when
// the chunks are whole rows, as dim-0 shards are); verify_checkpoint holds one 1 MiB checksum
// block at a time.
#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::checkpoint {

// Where one chunk of a tensor lies: a box of the global tensor (offsets and sizes per dim) held
// by one data file.
struct ChunkInfo {
  std::string file;              // data file name inside the checkpoint directory
  std::vector<int64_t> offsets;  // per dim
  std::vector<int64_t> sizes;    // per dim
  uint64_t bytes = 0;
};

struct TensorInfo {
  std::string key;             // "model.<fqn>", "optim.<fqn>.<field>", "extra.<entry>.<key>"
  std::string dtype;           // safetensors dtype name ("F32", "BF16", "I64", ...)
  std::vector<int64_t> shape;  // global
  uint64_t bytes = 0;          // of the full tensor
  std::vector<ChunkInfo> chunks;
};

struct CheckpointInfo {
  std::string dir;
  std::string save_id;
  int world_size = 0;  // ranks that saved it
  std::vector<std::string> files;
  std::map<std::string, uint64_t> file_bytes;            // size on disk; absent: the file is missing
  std::vector<std::string> extras;                       // Stateful entries saved
  std::vector<TensorInfo> tensors;                       // sorted by key
  const TensorInfo* find(const std::string& key) const;  // nullptr when absent
};

// "[2, 3]": a shape as the messages here (and fsdp-ckpt's tables) write it; "[]" for a 0-d tensor.
std::string shape_text(const std::vector<int64_t>& shape);

// Reads index.json (no data file is opened beyond a stat). Throws CheckpointError when there is
// no committed checkpoint or the index is damaged.
CheckpointInfo inspect_checkpoint(const std::string& dir);

// The full tensor `key`, assembled from its chunks, every byte checked against the index's
// CRC-32s. Throws CheckpointError naming the file and the key (missing key, missing or truncated
// file, checksum mismatch, chunks that do not tile the tensor).
at::Tensor read_full_tensor(const std::string& dir, const std::string& key);

// The same for many tensors: reads the index once and keeps the data files open.
// Example: CheckpointReader r("ckpt/step_000100"); for (auto& t : r.info().tensors) use(r.read(t.key));
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& dir);  // throws CheckpointError (no or damaged index)
  ~CheckpointReader();
  CheckpointReader(const CheckpointReader&) = delete;
  CheckpointReader& operator=(const CheckpointReader&) = delete;
  const CheckpointInfo& info() const;
  at::Tensor read(const std::string& key);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

struct VerifyProblem {
  std::string file;  // data file (or "index.json"); "" when none is to blame
  std::string key;   // tensor; "" when the whole file is bad
  std::string what;
  std::string text() const;  // "<file>: '<key>': <what>"
};
struct VerifyReport {
  int tensors_checked = 0;
  uint64_t bytes_checked = 0;
  std::vector<VerifyProblem> problems;  // in index order (files, then tensors by key)
  bool ok() const { return problems.empty(); }
};
// Example: VerifyOptions o; o.stop_at_first = true;   // stop at the first problem
struct VerifyOptions {
  bool stop_at_first = false;
  // Called after each tensor (key, its bytes), e.g. for a progress line.
  std::function<void(const std::string&, uint64_t)> on_tensor;
};
// Checks the index, every data file's header, every chunk's size and dtype, that the chunks tile
// each tensor, and every CRC-32. A damaged or missing index is one problem naming index.json.
VerifyReport verify_checkpoint(const std::string& dir, const VerifyOptions& options = {});

// Example: ConsolidateOptions o; o.max_shard_bytes = 5ull << 30;   // Hugging Face shards of 5 GiB
struct ConsolidateOptions {
  // Split into files of at most this many bytes (0: one file), named like export_safetensors's:
  // <stem>-00001-of-0000N.safetensors beside <out name>.index.json (the Hugging Face layout);
  // a tensor larger than the limit gets a file of its own.
  uint64_t max_shard_bytes = 0;
  // false: the model's tensors only ("model." keys, written without the prefix, as
  // export_safetensors names them). true: every tensor (optimizer state, extras) under its
  // checkpoint key.
  bool all_tensors = false;
};
// Writes the checkpoint's tensors in full to `out` (a .safetensors path), streaming: one tensor
// in memory at a time, each verified against its CRC-32s; each file through a temporary name and
// a rename. Returns the files written (the index last when split). The result loads with
// load_safetensors and any safetensors reader. Throws CheckpointError.
std::vector<std::string> consolidate_checkpoint(const std::string& dir, const std::string& out,
                                                const ConsolidateOptions& options = {});

// Per-tensor comparison of two checkpoints.
struct TensorDiff {
  std::string key;
  // "" when both hold it with the same dtype and shape (then max_abs_diff is meaningful), else
  // e.g. "only in A", "only in B", "shape [2, 3] vs [3, 2]", "dtype F32 vs BF16".
  std::string mismatch;
  double max_abs_diff = 0;  // NaN against a number counts as infinity; NaN against NaN as 0
  bool differs = false;     // a mismatch, or max_abs_diff above DiffOptions::atol
};
// Example: DiffOptions o; o.atol = 1e-6;   // differences up to 1e-6 count as equal
struct DiffOptions {
  double atol = 0;
};
struct DiffReport {
  std::vector<TensorDiff> tensors;  // the union of both key sets, sorted
  int differing = 0;
  bool same() const { return differing == 0; }
};
// Reads one tensor pair at a time (both verified against their CRC-32s). Throws CheckpointError
// when either checkpoint cannot be read.
DiffReport diff_checkpoints(const std::string& dir_a, const std::string& dir_b, const DiffOptions& options = {});

}  // namespace fsdp::checkpoint
