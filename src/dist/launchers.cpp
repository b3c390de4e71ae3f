// Open MPI's and Slurm's variables mapped onto torchrun's contract (LaunchEnv), and the refusal of
// launchers we do not read. torchrun's own variables are parsed in env.cpp, which calls these in
// order of precedence.
#include "launchers.h"

#include <cerrno>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace fsdp::dist::detail {

std::optional<std::string> lookup(const EnvMap& env, const std::string& key) {
  auto it = env.find(key);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

int parse_int(const std::string& name, const std::string& value, int min_value, const std::string& fix) {
  errno = 0;
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (errno != 0 || end == value.c_str() || *end != '\0' || v < min_value || v > INT_MAX) {
    throw DistError("fsdp: environment variable " + name + "='" + value + "' is not " +
                    (min_value > 0 ? "a positive integer" : "a non-negative integer") + "; " + fix);
  }
  return static_cast<int>(v);
}

namespace {

// Expansions beyond this many names are refused: a typo such as [1-999999999] must not eat memory.
constexpr size_t kMaxHosts = 1 << 20;

DistError bad_list(const std::string& what, const std::string& list, const std::string& why) {
  return DistError("fsdp: " + what + "='" + list + "' is not a Slurm host list (" + why +
                   "); set MASTER_ADDR to the first node's address");
}

// Splits at commas outside brackets.
std::vector<std::string> split_top_level(const std::string& list, const std::string& what) {
  std::vector<std::string> parts;
  std::string cur;
  int depth = 0;
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0 || depth > 1) throw bad_list(what, list, "unbalanced brackets");
    if (c == ',' && depth == 0) {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  if (depth != 0) throw bad_list(what, list, "unbalanced brackets");
  parts.push_back(cur);
  for (const auto& p : parts) {
    if (p.empty()) throw bad_list(what, list, "an empty name");
  }
  return parts;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// "01-04,07" -> 01 02 03 04 07 (the lower bound's width kept, as Slurm does).
std::vector<std::string> expand_brackets(const std::string& inside, const std::string& what, const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= inside.size()) {
    size_t end = inside.find(',', start);
    if (end == std::string::npos) end = inside.size();
    const std::string item = inside.substr(start, end - start);
    const auto dash = item.find('-');
    const std::string lo = item.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : item.substr(dash + 1);
    if (!all_digits(lo) || !all_digits(hi) || lo.size() > 18 || hi.size() > 18) {
      throw bad_list(what, list, "'[" + inside + "]' holds '" + item + "', not a number or a range N-M");
    }
    const unsigned long long a = std::strtoull(lo.c_str(), nullptr, 10);
    const unsigned long long b = std::strtoull(hi.c_str(), nullptr, 10);
    if (a > b) throw bad_list(what, list, "the range " + item + " runs backwards");
    if (b - a >= kMaxHosts || out.size() + (b - a) >= kMaxHosts) throw bad_list(what, list, "too many names");
    for (unsigned long long n = a; n <= b; ++n) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), "%0*llu", static_cast<int>(lo.size()), n);
      out.emplace_back(buf);
    }
    start = end + 1;
  }
  return out;
}

