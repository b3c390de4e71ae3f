#pragma once
// Recording a parameter's tensor-parallel placement (parallelize_module does; tp_placement() in
// fsdp/tensor_parallel/placement.h reads it).
#include "fsdp/tensor_parallel/placement.h"

namespace fsdp::tp::detail {

// Records (or replaces) the placement of `param` (kept while the tensor lives).
void set_tp_placement(const at::Tensor& param, TPPlacement placement);

}  // namespace fsdp::tp::detail
