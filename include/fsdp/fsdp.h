#pragma once
// FSDP for LibTorch: everything a training program needs, in one include.
#include "fsdp/comm/backend.h"
#include "fsdp/comm/comm.h"
#include "fsdp/comm/comm_stats.h"
#include "fsdp/comm/work.h"
#include "fsdp/dist/cpu_tuning.h"
#include "fsdp/dist/env.h"
#include "fsdp/dist/runtime.h"
#include "fsdp/mesh/device_mesh.h"
#include "fsdp/sharding/call.h"
#include "fsdp/sharding/clip_grad.h"
#include "fsdp/sharding/fully_shard.h"
#include "fsdp/sharding/policies.h"
