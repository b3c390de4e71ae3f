#include "options.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <set>
#include <thread>

#include <unistd.h>

namespace fsdprun {
namespace {

// A small table-driven parser rather than CLI11: torchrun's grammar is argparse's (options first,
// then the program and everything after it untouched), and CLI11's prefix_command() would take a
// misspelled flag for the program instead of reporting it.
struct Spec {
  const char* name;  // canonical spelling, with hyphens
  bool takes_value;
  std::function<void(Options&, const std::string&)> apply;
};

long parse_long(const std::string& flag, const std::string& value, long min_value, long max_value,
                const std::string& what) {
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || errno != 0 || *end != '\0' || v < min_value || v > max_value) {
    throw UsageError(flag + " '" + value + "' is not valid; give " + what);
  }
  return v;
}

double parse_seconds(const std::string& flag, const std::string& value, bool allow_zero) {
  errno = 0;
  char* end = nullptr;
  double v = std::strtod(value.c_str(), &end);
  if (value.empty() || errno != 0 || *end != '\0' || !std::isfinite(v) || v < 0 || (!allow_zero && v == 0)) {
    throw UsageError(flag + " '" + value + "' is not valid; give a number of seconds" +
                     (allow_zero ? " (0 or more), e.g. " + flag + " 30" : " above 0, e.g. " + flag + " 300"));
  }
  return v;
}

int parse_nproc(const std::string& value) {
  // torchrun also accepts "cpu"/"auto"; on a CPU-only build both mean one worker per core.
  if (value == "cpu" || value == "auto") {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return cores > 0 ? static_cast<int>(cores) : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  if (value == "gpu") {
    throw UsageError(
        "--nproc-per-node gpu is not supported by fsdprun; give the number of workers, e.g. "
        "--nproc-per-node 8");
  }
  return static_cast<int>(
      parse_long("--nproc-per-node", value, 1, 4096, "a positive number of workers per node, e.g. --nproc-per-node 2"));
}

// torchrun's N or MIN:MAX; sets nnodes (the most) and min_nodes.
void parse_nnodes(Options& o, const std::string& value) {
  auto colon = value.find(':');
  if (colon == std::string::npos) {
    o.nnodes = o.min_nodes =
        static_cast<int>(parse_long("--nnodes", value, 1, 65536, "a positive number of nodes, e.g. --nnodes 2"));
    return;
  }
  const std::string lo = value.substr(0, colon), hi = value.substr(colon + 1);
  long min_nodes = parse_long("--nnodes", lo, 1, 65536, "a positive number of nodes, e.g. --nnodes 2 or --nnodes 2:3");
  long max_nodes = parse_long("--nnodes", hi, 1, 65536, "a positive number of nodes, e.g. --nnodes 2 or --nnodes 2:3");
  if (min_nodes > max_nodes) {
    throw UsageError("--nnodes " + value + " has MIN above MAX; give MIN:MAX with MIN <= MAX, e.g. --nnodes " + hi +
                     ":" + lo);
  }
  o.min_nodes = static_cast<int>(min_nodes);
  o.nnodes = static_cast<int>(max_nodes);
}

// torchrun's Std values: 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank "0:1,1:3".
std::string check_std(const std::string& flag, const std::string& v) {
  const std::string fix =
      "; give 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank, e.g. " + flag + " 0:3,1:2";
  auto digit = [&](const std::string& d) {
    if (d.size() != 1 || d[0] < '0' || d[0] > '3') throw UsageError(flag + " '" + v + "' is not valid" + fix);
  };
  if (v.find(':') == std::string::npos) {
    digit(v);
    return v;
  }
  size_t start = 0;
  while (start <= v.size()) {
    size_t end = v.find(',', start);
    if (end == std::string::npos) end = v.size();
    const std::string item = v.substr(start, end - start);
    auto colon = item.find(':');
    if (colon == std::string::npos) throw UsageError(flag + " '" + v + "' is not valid" + fix);
    parse_long(flag, item.substr(0, colon), 0, 4095, "a local rank 0 or more before ':', e.g. " + flag + " 0:3,1:2");
    digit(item.substr(colon + 1));
    start = end + 1;
  }
  return v;
}

std::vector<int> parse_rank_list(const std::string& v) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= v.size()) {
    size_t end = v.find(',', start);
    if (end == std::string::npos) end = v.size();
    out.push_back(static_cast<int>(parse_long("--local-ranks-filter", v.substr(start, end - start), 0, 4095,
                                              "local ranks separated by commas, e.g. --local-ranks-filter 0,1")));
    start = end + 1;
  }
  return out;
}

