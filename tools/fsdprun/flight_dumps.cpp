#include "flight_dumps.h"

#include <algorithm>
#include <filesystem>
#include <regex>
#include <vector>

namespace fsdprun {

std::string flight_recorder_dir_for_workers(const std::string& dir) {
  std::error_code ec;
  auto abs = std::filesystem::absolute(dir, ec);
  return ec ? dir : abs.lexically_normal().string();
}

std::string flight_recorder_note(const std::string& dir) {
  static const std::regex dump_name("rank_[0-9]+\\.jsonl");
  std::vector<std::string> files;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (std::regex_match(name, dump_name)) files.push_back(name);
  }
  if (files.empty()) return "flight recorder: no dump in " + dir + " (no collective failed or timed out on this node)";
  std::sort(files.begin(), files.end());
  std::string list;
  for (size_t i = 0; i < files.size() && i < 8; ++i) list += (i ? ", " : "") + files[i];
  if (files.size() > 8) list += ", ...";
  return "flight recorder: " + std::to_string(files.size()) + (files.size() == 1 ? " dump" : " dumps") + " in " + dir +
         " (" + list + "); line the ranks up with: fsdp-fr " + dir;
}

}  // namespace fsdprun
