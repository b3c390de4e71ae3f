// torchrun's environment contract: parsing and the errors a user sees.
#include <gtest/gtest.h>

#include "fsdp/dist/env.h"

using fsdp::dist::DistError;
using fsdp::dist::parse_launch_env;

namespace {
std::string error_of(const std::map<std::string, std::string>& env) {
  try {
    parse_launch_env(env);
  } catch (const DistError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(LaunchEnv, NoVariablesIsAWorldOfOne) {
  auto e = parse_launch_env({});
  EXPECT_FALSE(e.from_launcher);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.store_prefix(), "");
}

TEST(LaunchEnv, TorchrunContract) {
  auto e = parse_launch_env({{"RANK", "3"},
                             {"WORLD_SIZE", "4"},
                             {"LOCAL_RANK", "1"},
                             {"LOCAL_WORLD_SIZE", "2"},
                             {"MASTER_ADDR", "10.0.0.1"},
                             {"MASTER_PORT", "1234"},
                             {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                             {"TORCHELASTIC_RESTART_COUNT", "2"}});
  EXPECT_TRUE(e.from_launcher);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 1234);
  EXPECT_TRUE(e.use_agent_store);
  EXPECT_EQ(e.store_prefix(), "/worker/attempt_2");
}

TEST(LaunchEnv, RankHostsStoreWithoutAgent) {
  auto e =
      parse_launch_env({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}});
  EXPECT_FALSE(e.use_agent_store);
  EXPECT_EQ(e.store_prefix(), "");
  EXPECT_EQ(e.local_rank, 0);  // defaults to the global layout on one node
  EXPECT_EQ(e.local_world_size, 2);
}

TEST(LaunchEnv, ErrorsNameTheProblemAndTheFix) {
  const std::map<std::string, std::string> ok = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto with = [&](const std::string& k, const std::string& v) {
    auto env = ok;
    env[k] = v;
    return env;
  };
  auto without = [&](const std::string& k) {
    auto env = ok;
    env.erase(k);
    return env;
  };
  EXPECT_NE(error_of(with("RANK", "2")).find("RANK=2 is not below WORLD_SIZE=2"), std::string::npos);
  EXPECT_NE(error_of(with("RANK", "x")).find("RANK='x' is not a non-negative integer"), std::string::npos);
  EXPECT_NE(error_of(with("WORLD_SIZE", "0")).find("WORLD_SIZE='0' is not a positive integer"), std::string::npos);
  EXPECT_NE(error_of(with("WORLD_SIZE", "2a")).find("WORLD_SIZE='2a'"), std::string::npos);
  EXPECT_NE(error_of(without("WORLD_SIZE")).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
  EXPECT_NE(error_of(without("RANK")).find("WORLD_SIZE is set but RANK is not"), std::string::npos);
  EXPECT_NE(error_of(without("RANK")).find("fsdprun"), std::string::npos);
  EXPECT_NE(error_of(without("MASTER_ADDR")).find("MASTER_ADDR is not set"), std::string::npos);
  EXPECT_NE(error_of(without("MASTER_PORT")).find("MASTER_PORT is not set"), std::string::npos);
  EXPECT_NE(error_of(with("MASTER_PORT", "70000")).find("not a TCP port"), std::string::npos);
  EXPECT_NE(error_of(with("MASTER_PORT", "0")).find("--master-port 0"), std::string::npos);
  auto local = ok;
  local["LOCAL_RANK"] = "2";
  local["LOCAL_WORLD_SIZE"] = "2";
  EXPECT_NE(error_of(local).find("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"), std::string::npos);
  EXPECT_EQ(error_of(ok), "");
}
