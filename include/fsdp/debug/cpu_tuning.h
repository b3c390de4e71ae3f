// layer: dist
#pragma once
// CPU settings that must be fixed before a process starts computing.
//
// Debian 12's OpenBLAS (0.3.21) does not recognise recent Xeons and falls back to its generic
// "Prescott" kernels, several times slower on GEMM. OpenBLAS reads OPENBLAS_CORETYPE only when it is
// loaded, so whoever starts the process must set it: fsdprun does for its workers, and a program
// started without the launcher calls `tune_cpu_or_reexec(argc, argv)` first thing in main().
#include <string>
#include <string_view>
#include <vector>

namespace fsdp::dist {

// The core OpenBLAS chose in this process ("Prescott", "SkylakeX", ...); empty when the BLAS
// that LibTorch loaded is not OpenBLAS.
std::string openblas_loaded_corename();

// The CPU feature flags line of /proc/cpuinfo (empty when unreadable).
std::string cpu_flags();

// Pure decision: the OPENBLAS_CORETYPE to force, or "" when OpenBLAS already uses kernels that
// fit the CPU (or is not loaded). Generic fallbacks are Prescott/Katmai/Core2-era names.
std::string openblas_coretype_for(std::string_view loaded_corename, std::string_view cpu_flags);

// openblas_coretype_for() applied to this process; "" when OPENBLAS_CORETYPE is already set.
std::string recommended_openblas_coretype();

// Intra-op threads per rank: the cores divided among the local workers (at least 1).
int default_omp_threads(int local_world_size);

// Sets this process's compute threads to n in both pools that do the work: LibTorch's intra-op
// (OpenMP) threads and OpenBLAS's own pthread pool. at::set_num_threads() alone leaves OpenBLAS
// at what it read when it was loaded (OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, else every
// core), so ranks started without OMP_NUM_THREADS would each run one GEMM thread per core.
// Example: set_num_threads(default_omp_threads(local_world_size()));
void set_num_threads(int n);

// OpenBLAS's thread count in this process; -1 when the BLAS LibTorch loaded is not OpenBLAS.
int openblas_num_threads();

// For programs started without fsdprun: when OPENBLAS_CORETYPE is unset and OpenBLAS fell back
// to generic kernels, set it and re-execute this program once (argv unchanged). Returns normally
// when nothing needs to change. FSDP_NO_REEXEC=1 disables it.
void tune_cpu_or_reexec(int argc, char** argv);

// FSDP_CPU_BIND, read by init_distributed (world > 1) before it reaches the store:
//   unset or "none"  the ranks' threads go where the scheduler puts them (the default);
//   "cores"          each rank of this host is bound to its own share of the CPUs the process may
//                    run on (cpus_for_local_rank), its transport threads included, and Gloo's
//                    threads ask for a 100 us slice (fsdp::comm::transport_slice_us) so that they run
//                    as soon as data arrives instead of after the compute thread's slice.
// Where the ranks of a host fill its cores (2 ranks of one thread on 2 cores) it removes the time
// in which a rank waits for another whose core ran the first one's transport ([Note: ranks bound
// to cores] in src/dist/cpu_binding.cpp; docs/benchmarks.md, "FSDP's own cost"). Leave it unset
// where other jobs share the host's cores, and where the launcher binds each rank already (srun
// --cpu-bind, mpirun --bind-to): each rank would split its own CPUs again. Anything else throws
// std::invalid_argument naming it.
enum class CpuBind { None, Cores };
CpuBind cpu_bind_from_env();

// Pure decision: the CPUs that local rank `local_rank` of `local_world` gets out of `allowed` (the
// process's CPUs, ascending): with at least as many CPUs as ranks, rank r takes the r-th of
// local_world equal consecutive blocks (the remainder stays unused); with fewer, CPU
// allowed[r % size] alone. Example: cpus_for_local_rank({0, 1, 2, 3}, 1, 2) == {2, 3}.
std::vector<int> cpus_for_local_rank(const std::vector<int>& allowed, int local_rank, int local_world);

// Binds every thread of this process (and so every thread it starts later) to
// cpus_for_local_rank(its allowed CPUs, local_rank, local_world); returns those CPUs (empty when
// the kernel refused: nothing changed).
std::vector<int> bind_to_local_cpus(int local_rank, int local_world);

}  // namespace fsdp::dist
