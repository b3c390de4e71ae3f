// train_gpt --device: where no GPU is visible, --device cuda stops with one line
// before any work and --device auto trains on the CPU. (On a GPU machine the GPU paths are
// exercised by tests/gpu; the cases below that need the absence of a GPU skip there.)
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "train_gpt_harness.h"

using namespace train_gpt_test;
using namespace std::chrono_literals;

TEST(TrainGptDevice, CudaWithoutAGpuFailsWithOneLine) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible: tests/gpu covers --device cuda";
  auto r = alone(tiny("", {"--device", "cuda"}), 60s);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const std::string want = "train_gpt: error: --device cuda: no GPU is visible to this process";
  EXPECT_EQ(r.output.rfind(want, 0), 0u) << "expected: " << want << "\ngot: " << r.output;
  EXPECT_EQ(count(r.output, "\n"), 1u) << r.output;
}

TEST(TrainGptDevice, AutoTrainsOnTheCpuWithoutAGpu) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is visible: auto picks it";
  auto r = alone(tiny("", {"--device", "auto", "--steps", "2"}), 60s);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  auto bad = alone(tiny("", {"--device", "tpu"}), 60s);
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_NE(bad.output.find("--device: tpu not in {cpu,cuda,auto}"), std::string::npos) << bad.output;
}
