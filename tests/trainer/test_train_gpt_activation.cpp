// train_gpt --activation-checkpointing: same losses as without it (one process, FSDP, replicate),
// and a bad value is one line with exit status 2.
#include "train_gpt_harness.h"

using namespace train_gpt_test;

TEST(TrainGptActivation, CheckpointingKeepsTheLosses) {
  TempDir dir;
  auto a = alone(tiny(dir / "none.jsonl", {"--layers", "4"}));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto reference = losses(dir / "none.jsonl");
  ASSERT_EQ(reference.size(), 6u);
  auto b = alone(tiny(dir / "full.jsonl", {"--layers", "4", "--activation-checkpointing", "full"}));
  ASSERT_TRUE(b.ok()) << b.output;
  expect_close(losses(dir / "full.jsonl"), reference, 1e-6);
  auto c = ranks(2, tiny(dir / "fsdp_every2.jsonl", {"--layers", "4", "--activation-checkpointing", "every:2"}));
  ASSERT_TRUE(c.ok()) << c.output;
  expect_close(losses(dir / "fsdp_every2.jsonl"), reference, 1e-5);  // FSDP vs one process: 1e-5 as elsewhere
  auto d = ranks(2, tiny(dir / "ddp_full.jsonl",
                         {"--layers", "4", "--parallel", "replicate", "--activation-checkpointing", "full"}));
  ASSERT_TRUE(d.ok()) << d.output;
  expect_close(losses(dir / "ddp_full.jsonl"), reference, 1e-5);
}

TEST(TrainGptActivation, BadValueIsOneLine) {
  TempDir dir;
  auto r = alone(tiny(dir / "m.jsonl", {"--activation-checkpointing", "every:0"}));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: --activation-checkpointing 'every:0'"), 1u) << r.output;
  EXPECT_NE(r.output.find("--activation-checkpointing"), std::string::npos);
}
