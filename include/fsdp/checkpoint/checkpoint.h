#pragma once
// Sharded checkpoints (torch.distributed.checkpoint for LibTorch, on safetensors).
//
// Example:
//   fsdp::checkpoint::ScalarState trainer_values;               // e.g. ints["step"]
//   fsdp::checkpoint::State state{model.ptr(), &optimizer, {{"trainer", &trainer_values}}};
//   fsdp::checkpoint::save("ckpt/step_000100", state);          // every rank, in parallel
//   auto pending = fsdp::checkpoint::async_save("ckpt/step_000200", state);   // or in the background
//   pending.wait();                                             // its errors surface here
//   if (auto dir = fsdp::checkpoint::latest_checkpoint("ckpt"))
//     fsdp::checkpoint::load(*dir, state);                      // any world size (N -> M)
//
// A checkpoint is a directory: one safetensors file per writing rank, holding that rank's box of
// each sharded tensor (global shape, and the box's offsets and sizes in every dimension, in the
// index: format 2; format-1 checkpoints, split along dim 0 only, still load), and `index.json`, written last by
// rank 0 through a temporary name + rename. The index is the commit: until it is renamed in, the
// save does not exist, and a directory's previous checkpoint (its own index and files, which the
// new save never overwrites) stays loadable. Each chunk carries CRC-32s of 1 MiB blocks, so a
// rank that reads only the part of a chunk it needs still verifies every byte it reads.
//
// What a save may delete (never data that it did not itself write, nor data of a checkpoint it
// cannot read):
//   - A save into a directory whose index.json exists but cannot be read (damaged, truncated, not
//     an index) is refused before anything is written: the damaged checkpoint's files stay as
//     they are, for a person to inspect or repair.
//   - After a successful commit, rank 0 deletes the files the replaced (readable) index named,
//     and leftovers of saves that never committed in this directory: files named like a data
//     file (data-<16 hex>-rank<5 digits>.safetensors, or that + ".tmp") that the new index does
//     not name, and index.json.tmp. Nothing else in the directory is touched.
//   - A save that fails (a full disk, a rank that cannot write) removes what it wrote itself:
//     each rank its own data file (and its temporary) of that save, rank 0 its index.json.tmp.
//     The directory's previous checkpoint stays committed and loadable.
//   - One writer per directory: two concurrent saves into one directory are not supported (the
//     trainer takes a DirectoryLock on its checkpoint root, see lock.h).
//
// Keys: "model.<fqn>" for parameters and buffers, "optim.<fqn>.<state>" for optimizer state
// (exp_avg, exp_avg_sq, step, momentum_buffer, sum, square_avg, ...) — by parameter name, never by
// position — "optim.param_groups.<g>.<hyperparameter>" for each param group's lr, betas, ...
// (fsdp/checkpoint/optimizer_state.h: the optimizers supported and how to register another), and
// "extra.<name>.<key>" for Stateful values, and State::tensors' keys as they are.
#include <torch/nn/module.h>

#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace torch::optim {
class Optimizer;
}

namespace fsdp::checkpoint {

// A load refused because another optimizer saved the state (CheckpointError::optimizer_mismatch):
// the registered codecs' names (optimizer_state.h), for a caller to name its own fix.
// Example: OptimizerMismatch m{{"Adam", "AdamW"}, "SGD"};  // AdamW's state given to SGD
struct OptimizerMismatch {
  std::vector<std::string> saved_by;  // the codecs that save what was found (empty: not known)
  std::string given;                  // the codec of the optimizer given to load
};

// Corrupt, truncated, uncommitted or mismatched checkpoints: the message names the directory or
// file, the key, what is wrong and what to do.
// Example:
//   try {
//     load("ckpt/step_000100", State{model.ptr(), &optimizer});
//   } catch (const CheckpointError& e) {
//     if (e.optimizer_mismatch) fail("saved by " + e.optimizer_mismatch->saved_by.at(0) + ": pick it");
//     throw;
//   }
class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  CheckpointError(const std::string& what, OptimizerMismatch mismatch)
      : std::runtime_error(what), optimizer_mismatch(std::move(mismatch)) {}
  // Set when the optimizer state was saved by another optimizer than the one given.
  std::optional<OptimizerMismatch> optimizer_mismatch;
};

// User values (step counter, RNG state, data position): tensors by key. Saved from rank 0 and
// given to every rank on load.
class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual std::map<std::string, at::Tensor> state_dict() const = 0;
  virtual void load_state_dict(const std::map<std::string, at::Tensor>& state) = 0;
};

// A Stateful of named int64 / double scalars, enough for most training loops.
class ScalarState : public Stateful {
 public:
  std::map<std::string, int64_t> ints;
  std::map<std::string, double> doubles;
  std::map<std::string, at::Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, at::Tensor>& state) override;
};

// The default CPU generator's state (what torch::manual_seed sets), so that dropout masks or data
// shuffles continue exactly after a resume. Saved from rank 0 like every Stateful: ranks that seed
// their generators differently should each keep their own seed in a ScalarState instead.
class CpuRngState : public Stateful {
 public:
  std::map<std::string, at::Tensor> state_dict() const override;
  void load_state_dict(const std::map<std::string, at::Tensor>& state) override;
};

