// OpenBLAS core selection: force a fitting core only where OpenBLAS fell back to generic kernels.
#include <gtest/gtest.h>
#include <sched.h>
#include <sys/syscall.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "fsdp/comm/backend.h"
#include "fsdp/debug/cpu_tuning.h"
#include "fsdp/dist/runtime.h"
#include "multiprocess.h"
#include "test_helpers.h"

using fsdp::dist::openblas_coretype_for;

TEST(CpuTuning, GenericFallbackGetsTheCpusCore) {
  const std::string avx512 = "flags : fpu sse2 avx avx2 fma avx512f avx512bw avx512vl";
  const std::string avx2 = "flags : fpu sse2 avx avx2 fma";
  EXPECT_EQ(openblas_coretype_for("Prescott", avx512), "SkylakeX");
  EXPECT_EQ(openblas_coretype_for("Prescott", avx2), "Haswell");
  EXPECT_EQ(openblas_coretype_for("Core2", "flags : sse2 avx"), "Sandybridge");
}

TEST(CpuTuning, RecognisedCpuOrNoOpenBlasIsLeftAlone) {
  const std::string avx512 = "flags : avx2 fma avx512f avx512bw avx512vl";
  EXPECT_EQ(openblas_coretype_for("SkylakeX", avx512), "");
  EXPECT_EQ(openblas_coretype_for("Cooperlake", avx512), "");
  EXPECT_EQ(openblas_coretype_for("Haswell", avx512), "");
  EXPECT_EQ(openblas_coretype_for("", avx512), "");                  // reference BLAS: nothing to tune
  EXPECT_EQ(openblas_coretype_for("Prescott", "flags : sse2"), "");  // an old CPU really is generic
  // Whole flags only: "avx2" inside another word does not count.
  EXPECT_EQ(openblas_coretype_for("Prescott", "flags : xavx2 fma"), "");
}

FSDP_RANK_WORKER(print_blas) {
  const char* core = std::getenv("OPENBLAS_CORETYPE");
  const char* tuned = std::getenv("FSDP_TUNED_REEXEC");
  std::cout << "OPENBLAS_CORETYPE=" << (core ? core : "unset") << " FSDP_TUNED_REEXEC=" << (tuned ? tuned : "unset")
            << " loaded=" << fsdp::dist::openblas_loaded_corename() << std::endl;
}

TEST(CpuTuning, ThisProcessLoadedOpenBlasAndAFittingCore) {
  // The set-up installs libopenblas0-pthread: LibTorch must be running on it, not the reference BLAS.
  const std::string core = fsdp::dist::openblas_loaded_corename();
  EXPECT_FALSE(core.empty()) << "LibTorch is not using OpenBLAS: run scripts/setup.sh (libopenblas0-pthread)";
  // Either OpenBLAS recognised the CPU, or the variable is set (by the launcher or the re-exec),
  // or this process was not tuned (a test binary does not re-execute itself; Debian 12's OpenBLAS
  // 0.3.21 takes some AVX-512 Xeons for Prescott): then the core the re-exec would force must load
  // in a process started with it (GenericFallbackReexecutesOnceWithTheCore checks the re-exec).
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  const std::string forced = openblas_coretype_for(core, fsdp::dist::cpu_flags());
  if (forced.empty()) return;  // recognised (or a CPU whose generic kernels are the right ones)
  std::cout << "OpenBLAS runs generic kernels here (" << core << "); tuned processes force " << forced << std::endl;
  fsdp::testing::ProcessSpec spec;
  spec.argv = {fsdp::testing::self_exe()};
  spec.env_set = {{"FSDP_TEST_WORKER", "print_blas"},
                  {"FSDP_TEST_INIT", "0"},
                  {"OPENBLAS_CORETYPE", forced},
                  {"FSDP_TUNED_REEXEC", "1"}};
  auto r = fsdp::testing::run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("loaded=" + forced), std::string::npos) << r.output;
}

TEST(CpuTuning, OmpThreadsSplitTheCores) {
  EXPECT_GE(fsdp::dist::default_omp_threads(1), 1);
  EXPECT_EQ(fsdp::dist::default_omp_threads(100000), 1);
  EXPECT_GE(fsdp::dist::default_omp_threads(1), fsdp::dist::default_omp_threads(2));
}

