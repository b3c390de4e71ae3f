#include "fsdp/mesh/device_mesh.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <stdexcept>

#include "fsdp/comm/backend.h"
#include "fsdp/dist/runtime.h"

namespace fsdp {

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "{";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "}";
}

// Distinguishes the groups of successive init_device_mesh calls in the store; identical on every
// rank because every rank makes the same calls in the same order.
std::atomic<int> g_mesh_counter{0};

}  // namespace

DeviceMesh::DeviceMesh(std::string device_type, at::Tensor mesh, std::vector<std::string> dim_names,
                       std::vector<std::shared_ptr<comm::Comm>> dim_comms, int global_rank)
    : device_type_(std::move(device_type)),
      mesh_(std::move(mesh)),
      dim_names_(std::move(dim_names)),
      dim_comms_(std::move(dim_comms)),
      global_rank_(global_rank) {
  if (static_cast<int64_t>(dim_names_.size()) != mesh_.dim() || dim_comms_.size() != dim_names_.size()) {
    throw std::invalid_argument("fsdp::DeviceMesh: one name and one group per dimension");
  }
  at::Tensor where = (mesh_ == global_rank_).nonzero();
  if (where.size(0) != 1) {
    throw std::invalid_argument("fsdp::DeviceMesh: rank " + std::to_string(global_rank_) + " is not in the mesh");
  }
  for (int64_t d = 0; d < mesh_.dim(); ++d) coordinate_.push_back(where[0][d].item<int64_t>());
}

int DeviceMesh::dim_index(const std::string& dim) const {
  for (size_t i = 0; i < dim_names_.size(); ++i) {
    if (dim_names_[i] == dim) return static_cast<int>(i);
  }
  std::string known;
  for (const auto& n : dim_names_) known += (known.empty() ? "" : ", ") + ("\"" + n + "\"");
  throw std::invalid_argument("fsdp::DeviceMesh: no dimension named \"" + dim + "\"; this mesh has " + known);
}

int64_t DeviceMesh::size(int dim) const {
  if (dim < 0 || dim >= ndim()) throw std::out_of_range("fsdp::DeviceMesh: dimension index out of range");
  return mesh_.size(dim);
}

int DeviceMesh::get_local_rank(int dim) const {
  if (dim < 0 || dim >= ndim()) throw std::out_of_range("fsdp::DeviceMesh: dimension index out of range");
  return static_cast<int>(coordinate_[static_cast<size_t>(dim)]);
}

std::shared_ptr<comm::Comm> DeviceMesh::comm(int dim) const {
  if (dim < 0 || dim >= ndim()) throw std::out_of_range("fsdp::DeviceMesh: dimension index out of range");
  return dim_comms_[static_cast<size_t>(dim)];
}

DeviceMesh DeviceMesh::operator[](const std::string& dim) const {
  const int d = dim_index(dim);
  // Fix every other coordinate to this rank's: what is left is the line along `d`.
  at::Tensor line = mesh_;
  for (int other = ndim() - 1; other >= 0; --other) {
    if (other != d) line = line.select(other, coordinate_[static_cast<size_t>(other)]);
  }
  return DeviceMesh(device_type_, line.contiguous(), {dim}, {dim_comms_[static_cast<size_t>(d)]}, global_rank_);
}

DeviceMesh DeviceMesh::slice(const std::vector<std::string>& dims) const {
  if (dims.empty()) throw std::invalid_argument("fsdp::DeviceMesh: slicing needs at least one dimension name");
  std::vector<int> keep;
  for (const auto& name : dims) {
    const int d = dim_index(name);
    if (!keep.empty() && d <= keep.back()) {
      std::string order;
      for (const auto& n : dim_names_) order += (order.empty() ? "" : ", ") + ("\"" + n + "\"");
      throw std::invalid_argument(
          "fsdp::DeviceMesh: the dimensions to slice must be distinct and in the mesh's order (" + order + "); got \"" +
          name + "\" out of place");
    }
    keep.push_back(d);
  }
  at::Tensor sub = mesh_;
  for (int other = ndim() - 1; other >= 0; --other) {
    if (std::find(keep.begin(), keep.end(), other) == keep.end())
      sub = sub.select(other, coordinate_[static_cast<size_t>(other)]);
  }
  std::vector<std::shared_ptr<comm::Comm>> comms;
  for (int d : keep) comms.push_back(dim_comms_[static_cast<size_t>(d)]);
  return DeviceMesh(device_type_, sub.contiguous(), dims, comms, global_rank_);
}

