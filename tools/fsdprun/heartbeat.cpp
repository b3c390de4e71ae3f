#include "heartbeat.h"

#include <algorithm>

#include "store_client.h"

namespace fsdprun {

using Clock = std::chrono::steady_clock;

std::string beat_key(int node) { return "/fsdprun/node_" + std::to_string(node) + "/beat"; }

Heartbeat::Heartbeat(std::unique_ptr<StoreClient> store, int node_rank, std::chrono::milliseconds interval)
    : store_(std::move(store)), key_(beat_key(node_rank)), interval_(interval) {
  store_->add(key_, 1);  // the first beat before the agent goes on: node 0 sees this node at once
  thread_ = std::thread([this] { loop(); });
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Heartbeat::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (cv_.wait_for(lock, interval_, [this] { return stop_; })) return;
    lock.unlock();
    try {
      store_->add(key_, 1);
    } catch (const StoreLost&) {
      // Node 0's store is gone or silent; the agent's own calls find out too (same timeout).
      hung_ = store_->hung();
      return;
    }
    lock.lock();
  }
}

PeerWatch::PeerWatch(int nnodes, std::chrono::milliseconds timeout)
    : peers_(static_cast<size_t>(std::max(nnodes, 1))), timeout_(timeout), next_read_(Clock::now()) {}

std::vector<int> PeerWatch::poll(StoreClient& store) {
  std::vector<int> found;
  const auto now = Clock::now();
  if (now < next_read_) return found;
  next_read_ = now + std::max(timeout_ / 20, std::chrono::milliseconds(50));
  for (size_t n = 1; n < peers_.size(); ++n) {
    Peer& p = peers_[n];
    const int64_t v = store.counter(beat_key(static_cast<int>(n)));
    if (v != p.last) {
      p.last = v;
      p.changed = now;
      p.lost = false;
    } else if (v > 0 && !p.lost && now - p.changed >= timeout_) {
      p.lost = true;
      found.push_back(static_cast<int>(n));
    }
  }
  return found;
}

int PeerWatch::lost_count() const {
  return static_cast<int>(std::count_if(peers_.begin(), peers_.end(), [](const Peer& p) { return p.lost; }));
}

std::string PeerWatch::describe(int node) const {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout_).count();
  std::string secs = std::to_string(ms / 1000);
  if (ms % 1000 != 0) {  // push_back, not "." + string: GCC 12's false -Wrestrict (bug 105329)
    secs.push_back('.');
    secs += std::to_string(ms % 1000 / 100);
  }
  return "node " + std::to_string(node) + " lost: no heartbeat from its fsdprun for " + secs +
         " s (its host or its link is down, or its fsdprun was killed)";
}

std::string PeerWatch::summary() const {
  std::string s;
  for (size_t n = 1; n < peers_.size(); ++n) {
    if (peers_[n].lost) s += (s.empty() ? "" : "; ") + describe(static_cast<int>(n));
  }
  return s;
}

}  // namespace fsdprun
