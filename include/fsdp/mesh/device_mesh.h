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
