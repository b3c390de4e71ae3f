// layer: comm
#pragma once
// Collective desync detection (TORCH_DISTRIBUTED_DEBUG=DETAIL, PyTorch's variable).
//
// When on, before each collective of a Comm of two or more ranks the group's ranks all-gather a
// fixed-size fingerprint of the call (operation, per-group sequence number, dtype, numel and shape
// of the input and output, reduce op, root, device type) over the group's own backend, with the
// group's timeout, and compare them. On any difference EVERY rank throws comm::CommError with one
// message naming the group, the sequence number and what each rank called, e.g.
//
//   fsdp: collective desync in group 'world' at sequence number 17: rank 0 called
//   all_gather_into_tensor float32 [4096] -> [8192], rank 1 called all_gather_into_tensor
//   float32 [2048] -> [4096] ...
//
// instead of hanging until the collective timeout or silently mixing tensors. The fingerprint
// exchange is not counted in CommStats (desync_check_counters() has it). A group of one (Local
// backend) is never checked. OFF, INFO or unset: off. The variable is read once per process and
// must be the same on every rank (fsdprun and torchrun pass the environment to every worker).
//
// Example:
//   setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL", 1);   // before the first collective, every rank
//   auto world = fsdp::dist::world_comm();
//   world->all_reduce(x);                            // checked first: same op, dtype, shape, seq
//   fsdp::comm::DesyncCheckCounters c = fsdp::comm::desync_check_counters();   // c.checks, c.bytes_sent
#include <ATen/ATen.h>

#include <cstdint>

#include "fsdp/comm/comm.h"
#include "fsdp/debug/comm_stats.h"

namespace fsdp::comm {

// True when TORCH_DISTRIBUTED_DEBUG=DETAIL (read at the first call) or after
// set_desync_detection(true). Throws std::invalid_argument for a value other than OFF, INFO,
// DETAIL (any case).
bool desync_detection_enabled();

// Overrides the environment for this process (benchmarks alternating on and off). Every rank of
// every group must switch at the same point of its collective sequence.
void set_desync_detection(bool on);

// What the checks cost this process: fingerprint exchanges and the bytes this rank sent for them
// (counted as a ring all-gather, as CommStats counts collectives).
struct DesyncCheckCounters {
  uint64_t checks = 0;
  uint64_t bytes_sent = 0;
};
DesyncCheckCounters desync_check_counters();

namespace detail {

// The hook Comm calls before each collective (after checking its arguments, before any shortcut
// for empty tensors): a no-op unless detection is on and the group has two or more ranks.
// `seq` is the collective's sequence number in the group (Comm::seq()); `in`/`out` may be
// undefined (barrier; in-place ops pass the tensor once); reduce_op and root are -1 where they do
// not apply.
void check_collective_matches(const Comm& comm, uint64_t seq, OpKind op, const at::Tensor& in, const at::Tensor& out,
                              int reduce_op = -1, int root = -1);

}  // namespace detail
}  // namespace fsdp::comm
