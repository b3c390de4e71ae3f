#pragma once
// This process's thread ids (Linux: /proc/self/task), sorted: the threads Gloo starts while a group
// is made (comm/backend.cpp) and those FSDP_CPU_BIND binds (dist/cpu_binding.cpp).
#include <dirent.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

namespace fsdp::comm::detail {

inline std::vector<long> process_thread_ids() {
  std::vector<long> out;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') out.push_back(std::strtol(e->d_name, nullptr, 10));
    }
    closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace fsdp::comm::detail
