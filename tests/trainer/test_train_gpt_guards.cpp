// train_gpt refuses what would change or lose a user's work, before any work, in one line with
// the right fix: a resume never changes the model (the checkpoint records it: a Llama's
// config.json, a GPT's configuration), another optimizer's state names --optimizer, a token shard
// truncated under a running job is an error naming it (not SIGBUS), config.json's vocabulary
// and memory refusals under --init-from name fixes --init-from allows; and it warns where a user
// is probably wrong (--val-data that is the training data, shards of a larger vocabulary).
#include <gtest/gtest.h>

#include <thread>

#include "shard_writer.h"
#include "train_gpt_harness.h"

namespace {

using namespace train_gpt_test;
using fsdp_data_test::write_shard;

// A refusal before any work: exit 2, one "train_gpt: error:" line holding every piece of
// `needles`, nothing trained, nothing allocated (the memory line is printed just before the
// allocation), no checkpoint written.
void expect_refused(const ProcessResult& r, const std::vector<std::string>& needles, const std::string& ckpt_root) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(r.term_signal, 0) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: error: "), 1u) << r.output;
  for (const auto& n : needles) EXPECT_NE(r.output.find(n), std::string::npos) << n << "\n" << r.output;
  const auto at = r.output.find("train_gpt: error: ");
  if (at != std::string::npos) EXPECT_EQ(r.output.find('\n', at), r.output.size() - 1) << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
  EXPECT_EQ(r.output.find("train_gpt: memory:"), std::string::npos) << "allocated before refusing\n" << r.output;
  if (!ckpt_root.empty()) EXPECT_FALSE(fs::exists(ckpt_root + "/step_000004")) << r.output;
}

// A Llama checkpoint resumed with another --init-from (Mistral's folder), or as a GPT, and a GPT
// checkpoint resumed with other --heads (no shape shows it) or as a Llama: each refused, naming
// both models; the same options resume.
TEST(TrainGptGuards, ResumeNeverChangesTheModel) {
  TempDir tmp;
  const std::string llama = fixture("llama_untied_sharded"), ck = tmp.path + "/ck", gck = tmp.path + "/gck";
  auto a = alone(from_folder(llama, tmp / "a.jsonl", {"--checkpoint-dir", ck}));
  ASSERT_TRUE(a.ok()) << a.output;
  const std::vector<std::string> resume = {"--steps", "4", "--resume-from", ck + "/step_000002"};
  auto r = alone(from_folder(fixture("mistral"), tmp / "b.jsonl", resume));
  expect_refused(r,
                 {"checkpoint " + ck +
                      "/step_000002 holds another model than this run's: it holds Llama "
                      "(LlamaForCausalLM) 2 layers",
                  "this run builds Llama (MistralForCausalLM)", "from --init-from " + fixture("mistral"),
                  "(architecture LlamaForCausalLM there, MistralForCausalLM here)",
                  "a resume never changes the model: resume with the --model, --init-from or size options it was "
                  "trained with, or give another --checkpoint-dir"},
                 ck);
  r = alone(tiny(tmp / "c.jsonl", resume));
  expect_refused(r, {"it holds Llama (LlamaForCausalLM)", "this run builds GPT 2 layers, dim 32, 2 heads, vocab 256"},
                 ck);

  auto g = alone(tiny(tmp / "g.jsonl", {"--steps", "2", "--checkpoint-dir", gck}));
  ASSERT_TRUE(g.ok()) << g.output;
  const std::vector<std::string> gresume = {"--steps", "4", "--checkpoint-dir", gck, "--resume"};
  auto more = gresume;
  more.insert(more.end(), {"--heads", "4"});
  r = alone(tiny(tmp / "h.jsonl", more));
  expect_refused(r, {"it holds GPT 2 layers, dim 32, 2 heads", "(n_head 2 there, 4 here)"}, gck);
  more = gresume;
  more.insert(more.end(), {"--model", "llama"});
  r = alone(tiny(tmp / "i.jsonl", more));
  expect_refused(r, {"it holds GPT 2 layers", "this run builds Llama (LlamaForCausalLM)"}, gck);
  // The options it was trained with resume it, as before.
  r = alone(tiny(tmp / "j.jsonl", gresume));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_TRUE(fs::exists(gck + "/step_000004"));
}

// A checkpoint resumed with another --optimizer: the fix named is --optimizer (the library's
// message says LoadOptions, which a train_gpt user cannot set); exit 2.
TEST(TrainGptGuards, AnotherOptimizersStateNamesTheOptimizerOption) {
  TempDir tmp;
  const std::string ck = tmp.path + "/ck";
  ASSERT_TRUE(alone(tiny(tmp / "a.jsonl", {"--steps", "2", "--checkpoint-dir", ck})).ok());
  const auto r =
      alone(tiny(tmp / "b.jsonl", {"--steps", "4", "--checkpoint-dir", ck, "--resume", "--optimizer", "sgd"}));
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train_gpt: error: checkpoint " + ck +
                          "/step_000002 holds the state of another optimizer than --optimizer sgd: resume with "
                          "--optimizer adam or adamw (what it was trained with), or give another --checkpoint-dir"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("LoadOptions"), std::string::npos) << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
}

