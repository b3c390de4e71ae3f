#pragma once
// The tensors of a checkpoint as one rank sees them: which rows of which global tensor it holds,
// and whether it is the rank that writes them. Save and load walk the same list, so the key
// scheme lives in one place (see include/fsdp/checkpoint/checkpoint.h for the keys).
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/comm/comm.h"

namespace fsdp::checkpoint::detail {

struct LocalItem {
  std::string key;
  at::Tensor local;                    // this rank's rows (possibly none), or the whole tensor
  std::vector<int64_t> global_shape;
  int64_t row_offset = 0;              // global row of local's first row
  bool writer = false;                 // this rank writes `local` into its file
  // Sharded items only: the group holding the other rows (each rank `padded_rows`, the last ones
  // padded), for gathering full tensors.
  std::shared_ptr<comm::Comm> shard_comm;
  int64_t padded_rows = 0;
  std::function<void()> on_loaded;     // runs after `local` was filled by load (may be empty)
};

// This process's global rank; 0 without a process group (a world of one).
int global_rank();

// Rows of `item.local` (a 0-d tensor is one row).
int64_t local_rows(const LocalItem& item);

// For error messages: "[2, 3]", and the first few of a list of keys.
std::string shape_text(at::IntArrayRef shape);
std::string key_list(const std::vector<std::string>& keys);

// Dim 0 is the sharded dimension; a 0-d tensor is a single row of one element.
int64_t global_rows(const std::vector<int64_t>& shape);
int64_t row_numel(const std::vector<int64_t>& shape);

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

}  // namespace fsdp::checkpoint::detail
