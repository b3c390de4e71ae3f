// Compute threads per rank: fsdp::dist::set_num_threads sets LibTorch's OpenMP pool
// and OpenBLAS's own pthread pool together. at::set_num_threads alone leaves OpenBLAS at what it
// read when loaded (every core when OMP_NUM_THREADS and OPENBLAS_NUM_THREADS are unset), so two
// ranks on two cores would each run two GEMM threads.
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <iostream>
#include <string>

#include "fsdp/debug/cpu_tuning.h"
#include "multiprocess.h"
#include "subprocess.h"
#include "test_helpers.h"

FSDP_RANK_WORKER(report_threads) {
  std::cout << "loaded: omp=" << at::get_num_threads() << " blas=" << fsdp::dist::openblas_num_threads() << std::endl;
  at::set_num_threads(1);
  std::cout << "at::set_num_threads(1): omp=" << at::get_num_threads() << " blas=" << fsdp::dist::openblas_num_threads()
            << std::endl;
  fsdp::dist::set_num_threads(1);
  std::cout << "fsdp::dist::set_num_threads(1): omp=" << at::get_num_threads()
            << " blas=" << fsdp::dist::openblas_num_threads() << std::endl;
}

TEST(Threads, SetNumThreadsAlsoSetsOpenBlas) {
  // A process started without any thread variable, as a rank started by a launcher that sets none.
  fsdp::testing::ProcessSpec spec;
  spec.argv = {fsdp::testing::self_exe()};
  spec.env_set = {{"FSDP_TEST_WORKER", "report_threads"}, {"FSDP_TEST_INIT", "0"}};
  spec.env_unset = {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"};
  auto r = fsdp::testing::run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  std::cout << r.output;
  ASSERT_NE(fsdp::dist::openblas_num_threads(), -1) << "LibTorch is not using OpenBLAS: run scripts/setup.sh";
  EXPECT_NE(r.output.find("fsdp::dist::set_num_threads(1): omp=1 blas=1"), std::string::npos) << r.output;
  // (The output also shows what at::set_num_threads alone leaves OpenBLAS at: on Debian 12's
  // LibTorch 1.13 every core, the oversubscription this fixes.)
}

TEST(Threads, RejectsLessThanOne) { EXPECT_ERROR_CONTAINS(fsdp::dist::set_num_threads(0), "use 1 or more"); }