// torchrun's HOST[:PORT] (IPv6 as [ADDR]:PORT); torchrun's default port for a c10d endpoint is
// 29400. The endpoint is node 0's store: fsdprun's --master-addr/--master-port.
void parse_endpoint(Options& o, const std::string& v) {
  const std::string fix = "; give HOST:PORT of the node that hosts the store, e.g. --rdzv-endpoint node01:29400";
  std::string host = v, port = "29400";
  if (!v.empty() && v[0] == '[') {
    const auto close = v.find(']');
    if (close == std::string::npos) throw UsageError("--rdzv-endpoint '" + v + "' has no closing ']'" + fix);
    host = v.substr(1, close - 1);
    if (close + 1 < v.size()) {
      if (v[close + 1] != ':') throw UsageError("--rdzv-endpoint '" + v + "' is not valid" + fix);
      port = v.substr(close + 2);
    }
  } else if (const auto colon = v.rfind(':'); colon != std::string::npos) {
    if (v.find(':') != colon)
      throw UsageError("--rdzv-endpoint '" + v + "': write an IPv6 address in brackets, e.g. [::1]:29400");
    host = v.substr(0, colon);
    port = v.substr(colon + 1);
  }
  if (host.empty()) throw UsageError("--rdzv-endpoint '" + v + "' names no host" + fix);
  o.master_addr = host;
  o.master_port = static_cast<int>(parse_long("--rdzv-endpoint", port, 1, 65535, "a TCP port 1..65535" + fix));
}

// torchrun's --rdzv-conf k=v,...: the keys fsdprun can honour; the others are refused.
void parse_rdzv_conf(Options& o, const std::string& v) {
  size_t start = 0;
  while (start < v.size()) {
    size_t end = v.find(',', start);
    if (end == std::string::npos) end = v.size();
    const std::string item = v.substr(start, end - start);
    const auto eq = item.find('=');
    const std::string key = item.substr(0, eq), value = eq == std::string::npos ? "" : item.substr(eq + 1);
    if (eq == std::string::npos || value.empty())
      throw UsageError("--rdzv-conf '" + v + "': '" + item + "' is not KEY=VALUE, e.g. --rdzv-conf join_timeout=600");
    if (key == "join_timeout" || key == "timeout") {
      o.rdzv_timeout_s = parse_seconds("--rdzv-conf " + key, value, false);
    } else if (key == "last_call_timeout") {
      o.rdzv_last_call_s = parse_seconds("--rdzv-conf " + key, value, true);
    } else if (key == "is_host") {
      static const std::set<std::string> yes = {"1", "true", "True", "yes"}, no = {"0", "false", "False", "no"};
      if (!yes.count(value) && !no.count(value))
        throw UsageError("--rdzv-conf is_host='" + value + "' is not valid; give true or false");
      o.is_host = yes.count(value) ? 1 : 0;
    } else if (key == "read_timeout" || key == "close_timeout" || key == "use_libuv") {
      // Tuning of torchrun's own store client; fsdprun bounds its store calls by --rdzv-timeout-s
      // and --heartbeat-timeout-s instead. Accepted so that a torchrun command line runs as it is.
    } else {
      throw UsageError("--rdzv-conf key '" + key +
                       "' is not supported by fsdprun; it reads join_timeout, last_call_timeout and is_host "
                       "(read_timeout, close_timeout and use_libuv are accepted and ignored)");
    }
    start = end + 1;
  }
}

