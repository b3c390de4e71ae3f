#pragma once
// loss_parallel: cross-entropy over logits sharded on the vocabulary (the last dim) across the tp
// ranks, without gathering them (PyTorch's `with loss_parallel(): F.cross_entropy(...)`).
//
//   auto logits = fsdp::call(model->head, x);     // ColwiseParallel{}: [B, T, V / tp] on each rank
//   auto loss = fsdp::tp::loss_parallel(logits, targets, tp_mesh);   // mean over the tokens
//
// Three reductions over the tp group in forward (the max, then the sum of exponentials together
// with the target logits), none in backward: each rank's gradient is softmax - one_hot restricted
// to its vocabulary slice. Equal to the cross-entropy of the gathered logits (within rounding).
#include <ATen/ATen.h>

#include "fsdp/mesh/device_mesh.h"

namespace fsdp::tp {

// local_logits [..., V / tp] (rank r holds vocabulary [r V/tp, (r+1) V/tp)), targets [...] of
// global ids (int64); tokens whose target is ignore_index do not count. Returns the mean loss.
at::Tensor loss_parallel(const at::Tensor& local_logits, const at::Tensor& targets, const DeviceMesh& tp_mesh,
                         int64_t ignore_index = -100);

}  // namespace fsdp::tp
