// OpenBLAS core selection: force a fitting core only where OpenBLAS fell back to generic kernels.
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>

#include "fsdp/debug/cpu_tuning.h"
#include "multiprocess.h"

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
  const char* tuned = std::getenv("FSDP_CPU_TUNED");
  std::cout << "OPENBLAS_CORETYPE=" << (core ? core : "unset") << " FSDP_CPU_TUNED=" << (tuned ? tuned : "unset")
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
                  {"FSDP_CPU_TUNED", "1"}};
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
  spec.env_unset = {"OPENBLAS_CORETYPE", "FSDP_CPU_TUNED", "FSDP_NO_REEXEC"};
  auto r = fsdp::testing::run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  const std::string want = fsdp::dist::openblas_coretype_for("Prescott", fsdp::dist::cpu_flags());
  // (On a CPU without AVX the generic kernels are the right ones: then nothing may change.)
  const std::string expected = want.empty() ? "OPENBLAS_CORETYPE=unset FSDP_CPU_TUNED=unset"
                                            : "OPENBLAS_CORETYPE=" + want + " FSDP_CPU_TUNED=1 loaded=" + want;
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
                                    ? "OPENBLAS_CORETYPE=unset FSDP_CPU_TUNED=unset"
                                    : "OPENBLAS_CORETYPE=" + natural + " FSDP_CPU_TUNED=1 loaded=" + natural;
  EXPECT_NE(r.output.find(unchanged), std::string::npos) << r.output;
}
