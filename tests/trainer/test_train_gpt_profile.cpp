// train_gpt --profile-steps A:B (tools/train_gpt/profile.h): under fsdprun at 2 ranks each rank
// writes DIR/trace_rank<r>.json next to the metrics file; it is a Chrome trace holding exactly
// steps A to B ("ProfilerStep#N"), and in each of them FSDP's phases for every block and the
// optimizer step. A bad range is refused in one line before any work.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "test_helpers.h"
#include "train_gpt_harness.h"

using namespace train_gpt_test;

namespace {
std::set<std::string> range_names(const std::string& path) {
  std::ifstream in(path);
  const nlohmann::json doc = nlohmann::json::parse(in);
  std::set<std::string> names;
  for (const auto& e : doc.at("traceEvents")) {
    if (e.at("ph") == "X" && e.at("dur").get<double>() > 0) names.insert(e.at("name").get<std::string>());
  }
  return names;
}
}  // namespace

TEST(TrainGptProfile, TwoRanksWriteATracePerRankWithFsdpsPhases) {
  TempDir dir;
  auto r = ranks(2, tiny(dir / "metrics.jsonl", {"--profile-steps", "3:4"}));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("trace of steps 3-4"), std::string::npos) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string path = dir / ("trace_rank" + std::to_string(rank) + ".json");
    ASSERT_TRUE(std::filesystem::exists(path)) << path << "\n" << r.output;
    const auto names = range_names(path);
    for (const char* want : {"ProfilerStep#3", "ProfilerStep#4", "fsdp::optimizer_step",
                             "fsdp::pre_forward_all_gather (h.0)", "fsdp::copy_out (h.1)",
                             "fsdp::post_backward_reduce_scatter (h.0)", "fsdp::post_backward_reduce_scatter (root)"}) {
      EXPECT_TRUE(names.count(want)) << "rank " << rank << ": no " << want;
    }
    EXPECT_FALSE(names.count("ProfilerStep#2")) << "step 2 is before --profile-steps 3:4";
    EXPECT_FALSE(names.count("ProfilerStep#5")) << "step 5 is after --profile-steps 3:4";
  }
}

TEST(TrainGptProfile, BadRangeIsRefusedInOneLine) {
  TempDir dir;
  auto r = alone(tiny(dir / "m.jsonl", {"--profile-steps", "4:2"}));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--profile-steps '4:2' is not A:B with 1 <= A <= B"), std::string::npos) << r.output;
  auto late = alone(tiny(dir / "m.jsonl", {"--profile-steps", "5:9"}));  // tiny runs 6 steps
  EXPECT_EQ(late.exit_code, 2) << late.output;
  EXPECT_NE(late.output.find("ends after the last step (--steps 6)"), std::string::npos) << late.output;
}
