#include "collectives.h"

#include <torch/torch.h>

#include <algorithm>

#include "../memory/buffer_pool.h"

namespace fsdp::detail {

namespace {
// out[i] at column `offset` gets shard rank (first_rank + i)'s padded rows of `full` (flat).
void split_rows(const at::Tensor& full, const at::Tensor& out, int64_t offset, int first_rank, int64_t rows,
                int64_t row_numel, int64_t padded_rows) {
  for (int64_t i = 0; i < out.size(0); ++i) {
    const int64_t first = (first_rank + i) * padded_rows;
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(padded_rows, rows - first));
    if (n > 0) out[i].narrow(0, offset, n * row_numel).copy_(full.narrow(0, first * row_numel, n * row_numel));
    if (n < padded_rows) out[i].narrow(0, offset + n * row_numel, (padded_rows - n) * row_numel).zero_();
  }
}

// gathered: [N, total]; parameter p's chunk of every rank starts at column `offset`.
void copy_out_param(FSDPParam& p, const at::Tensor& gathered, int64_t offset) {
  const int64_t rows = p.rows(), row_numel = p.row_numel(), padded_rows = p.padded_rows();
  at::Tensor dst = p.unsharded_alias().view({rows, row_numel});
  for (int64_t r = 0; r < gathered.size(0); ++r) {
    const int64_t first = r * padded_rows;
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(padded_rows, rows - first));
    if (n == 0) continue;
    dst.narrow(0, first, n).copy_(gathered[r].narrow(0, offset, n * row_numel).view({n, row_numel}));
  }
}
}  // namespace

void copy_in_all_gather_input(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& input) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    input.narrow(0, offsets[i], params[i]->shard_numel()).copy_(params[i]->padded_shard(), /*non_blocking=*/true);
  }
}

void copy_out_all_gather_output(const FSDPParams& params, const std::vector<int64_t>& offsets,
                                const at::Tensor& output, int64_t total) {
  torch::NoGradGuard no_grad;
  const at::Tensor gathered = output.view({-1, total});
  for (size_t i = 0; i < params.size(); ++i) {
    params[i]->alloc_unsharded();
    copy_out_param(*params[i], gathered, offsets[i]);
  }
}

void copy_in_post_forward(const FSDPParams& params, const std::vector<int64_t>& offsets, const at::Tensor& out,
                          int first_rank) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    const FSDPParam& p = *params[i];
    split_rows(p.unsharded_alias().view(-1), out, offsets[i], first_rank, p.rows(), p.row_numel(), p.padded_rows());
  }
}

at::Tensor build_reduce_scatter_input(std::vector<std::pair<FSDPParam*, at::Tensor>>& grads, int n,
                                      at::ScalarType dtype, std::vector<std::pair<FSDPParam*, int64_t>>& placed) {
  int64_t total = 0, grad_bytes = 0;
  for (const auto& [p, g] : grads) {
    total += p->shard_numel();
    grad_bytes += static_cast<int64_t>(g.nbytes());
  }
  // The unsharded gradients are FSDP's to free from here on: counted until they are.
  count_buffer(BufferOwner::UnshardedGrads, grad_bytes);
  at::Tensor input =
      empty_buffer({n, total}, grads.front().second.options().dtype(dtype).requires_grad(false), BufferOwner::ReduceScatterInput);
  placed.clear();
  int64_t offset = 0;
  torch::NoGradGuard no_grad;
  for (auto& [p, g] : grads) {
    split_rows(g.contiguous().view(-1), input, offset, 0, p->rows(), p->row_numel(), p->padded_rows());
    placed.emplace_back(p, offset);
    offset += p->shard_numel();
    count_buffer(BufferOwner::UnshardedGrads, -static_cast<int64_t>(g.nbytes()));
    g = at::Tensor();  // freed now (the last reference), before the next one is copied
  }
  grads.clear();
  return input;
}

}  // namespace fsdp::detail