// A training shard truncated while train_gpt runs: the next read past its new end stops the run
// with one line naming the file (exit 2), where the mapped shard used to kill it with SIGBUS.
TEST(TrainGptGuards, ShardShrunkUnderARunningJobIsAnErrorNamingIt) {
  TempDir tmp;
  std::vector<uint32_t> tokens(200000);
  for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = static_cast<uint32_t>((t * 7 + t / 13) % 250);
  const std::string shard = tmp / "s_000000.bin";
  write_shard(shard, tokens, false, 256);
  write_shard(tmp / "s_val_000000.bin", {tokens.begin(), tokens.begin() + 2000}, false, 256);
  ProcessSpec spec = spec_of({kTrainGpt, "--parallel", "none"},
                             120s);  // steps enough to outlast the truncation by far
  const auto args = tiny(tmp / "m.jsonl", {"--data", "tokens:" + (tmp / "s_*.bin"), "--steps", "1000000"});
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  Child child(spec);
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (!trained(child.result().output) && std::chrono::steady_clock::now() < deadline) {
    ASSERT_FALSE(child.try_wait()) << "ended before the truncation\n" << child.result().output;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(trained(child.result().output)) << child.result().output;
  fs::resize_file(shard, 1024 + 2 * 100);  // the header and 100 tokens left
  const ProcessResult r = child.wait();
  EXPECT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.term_signal, 0) << "killed by a signal\n" << r.output;
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train_gpt: error: token shard '" + shard + "' changed under the running job: it had " +
                          std::to_string(1024 + 2 * tokens.size()) + " bytes at start and has 1224 bytes now"),
            std::string::npos)
      << r.output;
}

// --init-from: ids beyond config.json's vocabulary name the model's tokenizer, not --vocab-size
// (which --init-from refuses); a memory refusal driven by the model names config.json, not
// --layers/--dim.
TEST(TrainGptGuards, InitFromRefusalsNameFixesItAllows) {
  TempDir tmp;
  const std::string llama = fixture("llama_tied_bf16");
  write_shard(tmp / "t_000000.bin", std::vector<uint32_t>(600, 300), false, 0);
  write_shard(tmp / "t_val_000000.bin", std::vector<uint32_t>(200, 5), false, 0);
  auto r = alone(from_folder(llama, tmp / "a.jsonl", {"--data", "tokens:" + (tmp / "t_*.bin")}));
  expect_refused(r,
                 {"token shard '" + (tmp / "t_000000.bin") + "' holds token id 300, at or above " + llama +
                  "/config.json's vocab_size 256: tokenize the data with that model's tokenizer"},
                 "");
  EXPECT_EQ(r.output.find("--vocab-size"), std::string::npos) << r.output;
  ProcessSpec spec = spec_of({kTrainGpt, "--parallel", "none"}, 120s);
  const auto args = from_folder(llama, tmp / "b.jsonl", {"--batch-size", "1"});
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env_set["FSDP_TEST_MEMORY_AVAILABLE"] = "1K";
  r = run_process(spec);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("train_gpt: error: " + llama + "/config.json's model (2 layers, hidden"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("fine-tune a smaller model"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("--layers"), std::string::npos) << r.output;
}

// Allowed, but probably a mistake: --val-data naming the training shards, and shards that record
// a larger vocabulary than the model's. One warning each; the run trains.
TEST(TrainGptGuards, WarnsWhereAUserIsProbablyWrong) {
  TempDir tmp;
  std::vector<uint32_t> tokens(2000);
  for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = static_cast<uint32_t>((t * 5 + t / 7) % 200);
  write_shard(tmp / "w_000000.bin", tokens, false, 50257);
  const std::string data = "tokens:" + (tmp / "w_*.bin");
  auto r = alone(tiny(tmp / "a.jsonl", {"--data", data, "--val-data", data, "--vocab-size", "256", "--steps", "1"}));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: warning: --val-data " + data + " reads " + (tmp / "w_000000.bin") +
                                ", which is training data too"),
            1u)
      << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: warning: token shard '" + (tmp / "w_000000.bin") +
                                "' records a vocabulary of 50257, larger than the model's 256 (--vocab-size)"),
            1u)
      << r.output;
  EXPECT_TRUE(trained(r.output)) << r.output;
  // Held-out validation data and a matching vocabulary: no warning.
  write_shard(tmp / "v_000000.bin", tokens, false, 256);
  write_shard(tmp / "v_val_000000.bin", tokens, false, 256);
  r = alone(tiny(tmp / "b.jsonl", {"--data", "tokens:" + (tmp / "v_*.bin"), "--steps", "1"}));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_EQ(r.output.find("warning"), std::string::npos) << r.output;
}

}  // namespace
