#pragma once
// Memory preflight: before anything is allocated, estimate the memory one rank of a
// configuration needs and refuse what cannot fit the memory available, with one line naming the
// options and the estimate.
//
//   check_memory(options, model->parameter_count(options), world_size, local_world_size);  // throws
//
// The estimate (per rank; bytes; N = parameters, S = ranks a parameter is sharded over: the world
// under fsdp, --shard-size under hsdp, 1 under replicate/none; b = sequences per micro-batch on a
// rank = batch / (world x grad-accum); T = seq-len, C = dim, H = heads, L = layers, V = 256):
//   N            = root + L block, the architecture's ParameterCount (spec.h): the GPT's
//                  2VC + TC + 2C + L (12C^2 + 13C), the Llama's
//                  2VC + C + L (2C^2 + 2C (C/H) KV + 3CF + 2C), KV = --kv-heads, F = --ffn-dim
//   state        = 16 N / S      fp32 parameters, gradients, AdamW exp_avg and exp_avg_sq
//   working set  = (2p + 4) U    the largest unit's U parameters gathered (current + prefetched,
//                                p = 4 fp32 or 2 bf16 bytes) and its unsharded gradient (sharded only)
//   activations  = a b T L (17C + HT)          saved for backward (a = 4 fp32, 2 bf16 bytes)
//                                (--activation-checkpointing: a checkpointed block keeps a b T C,
//                                 plus one block's a b T (17C + HT) while it recomputes)
//                + 8 b H T^2 + 4 b T (2C + 3V)  attention scores in flight, embeddings and logits
//   data         = the --data file (read whole)
//   runtime      = 256 MiB       LibTorch, Gloo, the allocator's slack
// It is deliberately rough (default run on 2 ranks: 315 MiB estimated, 261 MiB peak RSS); its job is
// to refuse the hopeless before minutes of allocating, not to plan the last gigabyte.
//
// The memory available to the host: MemAvailable of /proc/meminfo, lowered to the cgroup's
// limit minus its usage when one is set (v2 memory.max, or v1 memory.limit_in_bytes), divided
// by the ranks on this host. FSDP_TEST_MEMORY_AVAILABLE (bytes, or with a K/M/G/T suffix,
// powers of 1024) overrides the host's figure (tests; or to keep room for other jobs).
#include <cstdint>
#include <string>

#include "options.h"

namespace train_gpt {

// The parameters of one block (a decoder layer) and of the rest (embeddings, head, final norm):
// what the estimate needs of an architecture (spec.h TrainModel::parameter_count).
struct ParameterCount {
  double block = 0, root = 0;
};

struct MemoryEstimate {
  double parameters = 0;  // the whole model's count
  double state_bytes = 0, working_bytes = 0, activation_bytes = 0, data_bytes = 0, runtime_bytes = 0;
  double total() const { return state_bytes + working_bytes + activation_bytes + data_bytes + runtime_bytes; }
};

// Per rank. `world_size`: ranks in the job (1 under --parallel none).
MemoryEstimate estimate_memory(const Options& o, const ParameterCount& count, int world_size, int local_world_size);

struct AvailableMemory {
  double bytes = 0;    // for the whole host
  std::string source;  // "MemAvailable", "cgroup memory.max", "FSDP_TEST_MEMORY_AVAILABLE"
};
// Throws std::invalid_argument for a malformed FSDP_TEST_MEMORY_AVAILABLE.
AvailableMemory available_memory();

// "1.5 GiB", "12 TiB"
std::string format_bytes(double bytes);

// Refuses (std::invalid_argument, one line) a configuration whose estimate exceeds the memory
// available per rank. Returns the estimate and the availability line for the trainer's banner.
std::string check_memory(const Options& o, const ParameterCount& count, int world_size, int local_world_size);

}  // namespace train_gpt