// The nodes, workers and the store: how many, where, which rank.
std::vector<Spec> node_specs() {
  return {
      {"--nproc-per-node", true, [](Options& o, const std::string& v) { o.nproc_per_node = parse_nproc(v); }},
      {"--nnodes", true, [](Options& o, const std::string& v) { parse_nnodes(o, v); }},
      {"--rdzv-last-call-s", true,
       [](Options& o, const std::string& v) { o.rdzv_last_call_s = parse_seconds("--rdzv-last-call-s", v, true); }},
      {"--node-rank", true,
       [](Options& o, const std::string& v) {
         o.node_rank =
             static_cast<int>(parse_long("--node-rank", v, 0, 65535, "a node rank of 0 or more, e.g. --node-rank 0"));
       }},
      {"--master-addr", true,
       [](Options& o, const std::string& v) {
         if (v.empty())
           throw UsageError("--master-addr is empty; give node 0's host name or address, e.g. --master-addr 127.0.0.1");
         o.master_addr = v;
       }},
      {"--master-port", true,
       [](Options& o, const std::string& v) {
         o.master_port = static_cast<int>(parse_long(
             "--master-port", v, 0, 65535, "a TCP port 1..65535 (or 0 for a free one), e.g. --master-port 29500"));
       }},
      {"--max-restarts", true,
       [](Options& o, const std::string& v) {
         o.max_restarts = static_cast<int>(
             parse_long("--max-restarts", v, 0, INT_MAX, "a count of 0 or more, e.g. --max-restarts 3"));
       }},
      {"--standalone", false, [](Options& o, const std::string&) { o.standalone = true; }},
      {"--store", true,
       [](Options& o, const std::string& v) {
         if (v != "file" && v != "tcp") {
           throw UsageError("--store '" + v + "' is not valid; give file (single node, nothing on the network) or tcp");
         }
         o.store = v;
       }},
      {"--no-python", false, [](Options& o, const std::string&) { o.no_python = true; }},
  };
}

// Timeouts and torchrun's rendezvous flags.
std::vector<Spec> timing_and_rendezvous_specs() {
  return {
      {"--grace-period-s", true,
       [](Options& o, const std::string& v) { o.grace_period_s = parse_seconds("--grace-period-s", v, true); }},
      {"--rdzv-timeout-s", true,
       [](Options& o, const std::string& v) { o.rdzv_timeout_s = parse_seconds("--rdzv-timeout-s", v, false); }},
      {"--monitor-interval", true,
       [](Options& o, const std::string& v) { o.monitor_interval_s = parse_seconds("--monitor-interval", v, false); }},
      {"--heartbeat-timeout-s", true,
       [](Options& o, const std::string& v) {
         o.heartbeat_timeout_s = parse_seconds("--heartbeat-timeout-s", v, false);
       }},
      {"--rdzv-id", true,
       [](Options& o, const std::string& v) {
         if (v.empty()) throw UsageError("--rdzv-id is empty; give the job's id, e.g. --rdzv-id job42");
         o.run_id = v;
       }},
      {"--rdzv-backend", true,
       [](Options& o, const std::string& v) {
         if (v != "static" && v != "c10d") {
           throw UsageError("--rdzv-backend " + v +
                            " is not supported; use c10d (a TCP store at --rdzv-endpoint, the same command on "
                            "every node) or static (every node with its own --node-rank)");
         }
         o.rdzv_backend = v;
       }},
      {"--rdzv-endpoint", true, [](Options& o, const std::string& v) { parse_endpoint(o, v); }},
      {"--rdzv-conf", true, [](Options& o, const std::string& v) { parse_rdzv_conf(o, v); }},
  };
}

