// main() for test binaries with rank workers: a copy started by run_ranks runs its worker only.
#include <gtest/gtest.h>

#include <cstdlib>

#include "fsdp/debug/cpu_tuning.h"
#include "multiprocess.h"

int main(int argc, char** argv) {
  // A rank worker stands for a user's program: it gets the same start-up CPU tuning.
  if (std::getenv("FSDP_TEST_WORKER") != nullptr) fsdp::dist::tune_cpu_or_reexec(argc, argv);
  const int worker_rc = fsdp::testing::maybe_run_worker();
  if (worker_rc >= 0) return worker_rc;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
