#include "preflight.h"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>

namespace train_gpt {
namespace {

constexpr double kVocab = 256;
constexpr double kRuntimeBytes = 256.0 * (1 << 20);

// A number of bytes from a cgroup or meminfo file; nullopt-like -1 for "max" or unreadable.
double read_number(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return -1;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  return end == s.c_str() ? -1 : v;
}

double meminfo_available() {
  std::ifstream f("/proc/meminfo");
  std::string key, unit;
  double kb = 0;
  while (f >> key >> kb) {
    std::getline(f, unit);
    if (key == "MemAvailable:") return kb * 1024;
  }
  return -1;
}

// The cgroup's remaining room (limit - usage + reclaimable page cache), or -1 when unlimited.
double cgroup_available(std::string& which) {
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  double best = -1;
  while (std::getline(f, line)) {
    if (line.rfind("0::", 0) == 0) {  // v2: this cgroup and its ancestors
      std::string rel = line.substr(3);
      for (;;) {
        const std::string dir = "/sys/fs/cgroup" + (rel == "/" ? std::string() : rel);
        const double max = read_number(dir + "/memory.max");
        if (max > 0) {
          double used = std::max(0.0, read_number(dir + "/memory.current"));
          std::ifstream stat(dir + "/memory.stat");
          std::string k;
          double v = 0;
          while (stat >> k >> v) {
            if (k == "inactive_file") used = std::max(0.0, used - v);
          }
          const double room = std::max(0.0, max - used);
          if (best < 0 || room < best) {
            best = room;
            which = "cgroup memory.max";
          }
        }
        if (rel.empty() || rel == "/") break;
        const size_t slash = rel.find_last_of('/');
        rel.resize(slash == 0 || slash == std::string::npos ? 1 : slash);  // the parent; "/" at the top
        rel[0] = '/';
      }
    } else if (line.find(":memory:") != std::string::npos) {  // v1
      const std::string rel = line.substr(line.find(":memory:") + 8);
      for (const std::string& dir : {"/sys/fs/cgroup/memory" + rel, std::string("/sys/fs/cgroup/memory")}) {
        const double limit = read_number(dir + "/memory.limit_in_bytes");
        if (limit <= 0 || limit >= 1e18) continue;  // "unlimited" is 2^63 rounded to a page
        const double room = std::max(0.0, limit - std::max(0.0, read_number(dir + "/memory.usage_in_bytes")));
        if (best < 0 || room < best) {
          best = room;
          which = "cgroup memory.limit_in_bytes";
        }
        break;
      }
    }
  }
  return best;
}

std::string i(int64_t v) { return std::to_string(v); }

}  // namespace

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) {
    bytes /= 1024;
    ++u;
  }
  char b[48];
  if (bytes >= 1e4)
    std::snprintf(b, sizeof b, "%.3g %s", bytes, units[u]);  // beyond EiB
  else
    std::snprintf(b, sizeof b, bytes < 10 && u > 0 ? "%.1f %s" : "%.0f %s", bytes, units[u]);
  return b;
}

MemoryEstimate estimate_memory(const Options& o, const ParameterCount& count, int world_size, int local_world_size) {
  // All in double: the options are bounded (options.h), but their products need not fit int64.
  const double C = static_cast<double>(o.dim), T = static_cast<double>(o.seq_len), L = static_cast<double>(o.layers),
               H = static_cast<double>(o.heads), V = o.vocab_size > 0 ? static_cast<double>(o.vocab_size) : kVocab;
  const double world = std::max(1, world_size);
  double shard = 1;  // ranks a parameter is sharded over
  if (o.parallel == "fsdp") shard = world;
  if (o.parallel == "hsdp")
    shard = o.shard_size > 0 ? static_cast<double>(o.shard_size) : std::max(1, local_world_size);
  const bool sharded = shard > 1 || o.parallel == "fsdp" || o.parallel == "hsdp";
  const bool bf16 = o.mixed_precision == "bf16";

  MemoryEstimate e;
  const double block = count.block, root = count.root;
  e.parameters = root + L * block;
  e.state_bytes = 16 * e.parameters / shard;
  if (sharded) e.working_bytes = ((bf16 ? 2 : 4) * 2 + 4) * std::max(block, root);
  // Sequences per micro-batch on this rank (at least one, before the divisibility check).
  const double b =
      std::max(1.0, std::ceil(static_cast<double>(o.batch_size) / (world * static_cast<double>(o.grad_accum))));
  const double a = bf16 ? 2 : 4;
  // Activation checkpointing: a checkpointed block keeps only its input (b·T·C) until its
  // backward recomputes it, when one block's full set is alive again.
  const int64_t every_k = o.checkpoint_every_kth_block();
  const double checkpointed = every_k > 0 ? std::floor(L / static_cast<double>(every_k)) : 0;
  const double per_block = a * b * T * (17 * C + H * T);
  e.activation_bytes = per_block * (L - checkpointed) + a * b * T * C * checkpointed +
                       (checkpointed > 0 ? per_block : 0) + 8 * b * H * T * T + 4 * b * T * (2 * C + 3 * V);
  if (!o.synthetic()) {
    struct stat st {};
    if (::stat(o.data.c_str(), &st) == 0 && S_ISREG(st.st_mode)) e.data_bytes = static_cast<double>(st.st_size);
  }
  e.runtime_bytes = kRuntimeBytes;
  return e;
}

