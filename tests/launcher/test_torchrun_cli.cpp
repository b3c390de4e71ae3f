// fsdprun takes torchrun's command line as it is: underscore spellings, --no_python, and the
// multi-node c10d form (--nnodes N --rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id ID, the
// identical command on every node, no --node_rank). The parser is tested directly; the c10d form
// also end to end (launcher_probe workers): two agents on this machine, and two hosts made of
// network namespaces (tests/multihost/netns_hosts.h), where only the endpoint's host may host.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "netns_hosts.h"
#include "options.h"
#include "subprocess.h"

namespace {

using namespace std::chrono_literals;
using fsdp::testing::Child;
using fsdp::testing::pick_free_port;
using fsdp::testing::ProcessSpec;
using fsdprun::kAutoNodeRank;
using fsdprun::Options;
using fsdprun::parse_options;
using fsdprun::UsageError;

std::string usage_error(const std::vector<std::string>& args) {
  try {
    parse_options(args);
  } catch (const UsageError& e) {
    return e.what();
  }
  return "";
}

TEST(TorchrunCommandLine, UnderscoreSpellingsAndNoPython) {
  const Options o = parse_options({"--nproc_per_node", "2", "--no_python", "--max_restarts=1", "--rdzv_id", "job7",
                                   "--start_method", "spawn", "--log_dir", "logs", "prog", "--x", "1"});
  EXPECT_EQ(o.nproc_per_node, 2);
  EXPECT_TRUE(o.no_python);
  EXPECT_EQ(o.max_restarts, 1);
  EXPECT_EQ(o.run_id, "job7");
  EXPECT_EQ(o.log_dir, "logs");
  EXPECT_EQ(o.program, (std::vector<std::string>{"prog", "--x", "1"}));
  EXPECT_EQ(o.store, "file");  // one node: nothing on the network
}

TEST(TorchrunCommandLine, MultiNodeC10dFormNeedsNoNodeRank) {
  const Options o = parse_options({"--nnodes", "2", "--nproc_per_node", "4", "--rdzv_backend", "c10d",
                                   "--rdzv_endpoint", "node01:29400", "--rdzv_id", "42", "--no_python", "train"});
  EXPECT_EQ(o.nnodes, 2);
  EXPECT_EQ(o.rdzv_backend, "c10d");
  EXPECT_EQ(o.node_rank, kAutoNodeRank);  // numbered as the nodes join
  EXPECT_EQ(o.master_addr, "node01");
  EXPECT_EQ(o.master_port, 29400);
  EXPECT_EQ(o.store, "tcp");
  EXPECT_EQ(o.run_id, "42");
  // torchrun's default port for a c10d endpoint; IPv6 in brackets; an explicit node rank still wins.
  EXPECT_EQ(parse_options({"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=head", "p"}).master_port, 29400);
  const Options v6 = parse_options({"--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=[fd00::2]:1234", "p"});
  EXPECT_EQ(v6.master_addr, "fd00::2");
  EXPECT_EQ(v6.master_port, 1234);
  EXPECT_EQ(parse_options({"--nnodes=2", "--node_rank=1", "--rdzv_backend=c10d", "--rdzv_endpoint=h:5", "p"}).node_rank,
            1);
  // Elastic MIN:MAX and the rendezvous configuration.
  const Options e = parse_options({"--nnodes", "1:3", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:5", "--rdzv_conf",
                                   "join_timeout=600,last_call_timeout=5,read_timeout=60", "p"});
  EXPECT_EQ(e.min_nodes, 1);
  EXPECT_EQ(e.nnodes, 3);
  EXPECT_EQ(e.rdzv_timeout_s, 600);
  EXPECT_EQ(e.rdzv_last_call_s, 5);
  EXPECT_EQ(
      parse_options({"--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:5", "--rdzv_conf=is_host=false", "p"})
          .is_host,
      0);
  // The static backend reads the endpoint as node 0's address too (torchrun does).
  const Options s = parse_options({"--nnodes=2", "--node_rank=1", "--rdzv_endpoint=h:7", "p"});
  EXPECT_EQ(s.master_addr, "h");
  EXPECT_EQ(s.master_port, 7);
  EXPECT_EQ(s.node_rank, 1);
}

TEST(TorchrunCommandLine, WhatCannotBeHonouredIsRefusedInOneLine) {
  const std::map<std::vector<std::string>, std::string> cases = {
      {{"--rdzv_backend", "etcd", "p"}, "--rdzv-backend etcd is not supported; use c10d"},
      {{"--nnodes", "2", "--rdzv_backend", "c10d", "p"}, "needs --rdzv-endpoint HOST:PORT"},
      {{"--rdzv_endpoint", "h:5", "--master_port", "6", "p"}, "both name node 0's store"},
      {{"--rdzv_endpoint", "h:x", "p"}, "--rdzv-endpoint 'x' is not valid"},
      {{"--rdzv_endpoint", "fd00::2:5", "p"}, "write an IPv6 address in brackets"},
      {{"--rdzv_endpoint", ":5", "p"}, "names no host"},
      {{"--rdzv_conf", "keep_alive_interval=5", "p"}, "--rdzv-conf key 'keep_alive_interval' is not supported"},
      {{"--rdzv_conf", "join_timeout", "p"}, "is not KEY=VALUE"},
      {{"--rdzv_conf", "is_host=true", "p"}, "is_host applies to --rdzv-backend c10d"},
      {{"--local_addr", "10.0.0.1", "p"}, "--local-addr is not supported"},
      {{"--start_method", "thread", "p"}, "--start-method 'thread' is not valid"},
      {{"-m", "train"}, "drop -m"},
  };
  for (const auto& [args, expected] : cases) {
    const std::string e = usage_error(args);
    EXPECT_NE(e.find(expected), std::string::npos) << args[0] << " " << args[1] << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

// "[rank<R>]: text" lines of a run, grouped by rank.
std::map<int, std::vector<std::string>> by_rank(const std::string& output) {
  std::map<int, std::vector<std::string>> out;
  std::istringstream in(output);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("[rank", 0) != 0) continue;
    const auto close = line.find("]: ");
    if (close != std::string::npos) out[std::stoi(line.substr(5, close - 5))].push_back(line.substr(close + 3));
  }
  return out;
}

// The identical torchrun-style command started twice on one machine forms one job of two nodes:
// one agent hosts the store at the endpoint (node 0), the other joins it as node 1.
TEST(TorchrunCommandLine, IdenticalC10dCommandsFormOneJob) {
  const std::string port = std::to_string(pick_free_port());
  ProcessSpec spec;
  spec.argv = {FSDPRUN_PATH,
               "--nnodes",
               "2",
               "--nproc_per_node",
               "2",
               "--rdzv_backend",
               "c10d",
               "--rdzv_endpoint",
               "127.0.0.1:" + port,
               "--rdzv_id",
               "c10d-test",
               "--rdzv_conf",
               "join_timeout=60",
               "--no_python",
               PROBE_PATH,
               "store"};
  spec.env_unset = {"RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                    "OMP_NUM_THREADS",
                    "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_USE_AGENT_STORE"};
  spec.timeout = 90s;
  Child a(spec);
  Child b(spec);
  const auto ra = a.wait();
  const auto rb = b.wait();
  ASSERT_TRUE(ra.ok()) << ra.output;
  ASSERT_TRUE(rb.ok()) << rb.output;
  const std::string both = ra.output + rb.output;
  EXPECT_NE(both.find("hosting the c10d rendezvous store at 127.0.0.1:" + port + " as node 0"), std::string::npos)
      << both;
  EXPECT_NE(both.find("joined the c10d rendezvous at 127.0.0.1:" + port + " as node 1"), std::string::npos) << both;
  std::set<int> ranks;
  for (const auto* r : {&ra, &rb}) {
    for (const auto& [rank, lines] : by_rank(r->output)) {
      ranks.insert(rank);
      ASSERT_FALSE(lines.empty());
      EXPECT_EQ(lines.back().rfind("OK rank=" + std::to_string(rank) + " world=4 port=" + port, 0), 0u) << r->output;
    }
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2, 3}));
}

