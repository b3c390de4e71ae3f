#pragma once
// The per-node agent: hosts (node 0) or joins the c10d store (a TCPStore; for a single node by
// default a FileStore in a private folder), agrees with the other nodes on
// each attempt, runs the local workers, and stops or restarts them all together.
//
// Cross-node protocol, all keys in the agent's TCPStore (workers use "/worker/attempt_<k>/..."):
//   /fsdprun/config                  node 0's nnodes/nproc/max_restarts/run id; others must match
//   /fsdprun/node_<n>/claimed        counter; >1 means two agents were given the same --node-rank
//   /fsdprun/abort                   reason; the job ends without further restarts (signal, timeout)
//   /fsdprun/attempt_<k>/joined      counter; workers of attempt k start once it reaches nnodes
//   /fsdprun/attempt_<k>/fail_count  counter; the agent that makes it 1 writes .../failed
//   /fsdprun/attempt_<k>/failed      reason of the first failure; every agent polls it
//   /fsdprun/attempt_<k>/stopped     counter of agents that stopped their workers after a failure
//   /fsdprun/attempt_<k>/done        counter of agents whose workers all exited 0
//   /fsdprun/attempt_<k>/exit_ack    counter of non-zero nodes that saw done == nnodes
//   /fsdprun/node_<n>/beat           counter; node n's heartbeat (heartbeat.h), watched by node 0
//   /fsdprun/current_attempt         the attempt node 0 is in; a node that comes back joins it
//   /fsdprun/attempt_<k>/node_<n>    set by node n before it adds to .../joined
//   /fsdprun/attempt_<k>/members     node 0's list of the attempt's nodes ("0,1,3"): it closes the
//                                    rendezvous once nnodes joined, or (elastic MIN:MAX) once MIN
//                                    joined and --rdzv-last-call-s passed; group ranks follow it
// Node 0 waits for stopped / exit_ack before it exits, because its exit takes the store down.
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "heartbeat.h"
#include "options.h"

namespace fsdprun {

class Signals;
class StoreClient;
class WorkerGroup;
struct WorkerExit;
struct WorkerSpec;

class Agent {
 public:
  Agent(Options opts, std::string exe);
  ~Agent();
  // Runs the job to the end; returns fsdprun's exit status.
  int run();
  // True when a store call never returned (a silent node 0): the process must then leave with
  // _exit(), since a thread is still blocked inside c10d.
  bool store_hung() const;

 private:
  enum class Outcome { Succeeded, LocalFailure, RemoteFailure, Signaled, StoreLost, NodeLost };

  using TimePoint = std::chrono::steady_clock::time_point;

  int setup_store();  // 0 or an exit status
  std::string store_config() const;
  int setup_file_store(std::chrono::milliseconds op_timeout, const std::string& config);  // 0 or an exit status
  // 0, an exit status, or -1: the port is taken (by another agent on this machine), join it instead.
  int host_store(std::chrono::milliseconds op_timeout, const std::string& config, bool auto_rank);
  int join_store(std::chrono::milliseconds op_timeout, const std::string& config, bool auto_rank);  // 0 or exit
  int connect_store(TimePoint deadline, std::chrono::milliseconds op_timeout);                      // 0 or exit
  int check_node0_config(TimePoint deadline, const std::string& config);                            // 0 or exit
  int take_auto_node_rank();                                                                        // 0 or exit
  int rendezvous(int attempt);        // -1: this node is in the attempt; -2: it started without it; else an exit status
  int wait_for_members(int attempt);  // -1: members_ holds the attempt's nodes; else an exit status
  bool rendezvous_closed(int attempt, int64_t joined, std::optional<TimePoint>& min_reached);
  int rendezvous_interrupted(int attempt, int64_t joined, TimePoint deadline);  // -1: keep waiting; else exit
  int run_attempt(int attempt, Outcome& outcome, std::string& reason);          // -1: go on; else an exit status
  int stop_after(WorkerGroup& group, Outcome outcome, int attempt, const std::string& reason);  // -1 or exit
  bool is_member(int node) const;
  int lost_members() const;
  Outcome monitor(WorkerGroup& group, int attempt, std::string& reason);
  int exit_barrier(int attempt, std::string& failure);  // -1: another node failed (in `failure`)
  int finish_failed_attempt(int attempt, const std::string& reason, bool& restart);
  void publish_failure(int attempt, const std::string& reason, bool abort);
  void wait_counter(const std::string& key, int64_t target, std::chrono::milliseconds limit);
  std::vector<WorkerSpec> worker_specs(int attempt) const;
  std::string failure_text(const WorkerExit& e) const;
  std::string endpoint() const;
  int setup_logs();                    // 0 or an exit status
  int claim_node_rank();               // 0 or an exit status (non-zero nodes)
  int find_first_attempt();            // 0 or an exit status (non-zero nodes)
  void watch_peers(const char* when);  // node 0: notes the nodes newly lost (log)
  void print_last_lines(const WorkerGroup& group, int global_rank) const;

  Options opts_;
  std::string exe_;
  Signals& signals_;
  std::unique_ptr<StoreClient> store_;
  int port_ = 0;            // the store's real port (differs from opts_.master_port when that is 0)
  std::string store_dir_;   // --store file: the private folder (mode 0700) removed at exit
  std::string store_file_;  // --store file: the FileStore, FSDP_STORE_FILE for the workers
  std::map<std::string, std::string> base_env_;  // fsdprun's environment plus the defaults
  std::unique_ptr<Heartbeat> heartbeat_;         // non-zero nodes of a multi-node job
  PeerWatch peers_;                              // node 0 of a multi-node job
  int first_attempt_ = 0;                        // > 0 for a node that comes back into a running job
  std::vector<int> members_{0};                  // the nodes of the current attempt (node ranks, ascending)
  int group_rank_ = 0;                           // this node's index in members_ (GROUP_RANK)
  std::string log_base_;                         // --log-dir/<run id>_node<K>, "" when workers' output goes to no files
};

}  // namespace fsdprun
