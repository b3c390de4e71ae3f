#include "fsdp/debug/cpu_tuning.h"

#include <dlfcn.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <thread>
#include <vector>

namespace fsdp::dist {

std::string openblas_loaded_corename() {
  // Test hook: pretend OpenBLAS picked this core, to exercise the re-exec path on any CPU.
  if (const char* fake = std::getenv("FSDP_TEST_OPENBLAS_CORENAME");
      fake && std::getenv("FSDP_TUNED_REEXEC") == nullptr) {
    return fake;
  }
  // LibTorch links the BLAS through the system alternative; if it is OpenBLAS the symbol exists.
  using CoreNameFn = char* (*)();
  auto fn = reinterpret_cast<CoreNameFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  if (fn == nullptr) return {};
  const char* name = fn();
  return name ? std::string(name) : std::string();
}

std::string cpu_flags() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) == 0) return line;
  }
  return {};
}

static bool has_flag(std::string_view flags, std::string_view flag) {
  // Flags are space separated; match whole words only ("avx2" must not match "avx512...").
  size_t pos = 0;
  while ((pos = flags.find(flag, pos)) != std::string_view::npos) {
    const bool start_ok = pos == 0 || flags[pos - 1] == ' ' || flags[pos - 1] == ':' || flags[pos - 1] == '\t';
    const size_t end = pos + flag.size();
    const bool end_ok = end == flags.size() || flags[end] == ' ' || flags[end] == '\n';
    if (start_ok && end_ok) return true;
    pos = end;
  }
  return false;
}

std::string openblas_coretype_for(std::string_view corename, std::string_view flags) {
  if (corename.empty()) return {};
  // The names OpenBLAS's DYNAMIC_ARCH picks when it does not recognise the CPU model.
  static const std::vector<std::string_view> generic = {"Prescott", "Katmai",     "Coppermine", "Northwood", "Core2",
                                                        "Penryn",   "Dunnington", "Nehalem",    "Atom",      "Banias"};
  bool is_generic = false;
  for (auto g : generic) is_generic |= (corename == g);
  if (!is_generic) return {};
  if (has_flag(flags, "avx512f") && has_flag(flags, "avx512bw") && has_flag(flags, "avx512vl")) return "SkylakeX";
  if (has_flag(flags, "avx2") && has_flag(flags, "fma")) return "Haswell";
  if (has_flag(flags, "avx")) return "Sandybridge";
  return {};
}

std::string recommended_openblas_coretype() {
  const char* set = std::getenv("OPENBLAS_CORETYPE");
  if (set != nullptr && *set != '\0') return {};
  return openblas_coretype_for(openblas_loaded_corename(), cpu_flags());
}

int default_omp_threads(int local_world_size) {
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  if (cores <= 0) cores = static_cast<long>(std::thread::hardware_concurrency());
  if (local_world_size <= 0) local_world_size = 1;
  long threads = cores / local_world_size;
  return threads < 1 ? 1 : static_cast<int>(threads);
}

int openblas_num_threads() {
  using GetFn = int (*)();
  auto fn = reinterpret_cast<GetFn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  return fn == nullptr ? -1 : fn();
}

void set_num_threads(int n) {
  if (n < 1)
    throw std::invalid_argument("fsdp::dist::set_num_threads: " + std::to_string(n) + " threads; use 1 or more");
  at::set_num_threads(n);
  using SetFn = void (*)(int);
  if (auto fn = reinterpret_cast<SetFn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads")); fn != nullptr) fn(n);
}

void tune_cpu_or_reexec(int argc, char** argv) {
  (void)argc;
  const char* off = std::getenv("FSDP_NO_REEXEC");
  if (off != nullptr && std::string_view(off) == "1") return;
  // Marker so a re-executed process never loops, even if OpenBLAS ignored the variable.
  if (std::getenv("FSDP_TUNED_REEXEC") != nullptr) return;
  const std::string core = recommended_openblas_coretype();
  if (core.empty()) return;
  setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  setenv("FSDP_TUNED_REEXEC", "1", 1);
  execv("/proc/self/exe", argv);
  // execv only returns on failure: carry on with the slow kernels rather than stop.
}

}  // namespace fsdp::dist
