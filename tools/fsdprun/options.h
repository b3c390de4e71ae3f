#pragma once
// fsdprun's command line: torchrun's flags and spellings, for a static (fixed-size) job.
#include <stdexcept>
#include <string>
#include <vector>

namespace fsdprun {

// A wrong command line. The message is one line that names the problem and the fix;
// main() prints it and exits with code 2 (like argparse).
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  int nproc_per_node = 1;
  int nnodes = 1;                // the most nodes (torchrun's MAX of --nnodes MIN:MAX)
  int min_nodes = 1;             // the fewest nodes an attempt may start with (MIN; = nnodes unless elastic)
  double rdzv_last_call_s = 30;  // elastic: once MIN nodes joined, wait this long for more
  // -1 (kAutoNodeRank): torchrun's c10d form with no --node-rank (the same command on every
  // node): the node that can host the store at the endpoint is node 0, the others take 1, 2, ...
  // in the order they join.
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: node 0 picks a free port (single node only)
  int max_restarts = 0;
  bool standalone = false;
  // Where the store lives: "file" (a FileStore in a private folder, nothing on the network; the
  // default for one node), "tcp" (node 0 hosts a TCPStore at --master-addr:--master-port; the only
  // choice for several nodes). "" until parse_options picks the default.
  std::string store;
  bool no_python = false;           // accepted for torchrun compatibility; programs always run directly
  double grace_period_s = 30;       // SIGTERM -> SIGKILL delay when stopping workers (torchrun: 30 s)
  double rdzv_timeout_s = 300;      // bound on every cross-node wait (connect, rendezvous, exit barrier)
  double monitor_interval_s = 0.1;  // how often the store is polled for other nodes' failures
  // A node whose agent sends no heartbeat for this long is lost (node 0 declares it); a node 0
  // whose store does not answer for this long is lost (the other nodes give up on it).
  double heartbeat_timeout_s = 15;
  std::string run_id = "none";  // TORCHELASTIC_RUN_ID (torchrun's --rdzv-id)
  // torchrun's --rdzv-backend: "static" (fixed --node-rank per node) or "c10d" (a TCP store at
  // --rdzv-endpoint, node ranks given out as nodes join when --node-rank is not given).
  std::string rdzv_backend = "static";
  // torchrun's --rdzv-conf is_host=true|false: whether this node hosts the c10d store (node 0).
  // Unset: the node whose addresses include the endpoint's host hosts it.
  int is_host = -1;              // -1 unset, 0 false, 1 true
  std::string role = "default";  // ROLE_NAME
  // Worker logs, as torchrun. --log-dir DIR: each worker's stdout/stderr also go to
  // DIR/<run id>_node<K>/attempt_<n>/<local rank>/{stdout,stderr}.log. --redirects/--tee S: which
  // streams go to those files (S: 0 none, 1 stdout, 2 stderr, 3 both, or per local rank "0:3,1:2"),
  // redirected ones leaving the console, teed ones staying on it; without either, --log-dir takes
  // both streams (teed). --local-ranks-filter 0,2: only those local ranks reach the console.
  std::string log_dir;
  std::string redirects;
  std::string tee;
  std::vector<int> local_ranks_filter;  // empty: every local rank
  // --flight-recorder-dir DIR: the workers' FSDP_FLIGHT_RECORDER_DIR (fsdp/debug/flight_recorder.h);
  // when a worker fails, fsdprun prints where the dumps are. "" leaves the environment's value.
  std::string flight_recorder_dir;
  bool help = false;
  std::vector<std::string> program;  // program and its arguments
};

constexpr int kAutoNodeRank = -1;

// Which streams `spec` (a --redirects/--tee value) names for `local_rank`: bit 1 stdout, bit 2
// stderr. "" names none. The value was validated by parse_options.
int std_streams_for(const std::string& spec, int local_rank);

// Parses argv (argv[0] excluded). Options come first; the first non-option argument, or
// everything after `--`, is the program and its arguments (argparse REMAINDER, as torchrun).
// Throws UsageError.
Options parse_options(const std::vector<std::string>& args);

std::string usage_text();

}  // namespace fsdprun