// The workers' role and output, and --help (last: find_spec maps -h to it).
std::vector<Spec> worker_output_specs() {
  return {
      {"--start-method", true,
       [](Options&, const std::string& v) {
         // torchrun's way of starting Python workers; fsdprun always executes the program itself.
         if (v != "spawn" && v != "fork" && v != "forkserver")
           throw UsageError("--start-method '" + v + "' is not valid; give spawn, fork or forkserver");
       }},
      {"--role", true,
       [](Options& o, const std::string& v) {
         if (v.empty()) throw UsageError("--role is empty; give a role name, e.g. --role trainer");
         o.role = v;
       }},
      {"--log-dir", true,
       [](Options& o, const std::string& v) {
         if (v.empty())
           throw UsageError("--log-dir is empty; give a folder for the workers' log files, e.g. --log-dir logs");
         o.log_dir = v;
       }},
      {"--redirects", true, [](Options& o, const std::string& v) { o.redirects = check_std("--redirects", v); }},
      {"--tee", true, [](Options& o, const std::string& v) { o.tee = check_std("--tee", v); }},
      {"--local-ranks-filter", true,
       [](Options& o, const std::string& v) { o.local_ranks_filter = parse_rank_list(v); }},
      {"--flight-recorder-dir", true,
       [](Options& o, const std::string& v) {
         if (v.empty())
           throw UsageError(
               "--flight-recorder-dir is empty; give a folder for the flight-recorder dumps, e.g. "
               "--flight-recorder-dir fr");
         o.flight_recorder_dir = v;
       }},
      {"--help", false, [](Options& o, const std::string&) { o.help = true; }},
  };
}

// Every flag; an ambiguous prefix names its candidates in this order.
const std::vector<Spec>& specs() {
  static const std::vector<Spec> table = [] {
    std::vector<Spec> all;
    for (auto group : {node_specs(), timing_and_rendezvous_specs(), worker_output_specs()})
      all.insert(all.end(), group.begin(), group.end());
    return all;
  }();
  return table;
}

// torchrun flags that fsdprun does not implement, with what to do instead.
std::string unsupported_hint(const std::string& name) {
  if (name == "-m" || name == "--module") {
    return "fsdprun runs programs directly (like torchrun --no-python); drop " + name + " and give the program path";
  }
  if (name == "--local-addr") {
    return "--local-addr is not supported; fsdprun tells the workers node 0's address (MASTER_ADDR): drop it";
  }
  if (name == "--logs-specs" || name == "--run-path") {
    return name +
           " is not supported by fsdprun (it runs programs directly, with torchrun's log layout under "
           "--log-dir); drop it";
  }
  return {};
}

// "--nproc_per_node" -> "--nproc-per-node"; torchrun accepts both spellings of every flag.
std::string normalize(std::string name) {
  for (size_t i = 2; i < name.size(); ++i) {
    if (name[i] == '_') name[i] = '-';
  }
  return name;
}

const Spec* find_spec(const std::string& name) {
  const auto& table = specs();
  for (const auto& s : table) {
    if (name == s.name) return &s;
  }
  if (name == "-h") return &table.back();
  if (name == "-r" || name == "-t") return find_spec(name == "-r" ? "--redirects" : "--tee");
  // argparse (and so torchrun) accepts unambiguous prefixes such as --nproc.
  const Spec* match = nullptr;
  std::vector<std::string> candidates;
  for (const auto& s : table) {
    if (name.size() > 2 && std::string(s.name).rfind(name, 0) == 0) {
      match = &s;
      candidates.push_back(s.name);
    }
  }
  if (candidates.size() > 1) {
    std::string list;
    for (const auto& c : candidates) list += (list.empty() ? "" : ", ") + c;
    throw UsageError("option '" + name + "' is ambiguous (" + list + "); spell it out");
  }
  return match;
}

}  // namespace

