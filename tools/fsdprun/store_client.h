#pragma once
// The agent's handle on its c10d store: a TCPStore (node 0 hosts it, other nodes connect), or for a
// single-node job a FileStore in a private folder (nothing on the network). Nothing here speaks
// TCP itself.
//
// c10d 1.13 sets no receive timeout on the store socket: if node 0's machine goes silent, a call
// blocks forever. Every call therefore runs on a helper thread and the agent waits at most
// `op_timeout` for it; after a timeout the store counts as lost (StoreLost) and is not used again.
#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace fsdprun {

class StoreLost : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class StoreClient {
 public:
  // Node 0: starts the TCPStore server on `port` (0: a free port) and connects to it through
  // `addr`, which must therefore reach this machine. Throws std::runtime_error (c10d's message).
  //
  // Where c10d allows it (2.x, TCPStoreOptions::masterListenFd) the server listens on `addr`
  // only; c10d 1.13's TCPStore listens on every interface ([::] and 0.0.0.0) and offers no way to
  // choose (listens_everywhere() then says so).
  static std::unique_ptr<StoreClient> host(const std::string& addr, int port, std::chrono::milliseconds op_timeout);
  // Other nodes: one connection attempt, retried by c10d until `connect_timeout`. Throws.
  static std::unique_ptr<StoreClient> connect(const std::string& addr, int port,
                                              std::chrono::milliseconds connect_timeout,
                                              std::chrono::milliseconds op_timeout);
  // A single-node job's store: c10d's FileStore at `path` (its folder must exist). Throws.
  static std::unique_ptr<StoreClient> file(const std::string& path, std::chrono::milliseconds op_timeout);
  // True when something accepts TCP connections at addr:port within `timeout`. A plain connect
  // probe, so that waiting for node 0 does not go through c10d's connect, which logs an error
  // for every attempt that times out.
  static bool reachable(const std::string& addr, int port, std::chrono::milliseconds timeout);
  ~StoreClient();

  int port() const { return port_; }
  // These throw StoreLost when the store fails or does not answer within op_timeout.
  int64_t add(const std::string& key, int64_t delta);
  int64_t counter(const std::string& key) { return add(key, 0); }  // reads without blocking on a missing key
  bool check(const std::string& key);
  void set(const std::string& key, const std::string& value);
  std::string get(const std::string& key);  // the key must exist (check first)
  bool hung() const { return hung_; }
  // A hosted TCPStore that listens on every interface (LibTorch 1.13), not only on its address.
  bool listens_everywhere() const { return listens_everywhere_; }

 private:
  struct Impl;
  StoreClient(std::shared_ptr<Impl> impl, int port, std::chrono::milliseconds op_timeout);
  template <class T, class F>
  T call(const char* what, const std::string& key, F fn);

  std::shared_ptr<Impl> impl_;
  int port_;
  std::chrono::milliseconds op_timeout_;
  bool hung_ = false;
  bool lost_ = false;
  bool listens_everywhere_ = false;
};

}  // namespace fsdprun
