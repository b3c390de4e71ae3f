#pragma once
// Tensor parallelism (fsdp::tp): placements, the collectives as autograd functions, parallel
// styles with parallelize_module, and loss_parallel. Depends on comm and mesh only; fully_shard
// composes with it (FSDP over the dp dimension of a {"dp", "tp"} mesh).
#include "fsdp/tensor_parallel/comm_functions.h"
#include "fsdp/tensor_parallel/hooks.h"
#include "fsdp/tensor_parallel/loss.h"
#include "fsdp/tensor_parallel/parallelize.h"
#include "fsdp/tensor_parallel/placement.h"
