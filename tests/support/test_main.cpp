// main() for test binaries with rank workers: a copy started by run_ranks runs its worker only.
#include <gtest/gtest.h>

#include "multiprocess.h"

int main(int argc, char** argv) {
  const int worker_rc = fsdp::testing::maybe_run_worker();
  if (worker_rc >= 0) return worker_rc;
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
