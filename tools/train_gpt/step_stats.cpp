#include "step_stats.h"

#include <algorithm>

#include "metrics.h"

namespace train_gpt {

StepTimer::StepTimer()
    : start_(std::chrono::steady_clock::now()), comm_start_(fsdp::comm::process_comm_stats().snapshot()) {}

StepCost StepTimer::finish() const {
  StepCost cost;
  cost.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const fsdp::comm::CommStatsSnapshot sent = fsdp::comm::process_comm_stats().snapshot() - comm_start_;
  cost.comm_bytes = sent.total_bytes();
  cost.all_to_all_bytes = sent[fsdp::comm::OpKind::AllToAll].bytes_sent;
  return cost;
}

int64_t tensor_bytes(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors)
    if (t.defined()) n += t.numel() * static_cast<int64_t>(t.element_size());
  return n;
}

int64_t grad_bytes(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  grads.reserve(params.size());
  for (const auto& p : params) grads.push_back(p.grad());
  return tensor_bytes(grads);
}

int64_t RankMemory::max_peak_bytes() const {
  return peak_bytes.empty() ? 0 : *std::max_element(peak_bytes.begin(), peak_bytes.end());
}

RankMemory gather_memory(fsdp::comm::Comm* comm, const torch::Device& device) {
  at::Tensor local =
      at::tensor({static_cast<double>(current_rss_bytes()), static_cast<double>(peak_rss_bytes())}, at::kDouble);
  at::Tensor all = local;
  if (comm != nullptr) {
    at::Tensor out = at::empty({comm->size() * 2}, local.options().device(device));
    comm->all_gather_into_tensor(out, local.to(device));  // NCCL takes CUDA tensors
    all = out.cpu();
  }
  all = all.view({-1, 2});
  RankMemory memory;
  for (int64_t r = 0; r < all.size(0); ++r) {
    memory.current_bytes.push_back(static_cast<int64_t>(all[r][0].item<double>()));
    memory.peak_bytes.push_back(static_cast<int64_t>(all[r][1].item<double>()));
  }
  return memory;
}

}  // namespace train_gpt
