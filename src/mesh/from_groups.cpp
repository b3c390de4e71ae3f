// DeviceMesh::from_group / from_groups: a mesh over process groups the caller made (PyTorch's
// DeviceMesh.from_group). Nothing here creates a group or talks to the other ranks: it checks
// that the given groups are exactly the lines of the mesh through this rank and keeps them.
#include <set>
#include <stdexcept>

#include "fsdp/comm/backend.h"
#include "fsdp/dist/runtime.h"
#include "fsdp/mesh/device_mesh.h"

namespace fsdp {

namespace {

[[noreturn]] void refuse(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string("fsdp::DeviceMesh::") + fn + ": " + what);
}

std::string ranks_text(const std::vector<int64_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

std::vector<int64_t> ranks_of(const comm::Comm& group) {
  return {group.global_ranks().begin(), group.global_ranks().end()};
}

std::vector<int64_t> ranks_of(const at::Tensor& t) {
  at::Tensor flat = t.reshape(-1).contiguous();
  return {flat.data_ptr<int64_t>(), flat.data_ptr<int64_t>() + flat.numel()};
}

// The device type asked for, or the runtime's; one the build can serve.
std::string device_type_for(const char* fn, const std::string& requested,
                            const std::vector<std::shared_ptr<comm::Comm>>& groups) {
  const std::string device_type =
      !requested.empty() ? requested : (dist::is_initialized() ? dist::init_options().device_type : std::string("cpu"));
  comm::backend_for_device(device_type);  // names unknown or unavailable device types
  for (size_t d = 0; d < groups.size(); ++d) {
    if (device_type == "cpu" && groups[d]->backend_kind() == comm::BackendKind::Nccl) {
      refuse(fn, "group " + std::to_string(d) + " ('" + groups[d]->name() +
                     "') is an NCCL group, which cannot carry CPU tensors; pass device_type \"cuda\" or a Gloo group");
    }
  }
  return device_type;
}

// This process's global rank as the groups see it (each group maps its own rank to a global one).
int rank_from_groups(const char* fn, const std::vector<std::shared_ptr<comm::Comm>>& groups) {
  int me = -1;
  for (size_t d = 0; d < groups.size(); ++d) {
    const auto& g = *groups[d];
    const int here = g.global_ranks().at(static_cast<size_t>(g.rank()));
    if (me >= 0 && here != me) {
      refuse(fn, "group " + std::to_string(d) + " ('" + g.name() + "') places this process at global rank " +
                     std::to_string(here) + " but group 0 at " + std::to_string(me) +
                     "; pass groups this process belongs to, from one runtime");
    }
    me = here;
  }
  if (dist::is_initialized() && me != dist::rank()) {
    refuse(fn, "the groups place this process at global rank " + std::to_string(me) + " but it is rank " +
                   std::to_string(dist::rank()) + "; pass groups of the current runtime (made after init_distributed)");
  }
  return me;
}

std::vector<std::string> names_for(const char* fn, std::vector<std::string> names, int64_t ndim) {
  if (names.empty()) {
    for (int64_t d = 0; d < ndim; ++d) names.push_back("dim" + std::to_string(d));
  }
  if (static_cast<int64_t>(names.size()) != ndim) {
    refuse(fn, std::to_string(names.size()) + " dimension names for a " + std::to_string(ndim) +
                   "-D mesh; give one name per dimension");
  }
  std::set<std::string> seen;
  for (const auto& n : names) {
    if (n.empty()) refuse(fn, "a dimension name is empty; name every dimension (or pass no names)");
    if (!seen.insert(n).second) refuse(fn, "dimension name \"" + n + "\" is used twice; names must be unique");
  }
  return names;
}

}  // namespace

DeviceMesh DeviceMesh::from_group(std::shared_ptr<comm::Comm> group, const std::string& device_type,
                                  const std::string& dim_name) {
  if (!group)
    refuse("from_group", "the group is null; pass a Comm such as fsdp::dist::world_comm() or one from dist::new_group");
  at::Tensor mesh = at::tensor(ranks_of(*group), at::kLong);
  return from_groups({std::move(group)}, mesh,
                     dim_name.empty() ? std::vector<std::string>{} : std::vector<std::string>{dim_name}, device_type);
}

DeviceMesh DeviceMesh::from_groups(std::vector<std::shared_ptr<comm::Comm>> groups, at::Tensor mesh,
                                   std::vector<std::string> dim_names, const std::string& requested_device_type) {
  const char* fn = "from_groups";
  if (!mesh.defined() || mesh.dim() == 0 || mesh.numel() == 0) {
    refuse(fn, "the mesh is empty or 0-D; pass the global ranks shaped like the mesh, e.g. at::arange(4).view({2, 2})");
  }
  if (at::isFloatingType(mesh.scalar_type()) || at::isComplexType(mesh.scalar_type()) ||
      mesh.scalar_type() == at::kBool) {
    refuse(fn, std::string("the mesh holds ") + c10::toString(mesh.scalar_type()) +
                   " values; pass integer global ranks (e.g. at::arange(4, at::kLong).view({2, 2}))");
  }
  mesh = mesh.to(at::kCPU, at::kLong).contiguous().clone();
  if (groups.size() != static_cast<size_t>(mesh.dim())) {
    refuse(fn, std::to_string(groups.size()) + " groups for a " + std::to_string(mesh.dim()) +
                   "-D mesh; pass one group per dimension (this rank's group along it), in the mesh's order");
  }
  for (size_t d = 0; d < groups.size(); ++d) {
    if (!groups[d]) refuse(fn, "group " + std::to_string(d) + " is null; pass this rank's group along every dimension");
  }
  dim_names = names_for(fn, std::move(dim_names), mesh.dim());
  const std::string device_type = device_type_for(fn, requested_device_type, groups);
  const int me = rank_from_groups(fn, groups);

  // Every rank once, each a rank of the world (a process without a runtime is a world of one).
  const int64_t world = dist::is_initialized() ? dist::world_size() : 1;
  std::set<int64_t> seen;
  for (int64_t r : ranks_of(mesh)) {
    if (r < 0 || r >= world) {
      refuse(fn, "the mesh lists rank " + std::to_string(r) + ", outside the world of " + std::to_string(world) +
                     " ranks; list global ranks 0.." + std::to_string(world - 1));
    }
    if (!seen.insert(r).second) {
      refuse(fn, "the mesh lists rank " + std::to_string(r) + " twice; every rank may stand in the mesh once");
    }
  }
  at::Tensor where = (mesh == me).nonzero();
  if (where.size(0) != 1) {
    refuse(fn, "this process (global rank " + std::to_string(me) + ") is not in the mesh " +
                   ranks_text(ranks_of(mesh)) + "; only the mesh's ranks build it, with their own groups");
  }
  // Each group is the line through this rank along its dimension, in the mesh's order.
  for (int64_t d = 0; d < mesh.dim(); ++d) {
    at::Tensor line = mesh;
    for (int64_t other = mesh.dim() - 1; other >= 0; --other) {
      if (other != d) line = line.select(other, where[0][other].item<int64_t>());
    }
    const auto want = ranks_of(line), got = ranks_of(*groups[static_cast<size_t>(d)]);
    if (want != got) {
      refuse(fn, "group " + std::to_string(d) + " ('" + groups[static_cast<size_t>(d)]->name() + "') holds ranks " +
                     ranks_text(got) + " but the mesh's line along \"" + dim_names[static_cast<size_t>(d)] +
                     "\" through rank " + std::to_string(me) + " is " + ranks_text(want) +
                     "; pass, for each dimension in order, the group of the ranks that differ from this one only "
                     "along it (ranks in the mesh's order)");
    }
  }
  return DeviceMesh(device_type, mesh, std::move(dim_names), std::move(groups), me);
}

}  // namespace fsdp