// One name with any number of bracket groups: their expansions multiply, the first varying slowest.
void expand_name(const std::string& name, const std::string& what, const std::string& list,
                 std::vector<std::string>& out) {
  std::vector<std::string> prefixes = {""};
  size_t pos = 0;
  while (pos < name.size()) {
    const size_t open = name.find('[', pos);
    const std::string text = name.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    if (text.find(']') != std::string::npos) throw bad_list(what, list, "unbalanced brackets");
    for (auto& p : prefixes) p += text;
    if (open == std::string::npos) break;
    const size_t close = name.find(']', open);
    if (close == std::string::npos) throw bad_list(what, list, "unbalanced brackets");
    const auto numbers = expand_brackets(name.substr(open + 1, close - open - 1), what, list);
    if (prefixes.size() * numbers.size() + out.size() > kMaxHosts) throw bad_list(what, list, "too many names");
    std::vector<std::string> next;
    next.reserve(prefixes.size() * numbers.size());
    for (const auto& p : prefixes)
      for (const auto& n : numbers) next.push_back(p + n);
    prefixes = std::move(next);
    pos = close + 1;
  }
  out.insert(out.end(), prefixes.begin(), prefixes.end());
}

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Names what is set and what is missing of a launcher's variables, for the refusal of an
// incomplete set.
std::string incomplete(const std::string& launcher, const EnvMap& env, const std::vector<std::string>& needed,
                       const std::string& fix) {
  std::string set, missing;
  for (const auto& k : needed) {
    std::string& list = lookup(env, k) ? set : missing;
    list += (list.empty() ? "" : ", ") + k;
  }
  return "fsdp: " + launcher + "'s variables are incomplete: " + (set.empty() ? "" : set + " set but ") + missing +
         " missing; " + fix;
}

// MASTER_ADDR/MASTER_PORT when given, else `default_addr` (for a job whose ranks are all on this
// host: the loopback) and a port from the job's id. `launcher` and `job_var` name things in errors.
void take_master(LaunchEnv& e, const EnvMap& env, const std::optional<std::string>& default_addr,
                 const std::string& addr_fix, const std::string& job_var) {
  auto addr = lookup(env, "MASTER_ADDR");
  auto port = lookup(env, "MASTER_PORT");
  std::vector<std::string> from;
  if (addr) {
    e.master_addr = *addr;
  } else if (e.all_local) {
    e.master_addr = "127.0.0.1";
    from.push_back("MASTER_ADDR unset: every rank is on this host");
  } else if (default_addr && e.world_size > 1) {
    e.master_addr = *default_addr;
    from.push_back("MASTER_ADDR unset: the first node");
  } else if (e.world_size > 1) {
    throw DistError("fsdp: " + e.launcher + " started " + std::to_string(e.world_size) + " ranks on several hosts (" +
                    std::to_string(e.local_world_size) + " on this one) but MASTER_ADDR is not set; " + addr_fix);
  }
  if (port) {
    e.master_port = parse_int("MASTER_PORT", *port, 0, "give a TCP port 1..65535, e.g. MASTER_PORT=29500");
    if (e.master_port > 65535) throw DistError("fsdp: MASTER_PORT=" + *port + " is not a TCP port (1..65535)");
    if (e.master_port == 0 && e.world_size > 1)
      throw DistError("fsdp: MASTER_PORT=0 cannot be shared between ranks; pick a port, e.g. MASTER_PORT=29500");
  } else if (auto job = lookup(env, job_var)) {
    e.master_port = port_from_job_id(*job);
    from.push_back("port from " + job_var);
  } else {
    from.push_back("MASTER_PORT unset: the default port");
  }
  for (const auto& f : from) e.master_from += (e.master_from.empty() ? "" : "; ") + f;
}

void check_layout(const LaunchEnv& e, const std::string& rank_var, const std::string& size_var,
                  const std::string& local_rank_var, const std::string& local_size_var) {
  if (e.rank >= e.world_size)
    throw DistError("fsdp: " + rank_var + "=" + std::to_string(e.rank) + " is not below " + size_var + "=" +
                    std::to_string(e.world_size));
  if (e.local_rank >= e.local_world_size)
    throw DistError("fsdp: " + local_rank_var + "=" + std::to_string(e.local_rank) + " is not below " + local_size_var +
                    "=" + std::to_string(e.local_world_size));
  if (e.local_world_size > e.world_size)
    throw DistError("fsdp: " + local_size_var + "=" + std::to_string(e.local_world_size) + " exceeds " + size_var +
                    "=" + std::to_string(e.world_size));
}

}  // namespace

std::vector<std::string> expand_nodelist(const std::string& list, const std::string& what) {
  if (list.empty()) throw bad_list(what, list, "empty");
  std::vector<std::string> out;
  for (const auto& name : split_top_level(list, what)) expand_name(name, what, list, out);
  return out;
}

