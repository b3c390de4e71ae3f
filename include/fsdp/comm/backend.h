#pragma once
// Creating c10d backends (Gloo for CPU, NCCL for CUDA when this LibTorch has it).
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/comm/comm.h"

namespace fsdp::comm {

// True when this build of the library can create an NCCL backend.
bool nccl_available();

// The backend for a device type: "cpu" -> Gloo, "cuda" -> NCCL (errors name what is missing).
BackendKind backend_for_device(const std::string& device_type);

// Shuts down the NCCL communicators of every group made so far that is still alive, after their
// queued collectives have completed (destroy_distributed calls it); returns how many were shut
// down (0 in builds without NCCL, or where LibTorch has no clean shutdown: compat/nccl.h).
// `wait_limit`: how long to wait for the queued collectives (at exit the watch no longer ends a
// hung one); past it the groups are left as they are and 0 is returned.
size_t shutdown_nccl_groups(std::chrono::milliseconds wait_limit = std::chrono::milliseconds::max());

// Gloo's worker threads per process group: FSDP_GLOO_THREADS, else 2 (PyTorch's default): a
// prefetched all-gather and a pending reduce-scatter can move at once. One runs a group's
// collectives one after another, in the order every rank issues them; on 2 cores that also compute
// it measured within the runs' noise of two (docs/benchmarks.md, "FSDP's own cost"). A value that
// is not 1 to 64 throws std::invalid_argument naming the variable.
int gloo_threads();

// How Comm builds the collectives Gloo lacks on CPU tensors (reduce_scatter_tensor everywhere; the
// flat all_gather_into_tensor, whose Gloo implementation copies through a flat buffer of its own): PointToPoint
// (default) over the backend's send/recv, defined in comm/p2p_collectives.cpp: the reduce-scatter sends each rank its
// chunk and adds what arrives one chunk at a time (scratch: 1/N of the input; for N > 2 only the first chunk moves
// before wait()), the all-gather receives every chunk straight into the output (no scratch, no
// copy back); Collective: all_to_all into a scratch as large as the input, then a local sum, and
// the list all-gather (through c10d's own flat buffer). Same bytes either way. The environment
// variable FSDP_GLOO_FALLBACK=p2p|collective sets the default; set_gloo_fallback overrides it.
enum class GlooFallback { PointToPoint, Collective };
void set_gloo_fallback(GlooFallback fallback);
GlooFallback gloo_fallback();

// The scheduler slice, in microseconds, that Gloo's threads of every group made from now on ask
// for (Linux 6.12+'s EEVDF custom slice, sched_setattr's sched_runtime): FSDP_TRANSPORT_SLICE_US,
// else what set_default_transport_slice_us() set (init_distributed: 100 under FSDP_CPU_BIND=cores),
// else 0: the kernel's default. A short slice gives a woken transport thread an early deadline, so
// it runs at once on a core that a compute thread keeps busy, instead of after that thread's slice
// ([Note: ranks bound to cores] in src/dist/cpu_binding.cpp). Older kernels ignore it. A value that
// is not 0 or 100 to 100000 throws std::invalid_argument naming the variable.
int transport_slice_us();
void set_default_transport_slice_us(int us);

// Creates the backend for a group whose members rendezvous through `store` (already prefixed so
// that groups do not collide). Collective among the members only. `hostname_hint` picks Gloo's
// network interface: the loopback when every rank is on this host, else the address on this
// machine's route to the hint (MASTER_ADDR), which the other hosts reach; GLOO_SOCKET_IFNAME wins.
// NCCL: bound to the current CUDA device (set the rank's device before creating groups), its
// communicator made here where LibTorch can (fsdp/compat/nccl.h).
std::shared_ptr<Comm> make_comm(BackendKind kind, const compat::StorePtr& store, std::vector<int> global_ranks,
                                int group_rank, std::chrono::milliseconds timeout, const std::string& name,
                                const std::string& hostname_hint);

}  // namespace fsdp::comm
