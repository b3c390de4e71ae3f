#pragma once
// What a training step measures for the progress line and the metrics file: its wall time and
// the bytes this rank sent (StepTimer), the bytes of local tensors and optimizer state, and every
// rank's memory (gather_memory, a collective).
//
// Example: StepTimer timer;  train_step(...);  const StepCost cost = timer.finish();
#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "fsdp/comm/comm.h"
#include "fsdp/debug/comm_stats.h"

namespace train_gpt {

struct StepCost {
  double seconds = 0;
  uint64_t comm_bytes = 0;        // bytes this rank sent (ring convention of comm_stats.h)
  uint64_t all_to_all_bytes = 0;  // of which in all-to-alls (expert parallelism's dispatch and combine)
};

// Started on construction; finish() reads the elapsed time and the bytes sent since.
class StepTimer {
 public:
  StepTimer();
  StepCost finish() const;

 private:
  std::chrono::steady_clock::time_point start_;
  fsdp::comm::CommStatsSnapshot comm_start_;
};

// Bytes of the defined tensors (undefined ones, e.g. absent gradients, count 0).
int64_t tensor_bytes(const std::vector<at::Tensor>& tensors);
// Bytes of the parameters' gradients.
int64_t grad_bytes(const std::vector<at::Tensor>& params);
// (An optimizer's state bytes: optimizer_state_bytes in optimizer.h.)

// Current and peak resident set of every rank (all-gathered through `device`; `comm` null: this
// process only). Collective: every rank calls it at the same point.
struct RankMemory {
  std::vector<int64_t> current_bytes;  // per rank
  std::vector<int64_t> peak_bytes;     // per rank
  int64_t max_peak_bytes() const;
};
RankMemory gather_memory(fsdp::comm::Comm* comm, const torch::Device& device);

}  // namespace train_gpt
