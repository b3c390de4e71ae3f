#include "fsdp/dist/env.h"

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <vector>

extern char** environ;

namespace fsdp::dist {

std::string LaunchEnv::store_prefix() const {
  return use_agent_store ? "/worker/attempt_" + std::to_string(restart_count) : std::string();
}

namespace {

const char* kHowToLaunch =
    "start the program with `fsdprun --nproc-per-node N -- program` (or torchrun), or set RANK, "
    "WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself";

std::optional<std::string> lookup(const std::map<std::string, std::string>& env, const std::string& k) {
  auto it = env.find(k);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

int parse_int(const std::string& name, const std::string& value, int min_value) {
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (errno != 0 || end == value.c_str() || *end != '\0' || v < min_value || v > INT_MAX) {
    throw DistError("fsdp: environment variable " + name + "='" + value + "' is not " +
                    (min_value > 0 ? "a positive integer" : "a non-negative integer") + "; " + kHowToLaunch);
  }
  return static_cast<int>(v);
}

}  // namespace

LaunchEnv parse_launch_env(const std::map<std::string, std::string>& env) {
  LaunchEnv e;
  auto rank = lookup(env, "RANK");
  auto world = lookup(env, "WORLD_SIZE");
  if (!rank && !world) {
    // No launcher at all: one process that still works (world size 1, no store, no network).
    return e;
  }
  if (!rank || !world) {
    throw DistError(std::string("fsdp: ") +
                    (rank ? "RANK is set but WORLD_SIZE is not" : "WORLD_SIZE is set but RANK is not") + "; " +
                    kHowToLaunch);
  }
  e.from_launcher = true;
  e.rank = parse_int("RANK", *rank, 0);
  e.world_size = parse_int("WORLD_SIZE", *world, 1);
  if (e.rank >= e.world_size) {
    throw DistError("fsdp: RANK=" + std::to_string(e.rank) + " is not below WORLD_SIZE=" +
                    std::to_string(e.world_size) + "; ranks are numbered 0..WORLD_SIZE-1");
  }
  auto local_rank = lookup(env, "LOCAL_RANK");
  auto local_world = lookup(env, "LOCAL_WORLD_SIZE");
  e.local_rank = local_rank ? parse_int("LOCAL_RANK", *local_rank, 0) : e.rank;
  e.local_world_size = local_world ? parse_int("LOCAL_WORLD_SIZE", *local_world, 1) : e.world_size;
  if (e.local_rank >= e.local_world_size) {
    throw DistError("fsdp: LOCAL_RANK=" + std::to_string(e.local_rank) +
                    " is not below LOCAL_WORLD_SIZE=" + std::to_string(e.local_world_size));
  }
  if (e.local_world_size > e.world_size) {
    throw DistError("fsdp: LOCAL_WORLD_SIZE=" + std::to_string(e.local_world_size) +
                    " exceeds WORLD_SIZE=" + std::to_string(e.world_size));
  }
  auto addr = lookup(env, "MASTER_ADDR");
  auto port = lookup(env, "MASTER_PORT");
  if (e.world_size > 1 && (!addr || !port)) {
    throw DistError(std::string("fsdp: WORLD_SIZE=") + std::to_string(e.world_size) + " but " +
                    (!addr ? "MASTER_ADDR" : "MASTER_PORT") +
                    " is not set; set it to the address/port of rank 0's store (e.g. MASTER_ADDR=127.0.0.1 "
                    "MASTER_PORT=29500), or " +
                    kHowToLaunch);
  }
  if (addr) e.master_addr = *addr;
  if (port) {
    e.master_port = parse_int("MASTER_PORT", *port, 0);
    if (e.master_port > 65535) throw DistError("fsdp: MASTER_PORT=" + *port + " is not a TCP port (1..65535)");
    if (e.master_port == 0 && e.world_size > 1) {
      throw DistError(
          "fsdp: MASTER_PORT=0 cannot be shared between ranks; pick a port, or use "
          "`fsdprun --master-port 0`, which picks one and passes the real port on");
    }
  }
  auto agent = lookup(env, "TORCHELASTIC_USE_AGENT_STORE");
  e.use_agent_store = agent && (*agent == "True" || *agent == "true" || *agent == "1");
  if (auto rc = lookup(env, "TORCHELASTIC_RESTART_COUNT"))
    e.restart_count = parse_int("TORCHELASTIC_RESTART_COUNT", *rc, 0);
  return e;
}

LaunchEnv read_launch_env() {
  std::map<std::string, std::string> env;
  for (char** p = environ; *p != nullptr; ++p) {
    std::string kv(*p);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return parse_launch_env(env);
}

}  // namespace fsdp::dist