// A tensor split into boxes of any layout, without any parallelism library (what DCP saves for a
// ShardedTensor or a DTensor of any placement): this rank holds `local`, the box of the global
// tensor that starts at `offsets` (one per dimension) and has local's sizes. The boxes of all
// ranks must tile the global tensor; a box held by several ranks (replicated) is written once:
// `write = false` on all its holders but one. Loading fills `local` from the checkpoint whatever
// boxes wrote it (any world size, any layout).
// Rows 0..3 and columns 3..5 of an [8, 6] tensor, a box replicated on two ranks (one writes it):
// Example:
//   const int replica = 0;  // this rank's index among the box's holders
//   ckpt::ShardedTensor box{at::zeros({4, 3}), {8, 6}, {0, 3}, /*write=*/replica == 0};
//   ckpt::save("ckpt/step_100", ckpt::State{.tensors = {{"table", box}}});
struct ShardedTensor {
  at::Tensor local;                   // this rank's box (any device; may be empty)
  std::vector<int64_t> global_shape;  // the whole tensor's shape
  std::vector<int64_t> offsets;       // the box's first index in every dimension
  bool write = true;                  // false: another rank writes the same box
};

struct State {
  std::shared_ptr<torch::nn::Module> model;      // sharded by fully_shard or not (optional when
                                                 // `tensors` is not empty)
  torch::optim::Optimizer* optimizer = nullptr;  // optional (needs `model`): see optimizer_state.h
  std::map<std::string, Stateful*> extras;       // optional
  std::map<std::string, ShardedTensor> tensors;  // optional: saved under their keys as given
};

// Example: LoadOptions o; o.strict = false; o.load_optimizer = false;   // the weights, of the keys both have
struct LoadOptions {
  // Keys in the checkpoint absent from the state, or the reverse, are errors (the checkpoint's
  // "model." keys when State::model is set, its keys outside "model.", "optim.", "extra." always).
  bool strict = true;
  // Load the optimizer state too when the checkpoint has it.
  bool load_optimizer = true;
};

// Collective: every rank of the model's mesh calls it with the same directory (created if
// needed; must be on a filesystem every rank sees).
void save(const std::string& dir, const State& state);
// Reads into the current sharding, whatever world size and layout wrote the checkpoint. Not
// collective: each rank reads, of every chunk overlapping its box, only the contiguous byte runs
// it needs, rounded out to whole 1 MiB checksum blocks (every byte used is verified).
struct LoadStats {
  uint64_t bytes_read = 0;  // tensor data this rank read from the data files
};
LoadStats load(const std::string& dir, const State& state, const LoadOptions& options = {});

// Async save: the state is copied to CPU memory before this returns (training may then change
// the parameters); files are written by a background thread. At most one save is in flight:
// starting another waits for the previous one. Errors surface on wait().
class AsyncSave {
 public:
  AsyncSave() = default;
  explicit AsyncSave(std::shared_future<void> done) : done_(std::move(done)) {}
  void wait();         // rethrows the background error, if any
  bool ready() const;  // finished (successfully or not)
  bool valid() const { return done_.valid(); }

 private:
  std::shared_future<void> done_;
};
AsyncSave async_save(const std::string& dir, const State& state);

// True when `dir` holds a committed checkpoint (an index.json that parses).
bool is_committed(const std::string& dir);

// What a directory under a checkpoint root is:
//   committed    its index.json reads: a loadable checkpoint (data files are checked on load);
//   uncommitted  no index.json: a save killed before its commit (data files or .tmp only), or a
//                folder that is no checkpoint at all; skipped, it holds nothing committed;
//   damaged      an index.json exists but cannot be read (garbage, `{}`, truncated, unreadable):
//                its data files may be intact, so it is never skipped silently nor written over.
enum class CheckpointStatus { committed, uncommitted, damaged };
const char* to_string(CheckpointStatus status);
struct CheckpointCandidate {
  std::string path;
  CheckpointStatus status = CheckpointStatus::uncommitted;
  std::string problem;  // damaged: why the index cannot be read; uncommitted: what the folder holds
};
// Example: for (auto& c : scan_checkpoints("ckpt")) std::cout << c.path << " " << to_string(c.status);
// Every directory directly under `root`, sorted by name (empty when `root` does not exist).
std::vector<CheckpointCandidate> scan_checkpoints(const std::string& root);

// The committed checkpoint directory directly under `root` whose name sorts last (e.g.
// step_000300 after step_000200), if any. For `--resume`. Uncommitted directories are skipped;
// a damaged one that sorts after the chosen checkpoint is a CheckpointError naming it (falling
// back past it would silently lose its steps): load an earlier checkpoint by its path, or move
// the damaged folder aside.
std::optional<std::string> latest_checkpoint(const std::string& root);

// What a committed checkpoint holds, without loading it.
struct TensorMeta {
  std::string dtype;  // safetensors dtype name
  std::vector<int64_t> global_shape;
};
std::map<std::string, TensorMeta> describe(const std::string& dir);

}  // namespace fsdp::checkpoint
