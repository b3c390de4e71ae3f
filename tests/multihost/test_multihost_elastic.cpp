// Elastic membership: --nnodes MIN:MAX as torchrun. Three hosts train; one is lost and
// does not come back; the survivors re-rendezvous as a world of two (after --rdzv-last-call-s)
// and `train_gpt --resume` continues from the last checkpoint at the new size.
#include <chrono>
#include <filesystem>
#include <functional>
#include <thread>

#include "multihost_harness.h"

namespace {

using namespace multihost_test;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

TEST(MultiHostElastic, ThreeHostsLoseOneAndContinueAsTwoFromTheLastCheckpoint) {
  SKIP_WITHOUT_NETNS();
  TempDir dir;
  // A batch that 3 and 2 ranks both divide; one rank per host.
  auto tiny_args = [&](const std::string& metrics, std::vector<std::string> extra) {
    extra.insert(extra.end(), {"--batch-size", "12", "--steps", "12"});
    return tiny(metrics, extra);
  };
  auto ref = alone(tiny_args(dir / "one.jsonl", {}));
  ASSERT_TRUE(ref.ok()) << ref.output;
  const auto reference = losses(dir / "one.jsonl");
  ASSERT_EQ(reference.size(), 12u);

  NetnsHosts hosts(3);
  const std::vector<std::string> launcher = {
      "--nnodes",         "2:3", "--max-restarts",     "1", "--heartbeat-timeout-s", "3",
      "--grace-period-s", "2",   "--rdzv-last-call-s", "2"};
  std::vector<std::string> program = {kTrainGpt};
  auto args = tiny_args(dir / "m.jsonl", {"--checkpoint-dir", dir / "ckpt", "--checkpoint-every", "4", "--resume"});
  program.insert(program.end(), args.begin(), args.end());
  std::vector<std::unique_ptr<Child>> nodes;
  for (int k = 0; k < 3; ++k) {
    auto spec = node_spec(hosts, k, 1, launcher, program, 300s);
    // node_argv's --nnodes 3 comes first; the elastic --nnodes 2:3 later on the line wins.
    nodes.push_back(std::make_unique<Child>(spec));
  }
  const auto step4 = fs::path(dir / "ckpt") / "step_000004" / "index.json";
  ASSERT_TRUE(wait_until(
      {nodes[0].get(), nodes[1].get(), nodes[2].get()}, [&] { return fs::exists(step4); }, 200s))
      << nodes[0]->result().output;
  ASSERT_FALSE(fs::exists(fs::path(dir / "ckpt") / "step_000012" / "index.json"))
      << "finished before the host was lost";
  hosts.kill_host(2);
  auto r0 = nodes[0]->wait();
  auto r1 = nodes[1]->wait();
  auto r2 = nodes[2]->wait();
  ASSERT_TRUE(r0.ok() && r1.ok()) << report({r0, r1, r2});
  EXPECT_EQ(r2.term_signal, SIGKILL) << r2.output;
  EXPECT_NE(r0.output.find("restarting all workers (restart 1 of 1)"), std::string::npos) << r0.output;
  EXPECT_NE(r0.output.find("attempt 1 runs on 2 of 3 nodes (0, 1): WORLD_SIZE 2"), std::string::npos) << r0.output;
  EXPECT_NE(r0.output.find("resumed " + (dir / "ckpt") + "/step_0000"), std::string::npos) << r0.output;
  EXPECT_NE(r0.output.find("--parallel fsdp, 3 ranks x"), std::string::npos) << r0.output;
  EXPECT_NE(r0.output.find("--parallel fsdp, 2 ranks x"), std::string::npos) << r0.output;
  EXPECT_TRUE(fs::exists(fs::path(dir / "ckpt") / "step_000012" / "index.json"));
  // Same data at any world size: 3 ranks, then 2 from the checkpoint, give one process's losses.
  expect_close(losses(dir / "m.jsonl"), reference, 1e-5);
}

}  // namespace
