// The distributed runtime with real processes: rank-0-hosted and launcher-hosted stores, a world of
// one, and the errors for an unreachable store, a port in use and a missing rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "fsdp/fsdp.h"
#include "multiprocess.h"

using fsdp::testing::ProcessSpec;
using fsdp::testing::RanksOptions;

FSDP_RANK_WORKER(world_all_reduce) {
  auto world = fsdp::dist::world_comm();
  TORCH_CHECK(world->size() == fsdp::dist::world_size());
  TORCH_CHECK(world->rank() == fsdp::dist::rank());
  auto t = at::full({4}, fsdp::dist::rank() + 1, at::kFloat);
  world->all_reduce(t);
  const int n = world->size();
  TORCH_CHECK(t.eq(n * (n + 1) / 2).all().item<bool>(), "sum of ranks+1: ", t);
  // Leave a mark in the store so the test can see where keys went (the agent-store prefix).
  fsdp::dist::store()->set("hello_" + std::to_string(fsdp::dist::rank()), std::vector<uint8_t>{1});
  world->barrier();
}

// new_group over all ranks is the world group; new_cpu_group forms a separate Gloo group that
// works while the world group is also in use.
FSDP_RANK_WORKER(cpu_group_is_its_own) {
  auto world = fsdp::dist::world_comm();
  std::vector<int> all(world->size());
  for (int r = 0; r < world->size(); ++r) all[r] = r;
  TORCH_CHECK(fsdp::dist::new_group(all, "same") == world, "new_group over all ranks should be the world");
  auto own = fsdp::dist::new_cpu_group(all, "own");
  TORCH_CHECK(own != world && own->size() == world->size() && own->rank() == world->rank());
  auto a = at::full({3}, 1.0f), b = at::full({3}, 2.0f);
  auto on_world = world->all_reduce(a, fsdp::comm::ReduceOp::Sum, /*async_op=*/true);
  own->all_reduce(b);
  on_world.wait();
  TORCH_CHECK(a.eq(world->size()).all().item<bool>() && b.eq(2 * world->size()).all().item<bool>(), a, b);
}

// Calls init_distributed itself and expects it to fail with a message containing EXPECT_ERROR.
FSDP_RANK_WORKER(expect_init_error) {
  const std::string needle = std::getenv("EXPECT_ERROR");
  try {
    fsdp::dist::init_distributed();
  } catch (const fsdp::dist::DistError& e) {
    std::cout << "init_distributed failed as expected: " << e.what() << std::endl;
    TORCH_CHECK(std::string(e.what()).find(needle) != std::string::npos, "message lacks '", needle, "'");
    return;
  }
  TORCH_CHECK(false, "init_distributed succeeded; expected an error containing '", needle, "'");
}

namespace {
// A store server in the test process, as a launcher agent hosts one.
c10::intrusive_ptr<c10d::TCPStore> host_store(int port) {
  c10d::TCPStoreOptions opts = fsdp::compat::tcp_store_options();  // 2.x: libuv off unless USE_LIBUV=1
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = true;
  opts.waitWorkers = false;
  opts.timeout = std::chrono::seconds(30);
  return c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
}
}  // namespace

TEST(Runtime, RankZeroHostsTheStore) {
  EXPECT_RANKS_PASS(2, "world_all_reduce");
  EXPECT_RANKS_PASS(3, "world_all_reduce");
}

TEST(Runtime, CpuGroupHasItsOwnConnections) { EXPECT_RANKS_PASS(2, "cpu_group_is_its_own"); }

TEST(Runtime, AgentStoreWithAttemptPrefix) {
  // Like torchrun's agent: the launcher hosts the store and every rank is a client.
  const int port = fsdp::testing::pick_free_port();
  auto agent_store = host_store(port);
  RanksOptions ranks;
  ranks.env = {{"MASTER_PORT", std::to_string(port)},
               {"TORCHELASTIC_USE_AGENT_STORE", "True"},
               {"TORCHELASTIC_RESTART_COUNT", "1"}};
  EXPECT_RANKS_PASS(2, "world_all_reduce", ranks);
  EXPECT_TRUE(agent_store->check({"/worker/attempt_1/hello_0", "/worker/attempt_1/hello_1"}));
  EXPECT_FALSE(agent_store->check({"hello_0"}));
}

