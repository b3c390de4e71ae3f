#include "profile.h"

#include <CLI/CLI.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <stdexcept>

namespace train_gpt {

namespace {
bool parse_count(const std::string& s, int64_t& out) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 12) return false;
  errno = 0;
  out = std::strtoll(s.c_str(), nullptr, 10);
  return errno == 0;
}
}  // namespace

ProfileSteps parse_profile_steps(const std::string& text) {
  ProfileSteps p;
  if (text.empty()) return p;
  const auto colon = text.find(':');
  const std::string a = text.substr(0, colon), b = colon == std::string::npos ? a : text.substr(colon + 1);
  if (!parse_count(a, p.first) || !parse_count(b, p.last) || p.first < 1 || p.last < p.first) {
    throw std::invalid_argument("--profile-steps '" + text +
                                "' is not A:B with 1 <= A <= B (steps numbered from 1, e.g. --profile-steps 3:4)");
  }
  return p;
}

void check_profile_steps(const std::string& text, int64_t steps) {
  const ProfileSteps p = parse_profile_steps(text);
  if (p.on() && p.last > steps) {
    throw std::invalid_argument("--profile-steps " + text + " ends after the last step (--steps " +
                                std::to_string(steps) + "); choose steps up to " + std::to_string(steps));
  }
}

void add_profile_options(CLI::App& app, std::string& steps, std::string& dir) {
  app.add_option("--profile-steps", steps,
                 "Record steps A to B (A:B, from 1) into a Chrome trace per rank, DIR/trace_rank<r>.json, with "
                 "FSDP's phases as named ranges (Perfetto, chrome://tracing)");
  app.add_option("--profile-dir", dir, "Folder of the --profile-steps traces (default: the metrics file's folder)");
}

std::string profile_dir(const std::string& dir_option, const std::string& metrics) {
  if (!dir_option.empty()) return dir_option;
  const std::filesystem::path parent = std::filesystem::path(metrics).parent_path();
  return metrics.empty() || parent.empty() ? std::string(".") : parent.string();
}

StepProfiler::StepProfiler(const std::string& steps, std::string dir, int rank, bool announce)
    : steps_(parse_profile_steps(steps)), dir_(std::move(dir)), rank_(rank), announce_(announce) {}

StepProfiler::~StepProfiler() {
  if (session_ && session_->recording()) finish(0);
}

StepProfiler::Step StepProfiler::step(int64_t number) {
  if (!steps_.on() || number < steps_.first || number > steps_.last) return Step(nullptr, number);
  if (!session_) {
    session_ = std::make_unique<fsdp::profiler::TraceSession>(fsdp::profiler::rank_trace_path(dir_, rank_));
    session_->start();
    first_recorded_ = number;
  }
  return Step(this, number);
}

void StepProfiler::finish(int64_t last_recorded) noexcept {
  try {
    const size_t events = session_->stop();
    if (announce_) {
      const std::string steps = last_recorded == 0
                                    ? std::to_string(first_recorded_) + " on (stopped early)"
                                    : std::to_string(first_recorded_) + "-" + std::to_string(last_recorded);
      std::printf("train_gpt: trace of steps %s -> %s (one per rank; %s, %zu events on rank 0)\n", steps.c_str(),
                  fsdp::profiler::rank_trace_path(dir_, rank_).c_str(),
                  fsdp::profiler::backend_name(session_->backend()), events);
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_gpt: warning: rank %d could not write its trace: %s\n", rank_, e.what());
  }
}

StepProfiler::Step::Step(StepProfiler* owner, int64_t number) : owner_(owner), number_(number) {
  if (owner_) range_ = std::make_unique<fsdp::profiler::Range>("ProfilerStep#" + std::to_string(number));
}

StepProfiler::Step::~Step() {
  range_.reset();
  if (owner_ && number_ == owner_->steps_.last && owner_->session_->recording()) owner_->finish(number_);
}

}  // namespace train_gpt