int std_streams_for(const std::string& spec, int local_rank) {
  if (spec.empty()) return 0;
  if (spec.find(':') == std::string::npos) return spec[0] - '0';
  size_t start = 0;
  while (start <= spec.size()) {
    size_t end = spec.find(',', start);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(start, end - start);
    const auto colon = item.find(':');
    if (std::atoi(item.substr(0, colon).c_str()) == local_rank) return item[colon + 1] - '0';
    start = end + 1;
  }
  return 0;
}

namespace {

// The flags before the program: applied to `o`, their names in `given`. Returns the index of the
// program's first argument.
size_t parse_flags(const std::vector<std::string>& args, Options& o, std::set<std::string>& given) {
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program: everything from here on is its own
    std::string name = arg, value;
    bool inline_value = false;
    if (auto eq = arg.find('='); eq != std::string::npos && arg.rfind("--", 0) == 0) {
      name = arg.substr(0, eq);
      value = arg.substr(eq + 1);
      inline_value = true;
    }
    name = normalize(name);
    if (auto hint = unsupported_hint(name); !hint.empty()) throw UsageError(hint);
    const Spec* spec = find_spec(name);
    if (spec == nullptr) {
      throw UsageError("unknown option '" + arg +
                       "'; see fsdprun --help (options go before the program; put the "
                       "program's own options after it)");
    }
    if (spec->takes_value) {
      if (!inline_value) {
        if (i + 1 >= args.size())
          throw UsageError(std::string(spec->name) + " needs a value, e.g. " + spec->name + "=VALUE");
        value = args[++i];
      }
    } else if (inline_value) {
      throw UsageError(std::string(spec->name) + " takes no value; write just " + spec->name);
    }
    spec->apply(o, value);
    given.insert(spec->name);
  }
  return i;
}

// torchrun's --standalone: one node, a free port on the local host.
void apply_standalone(Options& o, const std::set<std::string>& given) {
  if (o.nnodes != 1)
    throw UsageError("--standalone runs a single node; drop --nnodes " + std::to_string(o.nnodes) + " or --standalone");
  for (const char* f : {"--node-rank", "--master-addr", "--master-port"}) {
    if (given.count(f))
      throw UsageError(std::string("--standalone picks the address and a free port itself; drop ") + f);
  }
  o.master_addr = "127.0.0.1";
  o.master_port = 0;
  if (!given.count("--rdzv-id")) o.run_id = "standalone-" + std::to_string(getpid());
}

// Where node 0's store is and which rank this node has: the flags that must agree.
void resolve_rendezvous(Options& o, const std::set<std::string>& given) {
  const bool endpoint = given.count("--rdzv-endpoint") > 0;
  for (const char* f : {"--master-addr", "--master-port"}) {
    if (endpoint && given.count(f))
      throw UsageError(std::string("--rdzv-endpoint and ") + f + " both name node 0's store; give one of them");
  }
  if (o.rdzv_backend == "c10d" && o.nnodes > 1) {
    if (!endpoint && !given.count("--master-addr"))
      throw UsageError(
          "--rdzv-backend c10d with several nodes needs --rdzv-endpoint HOST:PORT (a host every node reaches, "
          "e.g. the first node's name)");
    if (!given.count("--node-rank")) o.node_rank = kAutoNodeRank;  // the same command on every node
  }
  if (o.is_host != -1 && o.node_rank != kAutoNodeRank)
    throw UsageError(
        "--rdzv-conf is_host applies to --rdzv-backend c10d with several nodes and no --node-rank; drop it");
  if (o.node_rank >= o.nnodes) {
    throw UsageError("--node-rank " + std::to_string(o.node_rank) + " must be below --nnodes " +
                     std::to_string(o.nnodes) + "; number the nodes 0.." + std::to_string(o.nnodes - 1));
  }
}