// Two hosts (network namespaces), the identical command on each: the host that owns the endpoint's
// address hosts the store, the other, started first, only connects and becomes node 1.
TEST(TorchrunCommandLine, IdenticalC10dCommandsOnTwoHosts) {
  if (auto why = fsdp::testing::NetnsHosts::unavailable(); !why.empty()) GTEST_SKIP() << why;
  fsdp::testing::NetnsHosts hosts(2);
  const std::vector<std::string> argv = {FSDPRUN_PATH,
                                         "--nnodes",
                                         "2",
                                         "--nproc_per_node",
                                         "2",
                                         "--rdzv_backend",
                                         "c10d",
                                         "--rdzv_endpoint",
                                         hosts.addr(0) + ":29400",
                                         "--rdzv_id",
                                         "c10d-hosts",
                                         "--rdzv_conf",
                                         "join_timeout=60",
                                         "--no_python",
                                         PROBE_PATH,
                                         "store"};
  auto spec = [&](int k) {
    auto s = hosts.spec(k, argv, 90s);
    s.env_unset = {"RANK",
                   "WORLD_SIZE",
                   "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE",
                   "MASTER_ADDR",
                   "MASTER_PORT",
                   "OMP_NUM_THREADS",
                   "TORCHELASTIC_RESTART_COUNT",
                   "TORCHELASTIC_USE_AGENT_STORE"};
    return s;
  };
  Child second(spec(1));  // first: it must wait for the store, not host one of its own
  std::this_thread::sleep_for(1s);
  Child first(spec(0));
  const auto r1 = second.wait();
  const auto r0 = first.wait();
  ASSERT_TRUE(r0.ok()) << r0.output;
  ASSERT_TRUE(r1.ok()) << r1.output;
  EXPECT_NE(r0.output.find("hosting the c10d rendezvous store at " + hosts.addr(0) + ":29400 as node 0"),
            std::string::npos)
      << r0.output;
  EXPECT_NE(r1.output.find("joined the c10d rendezvous at " + hosts.addr(0) + ":29400 as node 1"), std::string::npos)
      << r1.output;
  EXPECT_EQ(by_rank(r0.output).begin()->first, 0);  // node 0 runs ranks 0-1, node 1 ranks 2-3
  EXPECT_EQ(by_rank(r1.output).begin()->first, 2);
  for (const auto* r : {&r0, &r1}) {
    for (const auto& [rank, lines] : by_rank(r->output)) {
      ASSERT_FALSE(lines.empty());
      EXPECT_EQ(lines.back().rfind("OK rank=" + std::to_string(rank) + " world=4 port=29400", 0), 0u) << r->output;
    }
  }
}

}  // namespace