TEST(CpuTuning, GenericFallbackReexecutesOnceWithTheCore) {
  // The hook makes the program believe OpenBLAS fell back to Prescott: it must set the variable,
  // re-execute itself once, and then run with OpenBLAS on that core.
  fsdp::testing::ProcessSpec spec;
  spec.argv = {fsdp::testing::self_exe()};
  spec.env_set = {
      {"FSDP_TEST_WORKER", "print_blas"}, {"FSDP_TEST_INIT", "0"}, {"FSDP_TEST_OPENBLAS_CORENAME", "Prescott"}};
  spec.env_unset = {"OPENBLAS_CORETYPE", "FSDP_TUNED_REEXEC", "FSDP_NO_REEXEC"};
  auto r = fsdp::testing::run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  const std::string want = fsdp::dist::openblas_coretype_for("Prescott", fsdp::dist::cpu_flags());
  // (On a CPU without AVX the generic kernels are the right ones: then nothing may change.)
  const std::string expected = want.empty() ? "OPENBLAS_CORETYPE=unset FSDP_TUNED_REEXEC=unset"
                                            : "OPENBLAS_CORETYPE=" + want + " FSDP_TUNED_REEXEC=1 loaded=" + want;
  EXPECT_NE(r.output.find(expected), std::string::npos) << r.output;

  // Without the hook the program tunes only where this machine's OpenBLAS really fell back (this
  // test process is not tuned, so its loaded core is the one OpenBLAS picks by itself).
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;  // this process's core was forced: unknown
  spec.env_unset.push_back("FSDP_TEST_OPENBLAS_CORENAME");
  spec.env_set.erase("FSDP_TEST_OPENBLAS_CORENAME");
  r = fsdp::testing::run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  const std::string natural = openblas_coretype_for(fsdp::dist::openblas_loaded_corename(), fsdp::dist::cpu_flags());
  const std::string unchanged = natural.empty()
                                    ? "OPENBLAS_CORETYPE=unset FSDP_TUNED_REEXEC=unset"
                                    : "OPENBLAS_CORETYPE=" + natural + " FSDP_TUNED_REEXEC=1 loaded=" + natural;
  EXPECT_NE(r.output.find(unchanged), std::string::npos) << r.output;
}

// ---- FSDP_CPU_BIND=cores ([Note: ranks bound to cores] in src/dist/cpu_binding.cpp) ----------

using fsdp::dist::cpus_for_local_rank;

TEST(CpuBinding, EachLocalRankTakesItsOwnBlockOfCpus) {
  EXPECT_EQ(cpus_for_local_rank({0, 1}, 0, 2), (std::vector<int>{0}));
  EXPECT_EQ(cpus_for_local_rank({0, 1}, 1, 2), (std::vector<int>{1}));
  EXPECT_EQ(cpus_for_local_rank({0, 1, 2, 3}, 1, 2), (std::vector<int>{2, 3}));
  EXPECT_EQ(cpus_for_local_rank({4, 5, 6, 7, 8}, 1, 2), (std::vector<int>{6, 7}));  // the remainder unused
  EXPECT_EQ(cpus_for_local_rank({2, 3, 4, 5}, 0, 1), (std::vector<int>{2, 3, 4, 5}));
  // Fewer CPUs than ranks: one CPU each, in turn.
  EXPECT_EQ(cpus_for_local_rank({0, 1}, 2, 3), (std::vector<int>{0}));
  EXPECT_EQ(cpus_for_local_rank({7}, 1, 2), (std::vector<int>{7}));
  EXPECT_TRUE(cpus_for_local_rank({}, 0, 2).empty());
}

TEST(CpuBinding, BadValuesAreNamed) {
  ::setenv("FSDP_CPU_BIND", "core", 1);
  EXPECT_ERROR_CONTAINS(fsdp::dist::cpu_bind_from_env(), "FSDP_CPU_BIND='core' is not a binding: use cores");
  ::setenv("FSDP_CPU_BIND", "none", 1);
  EXPECT_EQ(fsdp::dist::cpu_bind_from_env(), fsdp::dist::CpuBind::None);
  ::setenv("FSDP_CPU_BIND", "cores", 1);
  EXPECT_EQ(fsdp::dist::cpu_bind_from_env(), fsdp::dist::CpuBind::Cores);
  ::unsetenv("FSDP_CPU_BIND");
  EXPECT_EQ(fsdp::dist::cpu_bind_from_env(), fsdp::dist::CpuBind::None);

  ::setenv("FSDP_TRANSPORT_SLICE_US", "50", 1);
  EXPECT_ERROR_CONTAINS(fsdp::comm::transport_slice_us(), "FSDP_TRANSPORT_SLICE_US='50' is not a scheduler slice");
  ::setenv("FSDP_TRANSPORT_SLICE_US", "0", 1);
  EXPECT_EQ(fsdp::comm::transport_slice_us(), 0);
  ::setenv("FSDP_TRANSPORT_SLICE_US", "300", 1);
  EXPECT_EQ(fsdp::comm::transport_slice_us(), 300);
  ::unsetenv("FSDP_TRANSPORT_SLICE_US");
  EXPECT_EQ(fsdp::comm::transport_slice_us(), 0);  // nothing bound in this process
}

