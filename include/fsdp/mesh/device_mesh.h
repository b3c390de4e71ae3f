#pragma once
// DeviceMesh: the ranks arranged as an n-D array with named dimensions, one process group per
// dimension for the groups this rank belongs to.
//
// Example:
//   auto mesh = fsdp::init_device_mesh({2, 2}, {"replicate", "shard"});
//   auto shard = mesh["shard"].comm();   // the 2 ranks that share this rank's replicate coordinate
//
// Ranks are laid out row-major: rank = coordinate[0] * size(1) + coordinate[1] for a 2-D mesh.
// Every rank must call init_device_mesh in the same order with the same arguments.
#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "fsdp/comm/comm.h"

namespace fsdp {

class DeviceMesh {
 public:
  DeviceMesh(std::string device_type, at::Tensor mesh, std::vector<std::string> dim_names,
             std::vector<std::shared_ptr<comm::Comm>> dim_comms, int global_rank);

  // A mesh over process groups made elsewhere (PyTorch's DeviceMesh.from_group): no process
  // group is created, the mesh's comm(d) IS groups[d] (the same object). Only the members call it.
  //
  // Example:
  //   auto flat = fsdp::DeviceMesh::from_group(fsdp::dist::world_comm(), "cpu", "dp");  // 1-D
  //   // 4 ranks as 2 x 2: columns {0, 2}, {1, 3} data parallel, rows {0, 1}, {2, 3} tensor parallel
  //   const int r = fsdp::dist::rank();
  //   auto dp = fsdp::dist::new_group({r % 2, r % 2 + 2}, "my_dp_" + std::to_string(r % 2));
  //   auto tp = fsdp::dist::new_group({r / 2 * 2, r / 2 * 2 + 1}, "my_tp_" + std::to_string(r / 2));
  //   auto mesh = fsdp::DeviceMesh::from_groups({dp, tp}, at::arange(4).view({2, 2}), {"dp", "tp"});
  //   fsdp::fully_shard(model, {.mesh = mesh["dp"]});   // FSDP over the dp group given above
  //
  // from_group: 1-D, over `group`'s ranks in its rank order, named `dim_name` (default "dim0").
  // from_groups: n-D; `mesh` holds global ranks shaped like the mesh (integers, each rank once,
  // this rank among them) and groups[d] is this rank's group along dim d: the ranks of the mesh's
  // line through this rank along d, in that order (the group init_device_mesh would create).
  // Names default to "dim0", "dim1", ... device_type: "cpu" or "cuda"; empty takes
  // init_distributed's ("cpu" without a runtime). A group that does not fit the mesh, a rank
  // listed twice, a name count that differs: std::invalid_argument naming the problem and the fix.
  static DeviceMesh from_group(std::shared_ptr<comm::Comm> group, const std::string& device_type = "",
                               const std::string& dim_name = "");
  static DeviceMesh from_groups(std::vector<std::shared_ptr<comm::Comm>> groups, at::Tensor mesh,
                                std::vector<std::string> dim_names = {}, const std::string& device_type = "");

  const std::string& device_type() const { return device_type_; }
  // Global ranks, shaped like the mesh (int64, CPU).
  const at::Tensor& mesh() const { return mesh_; }
  int ndim() const { return static_cast<int>(dim_names_.size()); }
  const std::vector<std::string>& dim_names() const { return dim_names_; }
  int64_t size() const { return mesh_.numel(); }
  int64_t size(int dim) const;
  int64_t size(const std::string& dim) const { return size(dim_index(dim)); }
  // This rank's coordinate along a dimension (= its rank in that dimension's group).
  int get_local_rank(int dim = 0) const;
  int get_local_rank(const std::string& dim) const { return get_local_rank(dim_index(dim)); }
  std::vector<int64_t> get_coordinate() const { return coordinate_; }
  // The group of ranks that differ from this one only along `dim`.
  std::shared_ptr<comm::Comm> comm(int dim = 0) const;
  std::shared_ptr<comm::Comm> comm(const std::string& dim) const { return comm(dim_index(dim)); }
  // PyTorch's spelling of comm(): mesh.get_group("tp") is the process group of the "tp" dimension.
  std::shared_ptr<comm::Comm> get_group(int dim = 0) const { return comm(dim); }
  std::shared_ptr<comm::Comm> get_group(const std::string& dim) const { return comm(dim); }
  // The 1-D sub-mesh along `dim` that contains this rank (with its own process group).
  DeviceMesh operator[](const std::string& dim) const;
  // The sub-mesh of several dimensions that contains this rank, in this mesh's order, e.g.
  // mesh[{"replicate", "shard"}] of a {"replicate", "shard", "tp"} mesh (the groups are this
  // mesh's: no new process group). Throws for unknown, repeated or out-of-order names.
  DeviceMesh operator[](std::initializer_list<std::string> dims) const { return slice(std::vector<std::string>(dims)); }
  DeviceMesh slice(const std::vector<std::string>& dims) const;
  // All dimensions of this mesh flattened into one (FSDP2's DeviceMesh._flatten): a 1-D mesh over
  // its ranks, row-major, named `name` (default: the names joined by '_'), with a process group
  // of its own, created on first use and reused after. Collective over this mesh's ranks: every
  // one of them calls it in the same order.
  //   auto dp = mesh[{"replicate", "shard"}].flatten("dp");   // all data-parallel ranks
  DeviceMesh flatten(const std::string& name = "") const;
  int dim_index(const std::string& dim) const;  // throws naming the known dimensions
  std::string to_string() const;

 private:
  std::string device_type_;
  at::Tensor mesh_;
  std::vector<std::string> dim_names_;
  std::vector<std::shared_ptr<comm::Comm>> dim_comms_;
  std::vector<int64_t> coordinate_;
  int global_rank_;
};

// Builds a mesh over all ranks of the initialised runtime (init_distributed() first; a process
// without a launcher is a world of one). Names default to "dim0", "dim1", ...
// Throws when the shape's product is not the world size, or names repeat or do not match.
// device_type: "cpu" or "cuda"; empty (the default) takes init_distributed's (InitOptions).
DeviceMesh init_device_mesh(std::vector<int64_t> shape, std::vector<std::string> dim_names = {},
                            const std::string& device_type = "");

}  // namespace fsdp
