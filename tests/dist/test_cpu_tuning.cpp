// OpenBLAS core selection: force a fitting core only where OpenBLAS fell back to generic kernels.
#include <gtest/gtest.h>

#include <cstdlib>

#include "fsdp/dist/cpu_tuning.h"

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
  EXPECT_EQ(openblas_coretype_for("", avx512), "");            // reference BLAS: nothing to tune
  EXPECT_EQ(openblas_coretype_for("Prescott", "flags : sse2"), "");  // an old CPU really is generic
  // Whole flags only: "avx2" inside another word does not count.
  EXPECT_EQ(openblas_coretype_for("Prescott", "flags : xavx2 fma"), "");
}

TEST(CpuTuning, ThisProcessLoadedOpenBlasAndAFittingCore) {
  // The set-up installs libopenblas0-pthread: LibTorch must be running on it, not the reference BLAS.
  const std::string core = fsdp::dist::openblas_loaded_corename();
  EXPECT_FALSE(core.empty()) << "LibTorch is not using OpenBLAS: run scripts/setup.sh (libopenblas0-pthread)";
  // Either OpenBLAS recognised the CPU, or the variable is set (by the launcher or the re-exec).
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {
    EXPECT_EQ(openblas_coretype_for(core, fsdp::dist::cpu_flags()), "") << "OpenBLAS runs generic kernels: " << core;
  }
}

TEST(CpuTuning, OmpThreadsSplitTheCores) {
  EXPECT_GE(fsdp::dist::default_omp_threads(1), 1);
  EXPECT_EQ(fsdp::dist::default_omp_threads(100000), 1);
  EXPECT_GE(fsdp::dist::default_omp_threads(1), fsdp::dist::default_omp_threads(2));
}
