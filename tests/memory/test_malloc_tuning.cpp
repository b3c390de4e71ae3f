// fsdp::tune_malloc_for_speed: after it, a large tensor freed and allocated again comes back from
// glibc's heap (no page faulted in again), where glibc's default maps and faults it every time;
// FSDP_MALLOC_TUNING=0 leaves malloc alone.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdlib>

#include "fsdp/debug/malloc_tuning.h"

namespace {

long minor_faults() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

// Faults per cycle of allocating, touching every page of and freeing `bytes`.
long faults_per_cycle(size_t bytes, int cycles) {
  const long before = minor_faults();
  for (int i = 0; i < cycles; ++i) {
    auto* p = static_cast<volatile char*>(std::malloc(bytes));
    for (size_t off = 0; off < bytes; off += 4096) p[off] = 1;
    std::free(const_cast<char*>(p));
  }
  return (minor_faults() - before) / cycles;
}

}  // namespace

TEST(MallocTuning, SpeedKeepsLargeBlocksResident) {
#ifndef __GLIBC__
  GTEST_SKIP() << "not glibc";
#endif
  // 40 MB: above glibc's largest dynamic mmap threshold (32 MiB), so mapped and faulted every time.
  const size_t bytes = size_t{40} << 20;
  const long untuned = faults_per_cycle(bytes, 5);
  EXPECT_GT(untuned, 5000) << "glibc's default should fault the block in every cycle";
  ::setenv("FSDP_MALLOC_TUNING", "0", 1);
  EXPECT_FALSE(fsdp::tune_malloc_for_speed(size_t{64} << 20, size_t{256} << 20));
  ::unsetenv("FSDP_MALLOC_TUNING");
  ASSERT_TRUE(fsdp::tune_malloc_for_speed(size_t{64} << 20, size_t{256} << 20));
  faults_per_cycle(bytes, 1);  // the heap grows once
  const long tuned = faults_per_cycle(bytes, 5);
  EXPECT_LT(tuned, 100) << "after tune_malloc_for_speed the block should stay in the heap (untuned: " << untuned
                        << " faults per cycle)";
}