// The port and the store kind against the node count; a program must be given.
void check_store_and_program(Options& o) {
  if (o.master_port == 0 && o.nnodes > 1) {
    throw UsageError(
        "--master-port 0 only works with one node (the other nodes could not know the port); give a "
        "fixed port, e.g. --master-port 29500");
  }
  if (o.store.empty()) o.store = o.nnodes == 1 ? "file" : "tcp";
  if (o.store == "file" && o.nnodes > 1) {
    throw UsageError(
        "--store file only works with one node (the other nodes cannot reach this machine's files); "
        "drop --store file, or use --store tcp");
  }
  if (o.program.empty()) {
    throw UsageError("no program given; usage: fsdprun [options] [--] program [args...] (see fsdprun --help)");
  }
}

}  // namespace

Options parse_options(const std::vector<std::string>& args) {
  Options o;
  std::set<std::string> given;
  const size_t i = parse_flags(args, o, given);
  o.program.assign(args.begin() + static_cast<long>(std::min(i, args.size())), args.end());
  if (o.help) return o;
  if (o.standalone) apply_standalone(o, given);
  resolve_rendezvous(o, given);
  check_store_and_program(o);
  return o;
}

namespace {

const char* usage_intro() {
  return R"(usage: fsdprun [options] [--] program [args...]

Starts --nproc-per-node copies of `program` on this node with torchrun's environment
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*, ...), hosts the
c10d store the workers connect to (TORCHELASTIC_USE_AGENT_STORE=True), forwards their
output with "[rank<R>]: " prefixes, and stops or restarts the whole group when one fails.
Options go before the program; everything after the program (or after `--`) is passed to it.
Every flag also accepts underscores (--nproc_per_node) and the --flag=value form.

)";
}

const char* usage_options() {
  return R"(options:
  --nproc-per-node N     workers on this node (default 1; "cpu"/"auto": one per core)
  --nnodes N|MIN:MAX     number of nodes, each running its own fsdprun (default 1). MIN:MAX is
                         elastic: an attempt starts with every node that joined, at least MIN,
                         once MAX joined or --rdzv-last-call-s after the MIN-th; node ranks and
                         RANK/WORLD_SIZE are renumbered over the nodes present (node 0 must be)
  --rdzv-last-call-s S   elastic: how long node 0 waits for more nodes once MIN joined (30)
  --node-rank K          this node's rank, 0..nnodes-1 (default 0); node 0 hosts the store
  --master-addr A        node 0's address, where its TCP store listens (default 127.0.0.1): an
                         address the other nodes reach this machine by
  --master-port P        the TCP store's port (default 29500); 0 picks a free port (single node
                         only); workers get the real port in MASTER_PORT
  --standalone           single node on 127.0.0.1 with a free port (like --master-port 0)
  --store file|tcp       file (default for one node): a c10d FileStore in a private folder
                         (mode 0700, removed at exit), named to the workers by FSDP_STORE_FILE;
                         nothing listens on the network and Gloo uses the loopback interface.
                         MASTER_ADDR/MASTER_PORT are still set, but nothing listens there: use
                         tcp for a program that connects to them itself. tcp (the only choice
                         for several nodes): node 0 hosts a c10d TCPStore at the address above
  --max-restarts R       restart the whole group up to R times after a failure (default 0);
                         workers see TORCHELASTIC_RESTART_COUNT 0, 1, ...
  --grace-period-s S     when stopping workers, SIGTERM then SIGKILL after S seconds (default 30)
  --rdzv-timeout-s S     bound on waits for other nodes: store connect, rendezvous before each
                         attempt, the final exit barrier (default 300)
  --monitor-interval S   how often the store is polled for failures on other nodes (default 0.1)
  --heartbeat-timeout-s S  several nodes: a node whose fsdprun sends no heartbeat for S seconds
                         (host down, link down, agent killed) is lost: node 0 stops the job, or
                         restarts it when restarts remain and the node comes back (start fsdprun
                         there again with the same flags); a node 0 whose store does not answer
                         for S seconds is lost to the others (default 15). A lost node is named
                         within S + --grace-period-s seconds (docs/multihost.md)
  --rdzv-id ID           job id, passed as TORCHELASTIC_RUN_ID (default "none")
  --rdzv-backend static|c10d  static (default): every node gets its own --node-rank. c10d:
                         torchrun's multi-node form, the identical command on every node: the node
                         whose addresses include the --rdzv-endpoint host hosts the store (node
                         0), the others are numbered 1, 2, ... as they join (--node-rank, if
                         given, still wins)
  --rdzv-endpoint H[:P]  node 0's store, as --master-addr H --master-port P (P default 29400;
                         IPv6 as [ADDR]:P)
  --rdzv-conf K=V,...    join_timeout (= --rdzv-timeout-s), last_call_timeout (= --rdzv-last-call-s),
                         is_host=true|false (whether this node hosts the c10d store); read_timeout,
                         close_timeout and use_libuv are accepted and ignored; others refused
  --start-method M       accepted for torchrun compatibility (spawn|fork|forkserver: programs
                         always run directly)
  --role NAME            ROLE_NAME of the workers (default "default")
  --no-python            accepted for torchrun compatibility (programs always run directly)
  --log-dir DIR          also write each worker's stdout and stderr to files, in
                         DIR/<rdzv-id>_node<K>/attempt_<n>/<local rank>/{stdout,stderr}.log
                         (torchrun's layout, the node rank in place of its random suffix)
  -r, --redirects S      streams that go to the log files only, not the console: 0 none,
                         1 stdout, 2 stderr, 3 both, or per local rank (0:3,1:2)
  -t, --tee S            streams that go to the log files and the console (same values);
                         with --log-dir and neither flag, both streams are teed. Without
                         --log-dir, --redirects/--tee write to a new folder fsdprun names
  --local-ranks-filter L only these local ranks' output reaches the console (e.g. 0 or 0,1);
                         the log files still get everything. A failed worker whose output
                         did not all reach the console: its last output lines are printed
  --flight-recorder-dir DIR
                         where a worker whose collective fails or times out writes its last
                         collectives (FSDP_FLIGHT_RECORDER_DIR, DIR/rank_<R>.jsonl); when a
                         worker fails, fsdprun prints where the dumps are (analyse: fsdp-fr DIR)
  -h, --help             show this help

)";
}

