#include "metrics.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <sstream>

namespace train_gpt {

int64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;  // Linux: kilobytes
}

int64_t current_rss_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

int64_t minor_page_faults() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_minflt);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

void MetricsWriter::open(const std::string& path, bool resume, int64_t resumed_step) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  std::vector<std::string> kept;
  if (resume) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || j.value("summary", false)) continue;
      if (j.value("step", int64_t{0}) > resumed_step) continue;
      if (j.contains("step_time_s") && j.value("step", int64_t{0}) > 0)
        step_times_.push_back(j["step_time_s"].get<double>());
      if (j.contains("minor_faults") && j.value("step", int64_t{0}) > 0)
        step_faults_.push_back(j["minor_faults"].get<double>());
      kept.push_back(line);
    }
  }
  out_.open(path, std::ios::trunc);
  if (!out_) throw std::runtime_error("cannot write the metrics file '" + path + "'");
  for (const auto& l : kept) out_ << l << '\n';
  out_.flush();
  faults_mark_ = minor_page_faults();
}

void MetricsWriter::write(const nlohmann::json& line) {
  if (!out_.is_open()) return;
  out_ << line.dump() << '\n';
  out_.flush();
}

void MetricsWriter::step(nlohmann::json line) {
  const int64_t now = minor_page_faults(), faults = now - faults_mark_;
  faults_mark_ = now;
  line["minor_faults"] = faults;
  step_times_.push_back(line.at("step_time_s").get<double>());
  step_faults_.push_back(static_cast<double>(faults));
  write(line);
}

void MetricsWriter::summary(nlohmann::json extra) {
  // The first step warms up (the optimizer's state, the allocator's free lists): the steady figures leave it out.
  const auto after_first = [](const std::vector<double>& v) {
    return std::vector<double>(v.size() > 1 ? v.begin() + 1 : v.end(), v.end());
  };
  const double step_time = median(after_first(step_times_));
  extra["summary"] = true;
  extra["median_step_time_s"] = step_time;
  extra["median_minor_faults_per_step"] = median(after_first(step_faults_));
  if (extra.contains("tokens_per_step") && step_time > 0) {
    extra["median_tokens_per_s"] = extra["tokens_per_step"].get<double>() / step_time;
  }
  write(extra);
}

}  // namespace train_gpt