DeviceMesh DeviceMesh::flatten(const std::string& requested_name) const {
  std::string name = requested_name;
  if (name.empty()) {
    for (const auto& n : dim_names_) name += (name.empty() ? "" : "_") + n;
  }
  if (ndim() == 1) return DeviceMesh(device_type_, mesh_, {name}, dim_comms_, global_rank_);
  std::vector<int> ranks;
  auto flat = mesh_.reshape(-1);
  for (int64_t i = 0; i < flat.numel(); ++i) ranks.push_back(static_cast<int>(flat[i].item<int64_t>()));
  std::ostringstream tag;
  tag << "flat/" << name << "/";
  for (size_t i = 0; i < ranks.size(); ++i) tag << (i ? "-" : "") << ranks[i];
  // One group per set of ranks and name for the runtime's life (a new world has new groups).
  static std::mutex mu;
  static std::map<std::string, std::pair<std::shared_ptr<comm::Comm>, std::shared_ptr<comm::Comm>>> groups;
  std::shared_ptr<comm::Comm> group;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = groups.find(tag.str());
    if (it != groups.end() && it->second.first == dist::world_comm()) {
      group = it->second.second;
    } else {
      group = dist::new_group(ranks, tag.str());
      groups[tag.str()] = {dist::world_comm(), group};
    }
  }
  return DeviceMesh(device_type_, flat.contiguous(), {name}, {group}, global_rank_);
}

std::string DeviceMesh::to_string() const {
  std::ostringstream os;
  os << "DeviceMesh(" << device_type_ << ", shape {";
  for (int d = 0; d < ndim(); ++d) os << (d ? ", " : "") << dim_names_[static_cast<size_t>(d)] << "=" << size(d);
  os << "}, ranks [";
  auto flat = mesh_.reshape(-1);
  for (int64_t i = 0; i < flat.numel(); ++i) os << (i ? "," : "") << flat[i].item<int64_t>();
  os << "])";
  return os.str();
}

DeviceMesh init_device_mesh(std::vector<int64_t> shape, std::vector<std::string> dim_names,
                            const std::string& requested_device_type) {
  if (!dist::is_initialized()) dist::init_distributed();
  const std::string device_type =
      requested_device_type.empty() ? dist::init_options().device_type : requested_device_type;
  if (shape.empty())
    throw std::invalid_argument("fsdp::init_device_mesh: the mesh shape is empty; use e.g. {world_size}");
  int64_t product = 1;
  for (int64_t s : shape) {
    if (s < 1)
      throw std::invalid_argument("fsdp::init_device_mesh: every dimension needs at least one rank, got " +
                                  shape_string(shape));
    product *= s;
  }
  const int world_size = dist::world_size();
  if (product != world_size) {
    throw std::invalid_argument("fsdp::init_device_mesh: mesh shape " + shape_string(shape) + " holds " +
                                std::to_string(product) + " ranks but the world has " + std::to_string(world_size) +
                                " (WORLD_SIZE); choose a shape whose product is the world size, e.g. {" +
                                std::to_string(world_size) + "}");
  }
  if (dim_names.empty()) {
    for (size_t i = 0; i < shape.size(); ++i) dim_names.push_back("dim" + std::to_string(i));
  }
  if (dim_names.size() != shape.size()) {
    throw std::invalid_argument("fsdp::init_device_mesh: " + std::to_string(dim_names.size()) + " names for a " +
                                std::to_string(shape.size()) + "-D mesh; give one name per dimension");
  }
  std::set<std::string> seen;
  for (const auto& n : dim_names) {
    if (n.empty()) throw std::invalid_argument("fsdp::init_device_mesh: a dimension name is empty");
    if (!seen.insert(n).second) {
      throw std::invalid_argument("fsdp::init_device_mesh: dimension name \"" + n +
                                  "\" is used twice; names must be unique");
    }
  }
  comm::backend_for_device(device_type);  // names unknown or unavailable device types
  if (device_type != dist::init_options().device_type) {
    throw std::invalid_argument("fsdp::init_device_mesh: device type '" + device_type +
                                "' differs from init_distributed's '" + dist::init_options().device_type +
                                "'; initialise the runtime with InitOptions{.device_type = \"" + device_type + "\"}");
  }
  at::Tensor mesh = at::arange(product, at::kLong).view(shape);
  const int me = dist::rank();
  const int mesh_id = g_mesh_counter.fetch_add(1);
  at::Tensor where = (mesh == me).nonzero();
  std::vector<std::shared_ptr<comm::Comm>> comms;
  for (size_t d = 0; d < shape.size(); ++d) {
    at::Tensor line = mesh;
    for (int other = static_cast<int>(shape.size()) - 1; other >= 0; --other) {
      if (other != static_cast<int>(d)) line = line.select(other, where[0][other].item<int64_t>());
    }
    std::vector<int> ranks;
    for (int64_t i = 0; i < line.numel(); ++i) ranks.push_back(static_cast<int>(line[i].item<int64_t>()));
    std::ostringstream tag;
    tag << "mesh" << mesh_id << "/" << dim_names[d] << "/";
    for (size_t i = 0; i < ranks.size(); ++i) tag << (i ? "-" : "") << ranks[i];
    auto group = dist::new_group(ranks, tag.str());
    comms.push_back(group);
  }
  return DeviceMesh(device_type, mesh, dim_names, comms, me);
}

}  // namespace fsdp