// The workers' environment, the network, the exit status.
const char* usage_environment() {
  return R"(worker environment: RANK (= node_rank * nproc + LOCAL_RANK), LOCAL_RANK, GROUP_RANK (node rank),
ROLE_RANK, ROLE_NAME, LOCAL_WORLD_SIZE, WORLD_SIZE (= nnodes * nproc), GROUP_WORLD_SIZE,
ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID, TORCHELASTIC_USE_AGENT_STORE=True; if unset: OMP_NUM_THREADS (cores /
nproc), OPENBLAS_CORETYPE (when OpenBLAS would use generic kernels on this CPU),
TORCH_NCCL_ASYNC_ERROR_HANDLING=1; with --store file, FSDP_STORE_FILE (the FileStore's path).
Workers connect to the store as clients under
PrefixStore("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>").

network: a single-node job with --store file (the default) opens nothing beyond this
machine. A multi-node job's store and the workers' collectives (Gloo) are unauthenticated:
anyone who can reach node 0's store port can read and write its keys, and the Gloo ports accept
any peer. Run multi-node jobs only on a trusted network, as PyTorch's torchrun requires. The TCP
store listens on --master-addr only where LibTorch allows choosing the address (2.x); LibTorch
1.13's listens on every interface (fsdprun then says so): firewall the port, or run on a private
network. GLOO_SOCKET_IFNAME picks Gloo's interface.

exit status: 0 when every worker on every node exited 0; 1 when workers failed (the first failure
is named) or the job could not start; 2 for a wrong command line; 128+N after signal N
(SIGINT/SIGTERM/SIGHUP/SIGQUIT are forwarded to the workers).
)";
}

}  // namespace

std::string usage_text() { return std::string(usage_intro()) + usage_options() + usage_environment(); }

}  // namespace fsdprun