int tasks_on_node(const std::string& tasks_per_node, int node_id) {
  const auto bad = [&](const std::string& why) {
    return DistError("fsdp: SLURM_STEP_TASKS_PER_NODE='" + tasks_per_node + "' " + why +
                     "; run under srun, which sets it, or set LOCAL_WORLD_SIZE");
  };
  int node = 0;
  size_t start = 0;
  while (start <= tasks_per_node.size()) {
    size_t end = tasks_per_node.find(',', start);
    if (end == std::string::npos) end = tasks_per_node.size();
    std::string item = tasks_per_node.substr(start, end - start);
    int repeat = 1;
    if (auto paren = item.find("(x"); paren != std::string::npos) {
      const std::string r = item.substr(paren + 2);
      if (r.size() < 2 || r.back() != ')' || !all_digits(r.substr(0, r.size() - 1))) throw bad("is malformed");
      repeat = std::atoi(r.c_str());
      item = item.substr(0, paren);
    }
    if (!all_digits(item) || item.size() > 9 || repeat < 1) throw bad("is malformed");
    if (node_id < node + repeat) return std::atoi(item.c_str());
    node += repeat;
    start = end + 1;
  }
  throw bad("names " + std::to_string(node) + " nodes, but this is node SLURM_NODEID=" + std::to_string(node_id));
}

int port_from_job_id(const std::string& job_id) { return 15000 + static_cast<int>(fnv1a(job_id) % 16000); }

std::optional<LaunchEnv> from_openmpi(const EnvMap& env) {
  const std::vector<std::string> needed = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                           "OMPI_COMM_WORLD_LOCAL_SIZE"};
  bool any = false, all = true;
  for (const auto& k : needed) {
    if (lookup(env, k))
      any = true;
    else
      all = false;
  }
  if (!any) return std::nullopt;
  const std::string fix = "start the program with Open MPI's mpirun, which sets all four, or with fsdprun";
  if (!all) throw DistError(incomplete("Open MPI", env, needed, fix));
  LaunchEnv e;
  e.from_launcher = true;
  e.launcher = "openmpi";
  e.rank = parse_int(needed[0], *lookup(env, needed[0]), 0, fix);
  e.world_size = parse_int(needed[1], *lookup(env, needed[1]), 1, fix);
  e.local_rank = parse_int(needed[2], *lookup(env, needed[2]), 0, fix);
  e.local_world_size = parse_int(needed[3], *lookup(env, needed[3]), 1, fix);
  check_layout(e, needed[0], needed[1], needed[2], needed[3]);
  e.all_local = e.local_world_size == e.world_size;
  // Open MPI 4 names its job OMPI_MCA_ess_base_jobid; Open MPI 5 (PRRTE) only PMIX_NAMESPACE.
  const std::string job_var = lookup(env, "OMPI_MCA_ess_base_jobid") ? "OMPI_MCA_ess_base_jobid" : "PMIX_NAMESPACE";
  take_master(e, env, std::nullopt,
              "Open MPI gives no master address: pass rank 0's host with `mpirun -x MASTER_ADDR=<host> ...` (and "
              "-x MASTER_PORT=<port> if the default is taken)",
              job_var);
  return e;
}

