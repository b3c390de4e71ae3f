#include "fsdp/debug/malloc_tuning.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#ifdef __GLIBC__
#include <malloc.h>
#endif

namespace fsdp {

namespace {

// FSDP_MALLOC_TUNING=0: leave malloc as it is.
bool tuning_allowed() {
  if (const char* v = std::getenv("FSDP_MALLOC_TUNING")) {
    const std::string s = v;
    if (s == "0") return false;
    if (s != "1" && !s.empty()) {
      std::fprintf(stderr,
                   "fsdp: FSDP_MALLOC_TUNING='%s' is not 0 or 1; tuning malloc (set 0 to keep glibc's default)\n",
                   s.c_str());
    }
  }
  return true;
}

}  // namespace

bool tune_malloc(size_t mmap_threshold, size_t trim_threshold) {
  if (!tuning_allowed()) return false;
#ifdef __GLIBC__
  // Fixing the mmap threshold also fixes the trim threshold (glibc's dynamic adjustment stops):
  // set it too, or it stays at 128 KiB and the heap is trimmed and faulted in again every step.
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) == 1;
#else
  (void)mmap_threshold;
  (void)trim_threshold;
  return false;
#endif
}

bool tune_malloc_for_speed(size_t mmap_threshold, size_t trim_threshold) {
  if (!tuning_allowed()) return false;
#ifdef __GLIBC__
  return mallopt(M_MMAP_THRESHOLD, static_cast<int>(mmap_threshold)) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(trim_threshold)) == 1;
#else
  (void)mmap_threshold;
  (void)trim_threshold;
  return false;
#endif
}

}  // namespace fsdp