TEST(Runtime, WorldOfOneWithoutEnvironment) {
  ASSERT_EQ(std::getenv("RANK"), nullptr) << "run the test suite without a launcher";
  fsdp::dist::init_distributed();
  EXPECT_EQ(fsdp::dist::world_size(), 1);
  EXPECT_EQ(fsdp::dist::rank(), 0);
  EXPECT_FALSE(fsdp::dist::launch_env().from_launcher);
  auto t = at::ones({3});
  fsdp::dist::world_comm()->all_reduce(t, fsdp::comm::ReduceOp::Avg);
  EXPECT_TRUE(t.equal(at::ones({3})));
  ASSERT_TRUE(fsdp::dist::store());
  try {
    fsdp::dist::init_distributed();
    ADD_FAILURE() << "a second init_distributed must fail";
  } catch (const fsdp::dist::DistError& e) {
    EXPECT_NE(std::string(e.what()).find("already called"), std::string::npos) << e.what();
  }
  fsdp::dist::destroy_distributed();
  EXPECT_FALSE(fsdp::dist::is_initialized());
  EXPECT_THROW(fsdp::dist::world_comm(), fsdp::dist::DistError);
}

namespace {
fsdp::testing::ProcessResult run_one_rank(int rank, int world, int port, const std::string& expect_error,
                                          std::map<std::string, std::string> extra = {}) {
  ProcessSpec spec;
  spec.argv = {fsdp::testing::self_exe()};
  spec.timeout = std::chrono::seconds(60);
  spec.env_set = {
      {"FSDP_TEST_WORKER", "expect_init_error"}, {"FSDP_TEST_INIT", "0"},       {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(world)},     {"MASTER_ADDR", "127.0.0.1"},  {"MASTER_PORT", std::to_string(port)},
      {"FSDP_COLLECTIVE_TIMEOUT_S", "2"},        {"EXPECT_ERROR", expect_error}};
  for (auto& [k, v] : extra) spec.env_set[k] = v;
  spec.env_unset = {"TORCHELASTIC_USE_AGENT_STORE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  return fsdp::testing::run_process(spec);
}
}  // namespace

TEST(Runtime, UnreachableStoreFailsWithinTheTimeout) {
  auto start = std::chrono::steady_clock::now();
  auto r = run_one_rank(1, 2, fsdp::testing::pick_free_port(), "could not reach the store");
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 30.0);
  EXPECT_NE(r.output.find("MASTER_ADDR/MASTER_PORT"), std::string::npos) << r.output;
}

TEST(Runtime, PortInUseIsNamed) {
  const int port = fsdp::testing::pick_free_port();
  auto squatter = host_store(port);
  auto r = run_one_rank(0, 2, port, "is in use");
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("--master-port 0"), std::string::npos) << r.output;
}

TEST(Runtime, MissingRankFailsGroupFormation) {
  auto r = run_one_rank(0, 2, fsdp::testing::pick_free_port(), "could not form the world group of 2 ranks");
  EXPECT_TRUE(r.ok()) << r.output;
}

TEST(Runtime, BadGlooThreadsIsNamedBeforeTheStore) {
  // Port 9 (discard): nothing listens, so only a check made before the store can report the value.
  auto r = run_one_rank(1, 2, 9, "FSDP_GLOO_THREADS='0' is not a number of Gloo worker threads",
                        {{"FSDP_GLOO_THREADS", "0"}});
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("use 1 to 64"), std::string::npos) << r.output;
}

TEST(Runtime, BadEnvironmentIsReportedByInit) {
  auto r = run_one_rank(0, 2, 29500, "RANK=5 is not below WORLD_SIZE=2", {{"RANK", "5"}});
  EXPECT_TRUE(r.ok()) << r.output;
}
