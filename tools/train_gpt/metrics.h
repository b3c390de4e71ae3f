#pragma once
// The metrics file (JSON lines, rank 0 only) and the process measurements it reports.
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace train_gpt {

// Peak resident set of this process (getrusage), and the current one (/proc/self/statm).
int64_t peak_rss_bytes();
int64_t current_rss_bytes();
// Minor page faults of this process so far (getrusage ru_minflt): pages the kernel mapped in,
// mostly fresh anonymous memory that an allocation touched for the first time.
int64_t minor_page_faults();

class MetricsWriter {
 public:
  MetricsWriter() = default;
  // Opens `path` (creating its folder). A fresh run truncates it; a resumed run keeps the lines
  // of steps up to `resumed_step` (a restart may have logged steps past its last checkpoint) and
  // drops the old summary line.
  void open(const std::string& path, bool resume, int64_t resumed_step);
  bool is_open() const { return out_.is_open(); }
  // One line per optimizer step; step_time_s is remembered for the summary. Adds "minor_faults":
  // this process's minor page faults since the previous step's line (the first step: since
  // open(), just before the training loop), so each step's count covers one whole iteration of
  // the loop (its metrics gathering and checkpoint saving too). One getrusage call a step.
  void step(nlohmann::json line);
  // {"summary": true, "median_step_time_s": median over the steps after the first,
  //  "median_minor_faults_per_step": likewise, ...}
  void summary(nlohmann::json extra);
  // Any other line (e.g. --eval-only's validation), as it is.
  void write_line(const nlohmann::json& line) { write(line); }

 private:
  void write(const nlohmann::json& line);
  std::ofstream out_;
  std::vector<double> step_times_;
  std::vector<double> step_faults_;
  int64_t faults_mark_ = minor_page_faults();  // at the previous step's line (or open())
};

double median(std::vector<double> v);

}  // namespace train_gpt
