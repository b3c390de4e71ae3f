// Several hosts on one machine (network namespaces, netns_hosts.h): fsdprun on each host forms
// one job across them; FSDP and HSDP training give one process's losses; a checkpoint written from
// two hosts resumes on one. Skipped with the reason where namespaces cannot be made (not root).
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "multihost_harness.h"

namespace {

using namespace multihost_test;
namespace fs = std::filesystem;

const std::string kProbe = PROBE_PATH;

TEST(MultiHostHarness, HostsHaveOnlyTheTestNetwork) {
  SKIP_WITHOUT_NETNS();
  NetnsHosts hosts(2);
  // Host 0's only route is the test network: no default route, nothing towards the machine.
  auto routes = run_process(hosts.spec(0, {"/bin/sh", "-c", "ip -4 route show; ip -6 route show"}, 30s));
  ASSERT_TRUE(routes.ok()) << routes.output;
  EXPECT_NE(routes.output.find("10.77.0.0/24 dev mh0"), std::string::npos) << routes.output;
  EXPECT_EQ(routes.output.find("default"), std::string::npos) << routes.output;
  // An address outside the test network is unreachable from a host.
  auto out = run_process(hosts.spec(1, {"/bin/bash", "-c", "exec 3<>/dev/tcp/192.0.2.1/80"}, 30s));
  EXPECT_FALSE(out.ok()) << out.output;
  EXPECT_NE(out.output.find("unreachable"), std::string::npos) << out.output;
}

// Even a process that left the test's process group (setsid) does not outlive the hosts.
TEST(MultiHostHarness, RemovesEveryNamespaceAndProcess) {
  SKIP_WITHOUT_NETNS();
  std::string prefix;
  int pid = -1;
  {
    NetnsHosts hosts(2);
    prefix = hosts.prefix();
    // The shell reports the pid only once it leads its own session: before setsid() has run, the
    // child is still in the shell's process group, which run_process ends when the shell exits.
    auto r = run_process(
        hosts.spec(1,
                   {"/bin/sh", "-c",
                    "setsid /bin/sleep 300 </dev/null >/dev/null 2>&1 & p=$!; "
                    "while [ \"$(awk '{print $6}' /proc/$p/stat)\" != \"$p\" ]; do sleep 0.01; done; echo $p"},
                   30s));
    ASSERT_TRUE(r.ok()) << r.output;
    pid = std::stoi(r.output);
    ASSERT_TRUE(fsdp::testing::process_alive(pid));
    auto list = run_process(ProcessSpec{{"/bin/sh", "-c", "ip netns list"}, {}, {}, 10s});
    EXPECT_NE(list.output.find(prefix + "-h1"), std::string::npos) << list.output;
  }
  EXPECT_FALSE(fsdp::testing::process_alive(pid));
  auto list = run_process(ProcessSpec{{"/bin/sh", "-c", "ip netns list"}, {}, {}, 10s});
  EXPECT_EQ(list.output.find(prefix), std::string::npos) << list.output;
}

TEST(MultiHost, TwoHostsFormOneJobThroughNode0sStore) {
  SKIP_WITHOUT_NETNS();
  NetnsHosts hosts(2);
  auto rs = run_on_hosts(hosts, 2, {}, {kProbe, "store"}, 90s);
  ASSERT_TRUE(all_ok(rs)) << report(rs);
  for (int r = 0; r < 4; ++r) {
    const auto& out = rs[static_cast<size_t>(r / 2)].output;
    EXPECT_NE(out.find("[rank" + std::to_string(r) + "]: OK rank=" + std::to_string(r)), std::string::npos)
        << report(rs);
  }
  EXPECT_NE(rs[0].output.find("store=tcp"), std::string::npos) << report(rs);
}

// 2 hosts x 2 ranks: FSDP over all four ranks, and HSDP (--shard-size defaults to the ranks per
// node: shard within a host, replicate across the two hosts), each equal to one process (1e-5).
TEST(MultiHost, FsdpAndHsdpAcrossTwoHostsGiveTheSameLossesAsOneProcess) {
  SKIP_WITHOUT_NETNS();
  TempDir dir;
  auto a = alone(tiny(dir / "none.jsonl"));
  ASSERT_TRUE(a.ok()) << a.output;
  const auto reference = losses(dir / "none.jsonl");
  ASSERT_EQ(reference.size(), 6u);
  NetnsHosts hosts(2);
  for (const std::string mode : {"fsdp", "hsdp"}) {
    auto rs = run_on_hosts(hosts, 2, {}, [&] {
      std::vector<std::string> p = {kTrainGpt};
      auto args = tiny(dir / (mode + ".jsonl"), {"--parallel", mode});
      p.insert(p.end(), args.begin(), args.end());
      return p;
    }());
    ASSERT_TRUE(all_ok(rs)) << mode << "\n" << report(rs);
    EXPECT_NE(rs[0].output.find("--parallel " + mode), std::string::npos) << rs[0].output;
    expect_close(losses(dir / (mode + ".jsonl")), reference, 1e-5);
  }
}

TEST(MultiHost, CheckpointWrittenFromTwoHostsResumesOnOne) {
  SKIP_WITHOUT_NETNS();
  TempDir dir;
  NetnsHosts hosts(2);
  std::vector<std::string> program = {kTrainGpt};
  auto args = tiny(dir / "two.jsonl", {"--checkpoint-dir", dir / "ckpt", "--checkpoint-every", "2"});
  program.insert(program.end(), args.begin(), args.end());
  auto rs = run_on_hosts(hosts, 2, {}, program);
  ASSERT_TRUE(all_ok(rs)) << report(rs);
  const auto two = losses(dir / "two.jsonl");
  ASSERT_EQ(two.size(), 6u);
  fs::remove_all(fs::path(dir / "ckpt") / "step_000006");  // resume from step 4, written by 4 ranks on 2 hosts
  ASSERT_TRUE(fs::exists(fs::path(dir / "ckpt") / "step_000004" / "index.json"));
  auto one = alone(tiny(dir / "one.jsonl", {"--checkpoint-dir", dir / "ckpt", "--checkpoint-every", "2", "--resume"}));
  ASSERT_TRUE(one.ok()) << one.output;
  EXPECT_NE(one.output.find("step_000004 at step 4"), std::string::npos) << one.output;
  const auto resumed = losses(dir / "one.jsonl");
  ASSERT_EQ(resumed.size(), 2u);  // a new metrics file: steps 5 and 6
  expect_close(resumed, {two[4], two[5]}, 1e-5);
}

}  // namespace
