// Cost of the flight recorder per collective (fsdp/debug/flight_recorder.h): N cycles of what a
// Comm operation and its Work do (record on issue with the group found by name and ranks, started,
// completed), timed, and the heap allocations made in those cycles, counted by replacing operator
// new. Run it under callgrind for an instruction count that the machine's load does not blur:
//   valgrind --tool=callgrind --toggle-collect='*flight_cycles*' build/bin/flight_recorder_bench 100000
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <vector>

#include "fsdp/debug/flight_recorder.h"

namespace {
std::atomic<uint64_t> g_allocations{0};
}

void* operator new(std::size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

// Not inlined, so callgrind can collect exactly this loop.
__attribute__((noinline)) void flight_cycles(fsdp::comm::FlightRecorder& fr, const std::string& name,
                                             const std::vector<int>& ranks, int n) {
  for (int i = 0; i < n; ++i) {
    const uint64_t t = fr.record(name, ranks, 0, "all_gather_into_tensor", c10::ScalarType::Float, 1024, 2048);
    fr.started(t);
    fr.finished(t, fsdp::comm::FlightState::Completed);
  }
}

constexpr const char* kUsage =
    "usage: flight_recorder_bench [N]   (N collectives timed, default 100000; under valgrind --tool=callgrind "
    "--toggle-collect='*flight_cycles*' for instructions)";

// The command line: [N], a positive number of cycles; --help prints the usage (exit 0), anything
// else is one line naming it and the usage (exit 2).
int cycles_from(int argc, char** argv) {
  if (argc < 2) return 100000;
  const std::string a = argv[1];
  if (a == "--help" || a == "-h") {
    std::printf("%s\n", kUsage);
    std::exit(0);
  }
  char* end = nullptr;
  const long n = std::strtol(a.c_str(), &end, 10);
  if (argc > 2 || a.empty() || *end != '\0' || n < 1 || n > 1000000000) {
    std::fprintf(stderr, "flight_recorder_bench: N must be a whole number of cycles from 1 to 10^9, got '%s'\n%s\n",
                 argc > 2 ? argv[2] : a.c_str(), kUsage);
    std::exit(2);
  }
  return static_cast<int>(n);
}

int main(int argc, char** argv) {
  const int n = cycles_from(argc, argv);
  fsdp::comm::FlightRecorder fr(2000);
  // Two groups, as FSDP + HSDP have; the hot one registered first (the worst case of the search).
  const std::string world = "world", shard = "shard";
  const std::vector<int> world_ranks = {0, 1, 2, 3, 4, 5, 6, 7}, shard_ranks = {0, 1, 2, 3};
  fr.register_group(world, world_ranks, 0);
  fr.register_group(shard, shard_ranks, 0);
  flight_cycles(fr, world, world_ranks, 4000);  // warm-up: the ring has wrapped
  const uint64_t before = g_allocations.load();
  const auto t0 = std::chrono::steady_clock::now();
  flight_cycles(fr, world, world_ranks, n);
  const auto t1 = std::chrono::steady_clock::now();
  const uint64_t allocations = g_allocations.load() - before;
  const double ns = std::chrono::duration<double, std::nano>(t1 - t0).count() / n;
  std::printf(
      "flight recorder: %d collectives recorded (record + started + completed): %.1f ns each, %llu heap allocations\n",
      n, ns, static_cast<unsigned long long>(allocations));
  std::printf("ring: capacity %zu, %llu recorded, %zu kept, %zu bytes per record\n", fr.capacity(),
              static_cast<unsigned long long>(fr.recorded()), fr.snapshot().size(), sizeof(fsdp::comm::FlightRecord));
  return allocations == 0 ? 0 : 1;
}
