#pragma once
// FSDP for LibTorch: the user's API, in one include (ARCHITECTURE.md draws the layers).
//
//   distributed runtime   fsdp/dist/runtime.h, fsdp/dist/env.h      init_distributed, rank, world
//   meshes and groups     fsdp/mesh/device_mesh.h, fsdp/comm/comm.h  DeviceMesh, Comm collectives
//   sharding              fsdp/sharding/fully_shard.h, policies.h, call.h, forward_method.h,
//                         replicate.h, materialize.h, clip_grad.h, custom_collectives.h
//   FSDP1's API           fsdp/fsdp1/fsdp1.h                          FullyShardedDataParallel
//   tensor parallel       fsdp/tensor_parallel/tensor_parallel.h
//   activation ckpt       fsdp/activation/activation_checkpointing.h
//   checkpoints           fsdp/checkpoint/{checkpoint,state_dict,optimizer_state,safetensors,
//                         inspect,lock}.h
//   fused CPU optimizers  fsdp/optim/fused.h                          FusedAdamW, FusedAdam, FusedSGD
//
// Diagnostics and tuning (phase timers, communication counters, flight recorder, desync checks,
// buffer pool, malloc and CPU tuning) are a separate include: fsdp/debug.h. Version differences of
// LibTorch live in fsdp/compat/, template plumbing in fsdp/detail/; neither is included directly.
#include "fsdp/activation/activation_checkpointing.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "fsdp/checkpoint/inspect.h"
#include "fsdp/checkpoint/lock.h"
#include "fsdp/checkpoint/optimizer_state.h"
#include "fsdp/checkpoint/safetensors.h"
#include "fsdp/checkpoint/state_dict.h"
#include "fsdp/comm/comm.h"
#include "fsdp/dist/env.h"
#include "fsdp/dist/runtime.h"
#include "fsdp/expert_parallel/expert_parallel.h"
#include "fsdp/fsdp1/fsdp1.h"
#include "fsdp/mesh/device_mesh.h"
#include "fsdp/optim/fused.h"
#include "fsdp/sharding/call.h"
#include "fsdp/sharding/clip_grad.h"
#include "fsdp/sharding/custom_collectives.h"
#include "fsdp/sharding/forward_method.h"
#include "fsdp/sharding/fully_shard.h"
#include "fsdp/sharding/materialize.h"
#include "fsdp/sharding/policies.h"
#include "fsdp/sharding/replicate.h"
#include "fsdp/tensor_parallel/tensor_parallel.h"