namespace {
// sched_getattr's result (linux/sched/types.h).
struct SchedAttr {
  uint32_t size, sched_policy;
  uint64_t sched_flags;
  int32_t sched_nice;
  uint32_t sched_priority;
  uint64_t sched_runtime, sched_deadline, sched_period;
  uint32_t sched_util_min, sched_util_max;
};
uint64_t slice_ns(long tid) {
  SchedAttr a{};
  if (syscall(SYS_sched_getattr, tid, &a, sizeof a, 0u) != 0) return 0;
  return a.sched_runtime;  // the slice of a SCHED_OTHER thread on Linux 6.12+; 0 before
}
std::vector<int> affinity_of(long tid) {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (sched_getaffinity(static_cast<pid_t>(tid), sizeof set, &set) != 0) return out;
  for (int c = 0; c < CPU_SETSIZE; ++c) {
    if (CPU_ISSET(c, &set)) out.push_back(c);
  }
  return out;
}
std::string joined(const std::vector<int>& v) {
  std::string s;
  for (int c : v) s += (s.empty() ? "" : ",") + std::to_string(c);
  return s;
}
}  // namespace

// Each rank, after init_distributed under FSDP_CPU_BIND=cores: every thread's CPUs (the main
// thread's and Gloo's alike), and how many threads carry the 100 us transport slice.
FSDP_RANK_WORKER(report_binding) {
  const std::string main_cpus = joined(affinity_of(::syscall(SYS_gettid)));
  int threads = 0, other_cpus = 0, short_slice = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    const long tid = std::stol(entry.path().filename().string());
    ++threads;
    if (joined(affinity_of(tid)) != main_cpus) ++other_cpus;
    if (slice_ns(tid) == 100000) ++short_slice;
  }
  const bool kernel_reports_slices = slice_ns(::syscall(SYS_gettid)) != 0;
  // Collectives still work bound.
  auto t = torch::full({4}, static_cast<float>(fsdp::dist::rank() + 1));
  fsdp::dist::world_comm()->all_reduce(t, fsdp::comm::ReduceOp::Sum);
  TORCH_CHECK(t[0].item<float>() == 3.0f, "all_reduce gave ", t[0].item<float>());
  std::cout << "rank " << fsdp::dist::rank() << " cpus=" << main_cpus << " threads=" << threads
            << " other_cpus=" << other_cpus << " short_slice=" << short_slice
            << " kernel_reports_slices=" << kernel_reports_slices << std::endl;
}

TEST(CpuBinding, RanksAreBoundWithTheirTransportThreads) {
  std::vector<int> allowed = affinity_of(::syscall(SYS_gettid));
  fsdp::testing::RanksOptions opts;
  opts.env["FSDP_CPU_BIND"] = "cores";
  auto result = fsdp::testing::run_ranks(2, "report_binding", opts);
  ASSERT_TRUE(result.all_ok()) << result.report();
  for (int r = 0; r < 2; ++r) {
    const std::string& out = result.ranks[static_cast<size_t>(r)].output;
    std::cout << out;
    const std::string expect = "rank " + std::to_string(r) + " cpus=" + joined(cpus_for_local_rank(allowed, r, 2));
    EXPECT_NE(out.find(expect), std::string::npos) << "expected '" << expect << "' in\n" << out;
    EXPECT_NE(out.find(" other_cpus=0 "), std::string::npos) << "a thread escaped the binding:\n" << out;
    if (out.find("kernel_reports_slices=1") != std::string::npos) {
      // Gloo's device loop and its 2 workers at least; the main thread keeps the kernel's slice.
      EXPECT_EQ(out.find(" short_slice=0 "), std::string::npos) << out;
      EXPECT_EQ(out.find(" short_slice=1 "), std::string::npos) << out;
      EXPECT_EQ(out.find(" short_slice=2 "), std::string::npos) << out;
    }
  }
  // Unbound (the default): no thread asks for the short slice.
  auto unbound = fsdp::testing::run_ranks(2, "report_binding");
  ASSERT_TRUE(unbound.all_ok()) << unbound.report();
  for (const auto& rank : unbound.ranks)
    EXPECT_NE(rank.output.find(" short_slice=0 "), std::string::npos) << rank.output;
}

TEST(CpuBinding, BadBindingIsNamedBeforeTheStore) {
  fsdp::testing::RanksOptions opts;
  opts.env["FSDP_CPU_BIND"] = "socket";
  auto result = fsdp::testing::run_ranks(2, "report_binding", opts);
  EXPECT_FALSE(result.all_ok());
  EXPECT_NE(result.report().find("FSDP_CPU_BIND='socket' is not a binding"), std::string::npos) << result.report();
}
