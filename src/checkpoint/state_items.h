#pragma once
// The tensors of a checkpoint as one rank sees them: which box of which global tensor it holds,
// and whether it is the rank that writes them. Save and load walk the same list, so the key
// scheme lives in one place (see include/fsdp/checkpoint/checkpoint.h for the keys).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/comm/comm.h"

namespace fsdp::checkpoint::detail {

// One all-gather that rebuilds a tensor along `dim` over `comm`: rank r of `comm` holds
// [r * per_rank, min((r + 1) * per_rank, full)) along `dim` (the even chunking of FSDP and TP:
// the last ranks may hold fewer, or none).
struct GatherStep {
  int64_t dim = 0;
  std::shared_ptr<comm::Comm> comm;
  int64_t per_rank = 0;
  int64_t full = 0;
  // A strided TP split (TPPlacement::blocks): each rank's part is `blocks` pieces, one per block;
  // the gathered rank-major pieces are put back block-major (tp::interleave_blocks).
  int64_t blocks = 1;
};

// One box of a tensor's local part: a view of it and the box's first index in every dimension.
struct Piece {
  at::Tensor local;
  std::vector<int64_t> offsets;
};

struct LocalItem {
  std::string key;
  at::Tensor local;  // this rank's box (possibly empty), or the whole tensor
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;  // local's box: its first index in every dimension (sizes:
                                 // local.sizes()); empty for a 0-d tensor
  bool writer = false;           // this rank writes `local` into its file
  // The writer rule with `first` the lowest global rank holding this key: `writer` is its answer
  // for 0 (every rank holds the key). A key held by some ranks only (an expert under expert
  // parallelism) is settled at save with the lowest holder in rank 0's place. Null: `writer` stands.
  std::function<bool(int first)> writer_if_first;
  // How to gather the whole tensor (state dicts, export), applied in order: sharded parameters
  // and their optimizer state (param_box). Empty and no box_group: `local` is whole.
  std::vector<GatherStep> gather;
  // ShardedTensor entries: any box layout, gathered by exchanging every rank's box over this group.
  std::shared_ptr<comm::Comm> box_group;
  std::function<void()> on_loaded;  // runs after `local` was filled by load (may be empty)
  // A strided tensor-parallel shard (a fused q|k|v split by heads) is several boxes of the global
  // tensor: one Piece each, views of `local` in order, empty ones left out. Empty: `local` at
  // `offsets` is the one box. Save writes a chunk per piece, load fills each; gathers use `local`.
  std::vector<Piece> pieces;
};

// The boxes of `item`: its pieces, or the one box {local, offsets}.
std::vector<Piece> boxes(const LocalItem& item);

// ---- the parallelism glue point --------------------------------------------------------------
// Where a sharded model parameter (or a tensor shaped like it: its optimizer state) sits in its
// global tensor, whether this rank writes it, and how to gather it whole. This is the only place
// the checkpoint code learns how a parameter is split; save, load (any layout to any layout),
// full state dicts and export all work from the box it returns.
//   Today: fully_shard (fsdp::shard_info) splits dim 0 over the shard group; under HSDP only
//   replica 0 writes. nullopt: the parameter is whole (written by global rank 0).
//   Tensor parallel (ShardInfo.tp, or tp::tp_placement for a TP-only parameter:
//   TPPlacement{mesh, dim, global_shape, offset, size}): global_shape = tp.global_shape,
//   offsets[tp.dim] += tp.offset, and a GatherStep{tp.dim, tp mesh's comm, size, full} appended
//   after FSDP's dim-0 step (FSDP shards the TP-local tensor, so its step comes first, with
//   full = the TP-local size along dim 0; tp.dim may be 0 too: offsets add up). TP splits are
//   even (parallelize_module refuses others), which is the chunking GatherStep assumes.
//   A strided TP placement (blocks > 1, along dim 0): the local rows are `blocks` runs, each at
//   its own place in the full tensor; an FSDP dim-0 shard on top may cut them: one Part per
//   non-empty run it holds, and the TP GatherStep carries `blocks` (reordered after the gather).
struct ParamBox {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  bool writer = false;
  std::function<bool(int first)> writer_if_first;  // LocalItem's: `writer` with first = 0
  std::vector<GatherStep> gather;
  struct Part {
    int64_t local_begin = 0;  // rows [local_begin, local_begin + rows) of the local tensor (dim 0)
    int64_t rows = 0;
    std::vector<int64_t> offsets;  // their box in the global tensor
  };
  std::vector<Part> parts;  // strided only; empty: the one box at `offsets`
};
std::optional<ParamBox> param_box(const at::Tensor& param);

// Collective over step.comm: `local` (this rank's part along step.dim) rebuilt along step.dim.
at::Tensor gather_along(const at::Tensor& local, const GatherStep& step);
// The whole tensor of `item` on every rank of its groups: its GatherSteps in order, or (box_group)
// every rank's box exchanged (any layout). `local` itself when the item is whole.
at::Tensor gather_full(const LocalItem& item);

// This process's global rank; 0 without a process group (a world of one).
int global_rank();

// For error messages: "[2, 3]", and the first few of a list of keys.
std::string shape_text(at::IntArrayRef shape);
std::string key_list(const std::vector<std::string>& keys);

// The sub-tensor of `full` (global shape) at the box of `item`.
at::Tensor box_of(const at::Tensor& full, const LocalItem& item);
at::Tensor box_of(const at::Tensor& full, const Piece& piece);

// Geometry of a tensor shaped like parameter `param` (the parameter itself or its optimizer
// state): sharded rows when fully_shard manages it, else the whole tensor from global rank 0.
LocalItem like_param(std::string key, const at::Tensor& param, const at::Tensor& local, int global_rank);
// A whole tensor written by global rank 0 (scalars, buffers, hyperparameters).
LocalItem whole(std::string key, const at::Tensor& t, int global_rank);

// Parameters and buffers: "model.<name>". Sharded parameters give their shard; everything else is
// whole and written by global rank 0.
std::vector<LocalItem> model_items(torch::nn::Module& model, int global_rank);

// Optimizer state (optimizer_state.cpp, through the codec registry of fsdp/checkpoint/optimizer_state.h).
// For save: "optim.<param name>.<field>" for each parameter that has state, and
// "optim.param_groups.<g>.<hyperparameter>".
std::vector<LocalItem> optimizer_save_items(torch::optim::Optimizer& optimizer, torch::nn::Module& model,
                                            int global_rank);
// Optimizer state for load: items for every such key the checkpoint has (`has_key`), creating the
// optimizer's per-parameter state when it has none yet (a fresh optimizer).
std::vector<LocalItem> optimizer_load_items(torch::optim::Optimizer& optimizer, torch::nn::Module& model,
                                            const std::function<bool(const std::string&)>& has_key);
// Every key optimizer_load_items may ask `has_key` about (to broadcast rank 0's answers).
std::vector<std::string> optimizer_candidate_keys(torch::optim::Optimizer& optimizer, torch::nn::Module& model);

// Stateful values: "extra.<name>.<key>", written by rank 0.
std::vector<LocalItem> extra_save_items(const std::map<std::string, Stateful*>& extras, int global_rank);

// State::tensors: each ShardedTensor's box under its key, validated (dims, bounds) with one clear
// line naming the key; `group` (may be null) is where full state dicts gather them.
std::vector<LocalItem> sharded_tensor_items(const std::map<std::string, ShardedTensor>& tensors,
                                            std::shared_ptr<comm::Comm> group);

}  // namespace fsdp::checkpoint::detail