std::optional<LaunchEnv> from_slurm(const EnvMap& env) {
  auto step = lookup(env, "SLURM_STEP_ID");
  if (!step) return std::nullopt;
  // The batch script's, the extern and the interactive steps are not srun steps (Slurm numbers
  // them from 0xfffffffa upwards; some versions spell them out).
  if (*step == "batch" || *step == "extern" || *step == "interactive") return std::nullopt;
  if (all_digits(*step) && std::strtoull(step->c_str(), nullptr, 10) >= 0xfffffffaull) return std::nullopt;
  const std::vector<std::string> needed = {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"};
  const std::string fix = "start the program with srun (one task per rank), or with fsdprun inside the job";
  for (const auto& k : needed) {
    if (!lookup(env, k)) throw DistError(incomplete("Slurm (SLURM_STEP_ID=" + *step + ")", env, needed, fix));
  }
  LaunchEnv e;
  e.from_launcher = true;
  e.launcher = "slurm";
  e.rank = parse_int("SLURM_PROCID", *lookup(env, "SLURM_PROCID"), 0, fix);
  e.world_size = parse_int("SLURM_STEP_NUM_TASKS", *lookup(env, "SLURM_STEP_NUM_TASKS"), 1, fix);
  e.local_rank = parse_int("SLURM_LOCALID", *lookup(env, "SLURM_LOCALID"), 0, fix);
  auto nodes = lookup(env, "SLURM_STEP_NUM_NODES");
  auto per_node = lookup(env, "SLURM_STEP_TASKS_PER_NODE");
  if (per_node) {
    auto node_id = lookup(env, "SLURM_NODEID");
    e.local_world_size = tasks_on_node(*per_node, node_id ? parse_int("SLURM_NODEID", *node_id, 0, fix) : 0);
  } else if (nodes && parse_int("SLURM_STEP_NUM_NODES", *nodes, 1, fix) == 1) {
    e.local_world_size = e.world_size;
  } else {
    throw DistError(incomplete("Slurm (SLURM_STEP_ID=" + *step + ")", env,
                               {"SLURM_STEP_TASKS_PER_NODE", "SLURM_NODEID", "SLURM_STEP_NUM_NODES"}, fix));
  }
  check_layout(e, "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "the step's tasks on this node");
  e.all_local = e.local_world_size == e.world_size;
  std::optional<std::string> first;
  for (const char* k : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
    if (auto list = lookup(env, k)) {
      if (!lookup(env, "MASTER_ADDR")) first = expand_nodelist(*list, k).front();
      break;
    }
  }
  // The step id joins the job id: two steps of one job running side by side get different ports.
  EnvMap with_job = env;
  if (auto job = lookup(env, "SLURM_JOB_ID") ? lookup(env, "SLURM_JOB_ID") : lookup(env, "SLURM_JOBID"))
    with_job["SLURM_JOB_ID.SLURM_STEP_ID"] = *job + "." + *step;
  take_master(e, with_job, first, "set MASTER_ADDR to rank 0's host (srun sets SLURM_STEP_NODELIST, which names it)",
              "SLURM_JOB_ID.SLURM_STEP_ID");
  return e;
}

void refuse_unknown_launcher(const EnvMap& env) {
  // Rank variables of launchers whose contract we do not read: under any of them this process
  // may be one of several, and must not train alone.
  static const std::vector<std::pair<const char*, const char*>> known = {
      {"PMI_RANK", "MPICH/Intel MPI (Hydra)"},
      {"PMI_SIZE", "MPICH/Intel MPI (Hydra)"},
      {"PMIX_RANK", "a PMIx launcher (srun --mpi=pmix, prterun)"},
      {"MV2_COMM_WORLD_RANK", "MVAPICH2"},
      {"MPI_LOCALRANKID", "Intel MPI"},
      {"PALS_RANKID", "HPE Cray PALS"},
      {"ALPS_APP_PE", "Cray ALPS"},
      {"FLUX_TASK_RANK", "Flux"},
      {"JSM_NAMESPACE_RANK", "IBM jsrun"},
      {"OMPI_COMM_WORLD_NODE_RANK", "Open MPI"},
  };
  std::string found;
  for (const auto& [k, who] : known) {
    if (auto v = lookup(env, k)) found += (found.empty() ? "" : ", ") + std::string(k) + "=" + *v + " (" + who + ")";
  }
  if (found.empty()) return;
  throw DistError("fsdp: found " + found +
                  " but no variables this program reads, so it cannot tell which rank it is; start it with fsdprun, "
                  "torchrun, Open MPI's mpirun or srun, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from "
                  "that launcher's values");
}

}  // namespace fsdp::dist::detail
