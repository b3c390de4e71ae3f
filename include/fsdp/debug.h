#pragma once
// FSDP for LibTorch: diagnostics and tuning, in one include. Nothing here is needed to train;
// these are for measuring, tuning and debugging a run (docs/environment.md lists the variables
// that set the same knobs without code).
//
//   phase_timers.h     where a step's time goes, per FSDP phase
//   comm_stats.h       bytes and calls per collective
//   cpu_collectives.h  how CPU (Gloo) collectives are issued and overlapped
//   gpu_stats.h        CUDA-side counters of the GPU path
//   flight_recorder.h  the last collectives of each rank, dumped on a hang or error
//   desync.h           a check that every rank issues the same collectives
//   buffer_pool.h      FSDP's own buffers: counted by owner, cached on the CPU
//   malloc_tuning.h    glibc malloc settings for training processes
//   cpu_tuning.h       threads per rank and BLAS settings
//   comm/backend.h     Gloo's threads, scheduler slice and fallback collectives (and backend creation)
//   fault_injection.h  failures injected into checkpoint saves (tests of crash safety)
//   profiler.h         Chrome traces of steps with FSDP's phases as named ranges
#include "fsdp/comm/backend.h"
#include "fsdp/debug/buffer_pool.h"
#include "fsdp/debug/comm_stats.h"
#include "fsdp/debug/cpu_collectives.h"
#include "fsdp/debug/cpu_tuning.h"
#include "fsdp/debug/desync.h"
#include "fsdp/debug/fault_injection.h"
#include "fsdp/debug/flight_recorder.h"
#include "fsdp/debug/gpu_stats.h"
#include "fsdp/debug/malloc_tuning.h"
#include "fsdp/debug/phase_timers.h"
#include "fsdp/debug/profiler.h"
