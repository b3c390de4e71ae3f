// fsdp::tune_malloc_for_speed: after it, a large tensor freed and allocated again comes back from
// glibc's heap (no page faulted in again), where glibc's default maps and faults it every time;
// FSDP_MALLOC_TUNING=0 leaves malloc alone. fsdp::tune_malloc: blocks below its mmap threshold
// (activations of 512 KiB) freed and allocated again stay resident: the heap is not trimmed.
// fsdp::raise_malloc_thresholds (first: the others fix glibc's thresholds for the whole process):
// the same heap is kept after it, where glibc's start trims and faults it in every cycle, and so is
// a swing of 96 MiB at the heap's top (above the 64 MiB trim threshold glibc's own rise reaches).
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <malloc.h>

#include <cstdlib>
#include <vector>

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

// Faults per cycle of allocating `count` blocks of `bytes`, touching them, and freeing them
// newest first (the heap's top is freed last, as when backward releases the activations).
long faults_per_heap_cycle(size_t bytes, int count, int cycles) {
  const long before = minor_faults();
  for (int c = 0; c < cycles; ++c) {
    std::vector<volatile char*> blocks;
    for (int i = 0; i < count; ++i) {
      auto* p = static_cast<volatile char*>(std::malloc(bytes));
      for (size_t off = 0; off < bytes; off += 4096) p[off] = 1;
      blocks.push_back(p);
    }
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) std::free(const_cast<char*>(*it));
  }
  return (minor_faults() - before) / cycles;
}

}  // namespace

// Runs first (gtest keeps declaration order): glibc's thresholds are still its own, dynamic ones.
TEST(MallocTuning, RaisedThresholdsKeepTheHeapResident) {
#ifndef __GLIBC__
  GTEST_SKIP() << "not glibc";
#endif
  if (std::getenv("GLIBC_TUNABLES") != nullptr) GTEST_SKIP() << "GLIBC_TUNABLES fixes malloc's thresholds";
  // 64 blocks of 512 KiB: the first free lifts glibc's thresholds to ~512 KiB / ~1 MiB, so the
  // blocks come from the heap and its top is trimmed (more than 1 MiB free) at the end of each cycle.
  faults_per_heap_cycle(512 * 1024, 64, 1);
  const long trimmed = faults_per_heap_cycle(512 * 1024, 64, 3);
  EXPECT_GT(trimmed, 5000) << "with glibc's own thresholds the heap's top should be faulted in every cycle";
  ::setenv("FSDP_MALLOC_TUNING", "0", 1);
  EXPECT_FALSE(fsdp::raise_malloc_thresholds());
  ::unsetenv("FSDP_MALLOC_TUNING");
  EXPECT_GT(faults_per_heap_cycle(512 * 1024, 64, 2), 5000) << "FSDP_MALLOC_TUNING=0 should leave malloc as it is";
  ASSERT_TRUE(fsdp::raise_malloc_thresholds());
  faults_per_heap_cycle(512 * 1024, 64, 1);  // the heap grows once
  const long raised = faults_per_heap_cycle(512 * 1024, 64, 3);
  EXPECT_LT(raised, 500) << "after raise_malloc_thresholds 32 MiB of free heap should stay resident (before: "
                         << trimmed << " faults per cycle)";
  // 96 MiB freed at the heap's top (4 blocks of 24 MiB, below the raised mmap threshold): more than
  // glibc's own 64 MiB trim threshold, so without the fixed 256 MiB it is trimmed and its ~24,000
  // pages faulted in again every cycle.
  faults_per_heap_cycle(size_t{24} << 20, 4, 1);
  const long swing = faults_per_heap_cycle(size_t{24} << 20, 4, 3);
  EXPECT_LT(swing, 500) << "after raise_malloc_thresholds 96 MiB freed at the heap's top should stay resident";
}

TEST(MallocTuning, SpeedKeepsLargeBlocksResident) {
#ifndef __GLIBC__
  GTEST_SKIP() << "not glibc";
#endif
  // The test above left 96 MiB free at the heap's top, kept by a 256 MiB trim threshold, where a
  // 40 MB block would fit: trim it away, as glibc's start would.
  ASSERT_EQ(mallopt(M_TRIM_THRESHOLD, 128 * 1024), 1);
  malloc_trim(0);
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

// Runs after the test above (gtest keeps declaration order): glibc's trim threshold is set back to
// its 128 KiB start first, so only tune_malloc() itself can keep the heap from being trimmed.
TEST(MallocTuning, TuneMallocKeepsTheHeapResident) {
#ifndef __GLIBC__
  GTEST_SKIP() << "not glibc";
#endif
  ASSERT_EQ(mallopt(M_TRIM_THRESHOLD, 128 * 1024), 1);
  // 64 blocks of 512 KiB (32 MiB, below 1 MiB each: from the heap, not mapped).
  faults_per_heap_cycle(512 * 1024, 64, 1);
  const long trimmed = faults_per_heap_cycle(512 * 1024, 64, 3);
  EXPECT_GT(trimmed, 5000) << "with a 128 KiB trim threshold the heap's top should be faulted in every cycle";
  ASSERT_TRUE(fsdp::tune_malloc());
  faults_per_heap_cycle(512 * 1024, 64, 1);
  const long tuned = faults_per_heap_cycle(512 * 1024, 64, 3);
  EXPECT_LT(tuned, 500) << "after tune_malloc the freed heap should stay resident (trimmed: " << trimmed
                        << " faults per cycle)";
}