AvailableMemory available_memory() {
  AvailableMemory m;
  if (const char* env = std::getenv("FSDP_TEST_MEMORY_AVAILABLE")) {
    const std::string s = env;
    char* end = nullptr;
    double v = std::strtod(s.c_str(), &end);
    const std::string suffix = end ? std::string(end) : std::string();
    const std::string units = "KMGT";
    double scale = 1;
    if (suffix.size() == 1 && units.find(static_cast<char>(std::toupper(suffix[0]))) != std::string::npos) {
      scale = std::pow(1024.0, 1 + static_cast<double>(units.find(static_cast<char>(std::toupper(suffix[0])))));
    } else if (!suffix.empty()) {
      v = -1;
    }
    if (end == s.c_str() || !std::isfinite(v) || v <= 0) {
      throw std::invalid_argument("FSDP_TEST_MEMORY_AVAILABLE='" + s +
                                  "' is not a size (give bytes, or a number with K, M, G or T, e.g. 16G)");
    }
    m.bytes = v * scale;
    m.source = "FSDP_TEST_MEMORY_AVAILABLE";
    return m;
  }
  m.bytes = meminfo_available();
  m.source = "MemAvailable";
  std::string which;
  const double cg = cgroup_available(which);
  if (cg >= 0 && (m.bytes < 0 || cg < m.bytes)) {
    m.bytes = cg;
    m.source = which;
  }
  return m;
}

std::string check_memory(const Options& o, const ParameterCount& count, int world_size, int local_world_size) {
  const MemoryEstimate e = estimate_memory(o, count, world_size, local_world_size);
  const AvailableMemory avail = available_memory();
  const int local = std::max(1, local_world_size);
  char params[32];
  std::snprintf(params, sizeof params, e.parameters >= 1e9 ? "%.3g" : "%.0f", e.parameters);
  const std::string parts = "parameters, gradients and AdamW state " + format_bytes(e.state_bytes) +
                            (e.working_bytes > 0 ? ", gathered unit " + format_bytes(e.working_bytes) : "") +
                            ", activations " + format_bytes(e.activation_bytes) +
                            (e.data_bytes > 0 ? ", data " + format_bytes(e.data_bytes) : "");
  const std::string per_rank = avail.bytes < 0 ? std::string("unknown") : format_bytes(avail.bytes / local);
  const std::string avail_text =
      per_rank + " available per rank (" + avail.source + " " + (avail.bytes < 0 ? "?" : format_bytes(avail.bytes)) +
      (local > 1 ? " / " + std::to_string(local) + " ranks on this host" : std::string()) + ")";
  if (avail.bytes >= 0 && e.total() > avail.bytes / local) {
    // Name the options that drive the largest part.
    const bool model_dominates =
        e.state_bytes + e.working_bytes >= e.activation_bytes && e.state_bytes + e.working_bytes >= e.data_bytes;
    const bool data_dominates = !model_dominates && e.data_bytes > e.activation_bytes;
    std::string culprit, fix;
    if (model_dominates && !o.init_from.empty()) {
      // The sizes are config.json's: --layers/--dim cannot change them (--init-from refuses them).
      culprit = o.init_from + "/config.json's model (" + i(o.layers) + " layers, hidden " + i(o.dim) + ", vocab " +
                i(o.vocab_size) + ": " + params + " parameters)";
      fix = o.parallel == "fsdp" || o.parallel == "hsdp"
                ? "shard it over more ranks (more processes or hosts), or fine-tune a smaller model"
                : "shard it with --parallel fsdp over more ranks, or fine-tune a smaller model";
    } else if (model_dominates) {
      culprit = "--layers " + i(o.layers) + " --dim " + i(o.dim) + " (" + params + " parameters)";
      fix = o.parallel == "fsdp" || o.parallel == "hsdp"
                ? "lower --layers or --dim, or shard over more ranks"
                : "lower --layers or --dim, or shard them with --parallel fsdp";
    } else if (data_dominates) {
      culprit = "--data " + o.data;
      fix = "use a smaller --data file";
    } else {
      culprit = "--batch-size " + i(o.batch_size) + " --seq-len " + i(o.seq_len) + " (" +
                i(static_cast<int64_t>(
                    std::max(1.0, std::ceil(static_cast<double>(o.batch_size) /
                                            (std::max(1, world_size) * static_cast<double>(o.grad_accum)))))) +
                " sequences per micro-batch on a rank)";
      fix = "lower --batch-size or --seq-len, or raise --grad-accum";
    }
    throw std::invalid_argument(culprit + " need about " + format_bytes(e.total()) + " per rank (" + parts +
                                "), more than the " + avail_text + ": " + fix);
  }
  return "memory: about " + format_bytes(e.total()) + " per rank (" + parts + "); " + avail_text;
}

}  // namespace train_gpt
