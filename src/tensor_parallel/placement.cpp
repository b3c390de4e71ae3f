#include "fsdp/tensor_parallel/placement.h"

#include <torch/torch.h>

#include <mutex>
#include <unordered_map>

#include "comm_handle.h"
#include "placement_registry.h"

namespace fsdp::tp {

std::string Layout::to_string() const {
  return kind == Kind::Replicate ? "Replicate()" : "Shard(" + std::to_string(dim) + ")";
}

namespace {
struct Entry {
  c10::weak_intrusive_ptr<c10::TensorImpl> tensor;  // a dead tensor's address may be reused: check it
  TPPlacement placement;
};
std::mutex g_placements_mu;
std::unordered_map<const c10::TensorImpl*, Entry>& placements() {
  static std::unordered_map<const c10::TensorImpl*, Entry> map;
  return map;
}
}  // namespace

namespace detail {
void set_tp_placement(const at::Tensor& param, TPPlacement placement) {
  std::lock_guard<std::mutex> lock(g_placements_mu);
  auto& map = placements();
  for (auto it = map.begin(); it != map.end();) it = it->second.tensor.expired() ? map.erase(it) : std::next(it);
  map.insert_or_assign(param.unsafeGetTensorImpl(),
                       Entry{c10::weak_intrusive_ptr<c10::TensorImpl>(param.getIntrusivePtr()), std::move(placement)});
}
}  // namespace detail

std::optional<TPPlacement> tp_placement(const at::Tensor& param) {
  if (!param.defined()) return std::nullopt;
  std::lock_guard<std::mutex> lock(g_placements_mu);
  auto& map = placements();
  if (map.empty()) return std::nullopt;
  auto it = map.find(param.unsafeGetTensorImpl());
  if (it == map.end()) return std::nullopt;
  auto alive = it->second.tensor.lock();
  if (!alive || alive.get() != param.unsafeGetTensorImpl()) return std::nullopt;
  return it->second.placement;
}

at::Tensor gather_full(const at::Tensor& param) {
  auto placement = tp_placement(param);
  if (!placement) return param.detach();
  at::NoGradGuard no_grad;
  at::Tensor all = detail::all_gather_dim(param.detach(), placement->dim, *placement->mesh.comm(0));
  return interleave_blocks(all, placement->dim, placement->mesh.size(0), placement->blocks);
}

at::Tensor interleave_blocks(const at::Tensor& t, int64_t dim, int64_t ranks, int64_t blocks) {
  if (blocks <= 1 || ranks <= 1) return t;
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  at::Tensor front = t.movedim(d, 0);
  std::vector<int64_t> shape = front.sizes().vec();
  const int64_t len = shape[0];
  std::vector<int64_t> split{ranks, blocks, len / (ranks * blocks)};
  split.insert(split.end(), shape.begin() + 1, shape.end());
  at::Tensor out = front.reshape(split).transpose(0, 1).reshape(shape);
  return out.movedim(0, d).contiguous();
}

}  // namespace fsdp::tp
