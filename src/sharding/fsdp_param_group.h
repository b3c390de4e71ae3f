#pragma once
// FSDPParamGroup: the parameters of one fully_shard call, moved together (FSDP2's FSDPParamGroup).
// One flat all-gather before forward/backward, one flat reduce-scatter after backward.
//
// State machine of the parameters:
//
//   Sharded --unshard(async)--> Unsharding --wait_for_unshard()--> Unsharded --reshard()--> Sharded
//
// unshard() only issues the all-gather (copy-in of every padded shard into one flat buffer), so a
// prefetch can overlap it with compute; wait_for_unshard() waits, re-allocates the unsharded
// parameters and copies the rows out. reshard() frees them (waiting first if a gather is in flight).
#include <ATen/ATen.h>

#include <memory>
#include <optional>
#include <vector>

#include "fsdp/comm/comm.h"
#include "fsdp/mesh/device_mesh.h"
#include "fsdp_param.h"

namespace fsdp::detail {

class FSDPParamGroup {
 public:
  enum class State { Sharded, Unsharding, Unsharded };

  FSDPParamGroup(std::vector<std::unique_ptr<FSDPParam>> params, DeviceMesh mesh);

  State state() const { return state_; }
  const std::vector<std::unique_ptr<FSDPParam>>& params() const { return params_; }
  const DeviceMesh& mesh() const { return mesh_; }
  comm::Comm& comm() const { return *comm_; }

  void unshard(bool async_op);
  void wait_for_unshard();
  void reshard();

  // After this group's backward: with gradient sync on, issues the reduce-scatter of the unsharded
  // gradients (asynchronously) and releases them; with it off, leaves them to accumulate.
  // Reshards afterwards when reshard_after_backward.
  void post_backward();
  bool has_pending_reduce() const { return reduce_output_.defined(); }
  // Waits for the reduce-scatter and writes (or adds to) the sharded gradients.
  void finish_reduce();

  bool reshard_after_forward = true;
  bool reshard_after_backward = true;
  bool requires_gradient_sync = true;
  std::optional<double> gradient_divide_factor;

 private:
  std::vector<std::unique_ptr<FSDPParam>> params_;
  DeviceMesh mesh_;
  std::shared_ptr<comm::Comm> comm_;
  std::vector<int64_t> offsets_;  // each parameter's column in the flat [N, total] layout
  int64_t total_shard_numel_ = 0;
  State state_ = State::Sharded;

  at::Tensor all_gather_output_;
  comm::Work all_gather_work_;

  at::Tensor reduce_output_;
  comm::Work reduce_work_;
  std::vector<std::pair<FSDPParam*, int64_t>> reduced_params_;  // (param, offset in reduce_output_)
  std::optional<double> pending_divide_;
};

}  // namespace fsdp::detail
