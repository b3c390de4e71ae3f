#pragma once
// Liveness of the nodes of a multi-node job (losing a host).
//
// Every node but node 0 runs a Heartbeat: a thread with its own store connection that adds 1 to
// /fsdprun/node_<k>/beat every interval, whatever the agent's main loop is doing (stopping workers
// can take a grace period). Node 0 hosts the store, so its liveness is the store answering: the
// other nodes bound every store call by the same timeout.
//
// Node 0 runs a PeerWatch over those counters: a node whose counter has moved at least once and
// then does not move for `timeout` is lost (its host or link is down, or its fsdprun was killed).
// A node that comes back (fsdprun started there again) moves its counter again and is no longer
// lost. A node that never beat (not started yet) is the rendezvous timeout's business.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fsdprun {

class StoreClient;

std::string beat_key(int node);

class Heartbeat {
 public:
  Heartbeat(std::unique_ptr<StoreClient> store, int node_rank, std::chrono::milliseconds interval);
  ~Heartbeat();  // stops the thread; waits at most one store call's timeout
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;
  bool hung() const { return hung_; }  // a call never returned: the process must leave with _exit

 private:
  void loop();
  std::unique_ptr<StoreClient> store_;
  std::string key_;
  std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::atomic<bool> hung_{false};
  std::thread thread_;
};

class PeerWatch {
 public:
  PeerWatch(int nnodes, std::chrono::milliseconds timeout);
  // Reads the other nodes' counters (at most every timeout/20) and returns the nodes found lost
  // by this call. Throws StoreLost.
  std::vector<int> poll(StoreClient& store);
  bool lost(int node) const { return peers_[static_cast<size_t>(node)].lost; }
  int lost_count() const;
  // "node 1 lost: no heartbeat from its fsdprun for 15 s (...)"
  std::string describe(int node) const;
  // Every lost node's description, "; "-separated ("" when none).
  std::string summary() const;

 private:
  struct Peer {
    int64_t last = 0;
    std::chrono::steady_clock::time_point changed;
    bool lost = false;
  };
  std::vector<Peer> peers_;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point next_read_;
};

}  // namespace fsdprun
