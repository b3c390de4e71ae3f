#include "fsdp/debug/malloc_tuning.h"

#include <cstdio>
#include <cstdlib>
#include <string>

#ifdef __GLIBC__
#include <malloc.h>
#include <unistd.h>
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

#ifdef __GLIBC__
// Whether the environment fixes glibc's thresholds (GLIBC_TUNABLES or the older MALLOC_*_
// variables): raise_malloc_thresholds then leaves the trim threshold as the user set it.
bool thresholds_fixed_by_environment() {
  for (const char* name : {"MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  if (tunables == nullptr) return false;
  const std::string t = tunables;
  for (const char* key : {"glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold", "glibc.malloc.top_pad"}) {
    if (t.find(key) != std::string::npos) return true;
  }
  return false;
}
#endif

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

// The same two mallopt calls as tune_malloc; only the defaults (the header) differ.
bool tune_malloc_for_speed(size_t mmap_threshold, size_t trim_threshold) {
  return tune_malloc(mmap_threshold, trim_threshold);
}

bool raise_malloc_thresholds() {
  if (!tuning_allowed()) return false;
#ifdef __GLIBC__
  // A mapped chunk of at most 32 MiB (glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit) lifts the
  // thresholds when freed, its size compared with its flag bits: request two pages less, so that the
  // chunk with its header is one page under 32 MiB.
  constexpr size_t kCeiling = size_t{32} << 20;
  constexpr size_t kTrimThreshold = size_t{256} << 20;
  const long page = sysconf(_SC_PAGESIZE);
  void* block = std::malloc(kCeiling - 2 * static_cast<size_t>(page > 0 ? page : 4096));
  if (block == nullptr) return false;
  static_cast<volatile char*>(block)[0] = 0;  // not optimised away with the free below
  std::free(block);
  // glibc now trims the heap's top when 64 MiB are free there. A step that frees more than that
  // at the top (backward releasing activations: ~130 MB on the 85.6M GPT's FSDP ranks) gives it
  // back and faults it in again in the next forward, every step, with the peak RSS unchanged (the
  // same pages are in use again at the peak). Fixing the trim threshold higher keeps them; the
  // mmap threshold stays where the block left it (32 MiB), as mallopt fixes it too.
  if (!thresholds_fixed_by_environment()) mallopt(M_TRIM_THRESHOLD, static_cast<int>(kTrimThreshold));
  return true;
#else
  return false;
#endif
}

}  // namespace fsdp
