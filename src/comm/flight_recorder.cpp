#include "fsdp/debug/flight_recorder.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <stdexcept>
#include <utility>

namespace fsdp::comm {

namespace {

constexpr size_t kDefaultCapacity = 2000;
constexpr size_t kMaxCapacity = size_t{1} << 24;  // 16M records (~1 GB): anything more is a typo

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

void append_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void append_ranks(std::string& out, const std::vector<int>& ranks) {
  out += '[';
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(ranks[i]);
  }
  out += ']';
}

size_t parse_capacity(const char* name, const char* value) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(value, &end, 10);
  if (end == value || *end != '\0' || errno != 0 || n < 0 || static_cast<unsigned long long>(n) > kMaxCapacity) {
    throw std::invalid_argument(std::string("fsdp: ") + name + "='" + value +
                                "' is not a number of flight-recorder records; give 0 (off) to " +
                                std::to_string(kMaxCapacity) + ", e.g. " + name + "=2000");
  }
  return static_cast<size_t>(n);
}

}  // namespace

const char* flight_state_name(FlightState state) {
  switch (state) {
    case FlightState::Scheduled: return "scheduled";
    case FlightState::Started: return "started";
    case FlightState::Completed: return "completed";
    case FlightState::Failed: return "failed";
    case FlightState::TimedOut: return "timed out";
  }
  return "?";
}

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity), ring_(capacity) {}

size_t FlightRecorder::capacity_from_env() {
  if (const char* v = std::getenv("FSDP_FLIGHT_RECORDER_SIZE")) return parse_capacity("FSDP_FLIGHT_RECORDER_SIZE", v);
  if (const char* v = std::getenv("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    return parse_capacity("TORCH_NCCL_TRACE_BUFFER_SIZE", v);
  return kDefaultCapacity;
}

FlightRecorder& FlightRecorder::process() {
  static FlightRecorder* recorder = new FlightRecorder(capacity_from_env());  // never destroyed: usable at exit
  return *recorder;
}

int FlightRecorder::find_or_add_group_locked(const std::string& name, const std::vector<int>& global_ranks,
                                             int own_global_rank) {
  if (own_rank_ < 0 && global_ranks.size() > 1) own_rank_ = own_global_rank;  // not a group of one (single_process)
  // Newest first: a program's collectives mostly go to the group it made last.
  for (size_t i = groups_.size(); i-- > 0;) {
    if (groups_[i].name == name && groups_[i].global_ranks == global_ranks) return static_cast<int>(i);
  }
  groups_.push_back(FlightGroup{name, global_ranks, 0});
  return static_cast<int>(groups_.size() - 1);
}

int FlightRecorder::register_group(const std::string& name, const std::vector<int>& global_ranks, int own_global_rank) {
  if (!enabled()) return -1;
  std::lock_guard<std::mutex> lock(mu_);
  return find_or_add_group_locked(name, global_ranks, own_global_rank);
}

uint64_t FlightRecorder::record_locked(int group, const char* op, c10::ScalarType dtype, int64_t in_numel,
                                       int64_t out_numel, int64_t start_us) {
  const uint64_t id = next_id_++;
  FlightRecord& r = ring_[id % capacity_];
  r.id = id;
  r.group = group;
  r.seq = groups_[static_cast<size_t>(group)].issued++;
  r.op = op;
  r.dtype = dtype;
  r.in_numel = in_numel;
  r.out_numel = out_numel;
  r.start_us = start_us;
  r.end_us = 0;
  r.state = FlightState::Scheduled;
  return id + 1;
}

uint64_t FlightRecorder::record(int group, const char* op, c10::ScalarType dtype, int64_t in_numel, int64_t out_numel) {
  if (capacity_ == 0 || group < 0) return 0;
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<size_t>(group) >= groups_.size()) return 0;
  return record_locked(group, op, dtype, in_numel, out_numel, t);
}

uint64_t FlightRecorder::record(const std::string& group_name, const std::vector<int>& global_ranks,
                                int own_global_rank, const char* op, c10::ScalarType dtype, int64_t in_numel,
                                int64_t out_numel) {
  if (capacity_ == 0) return 0;
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mu_);
  const int group = find_or_add_group_locked(group_name, global_ranks, own_global_rank);
  return record_locked(group, op, dtype, in_numel, out_numel, t);
}

void FlightRecorder::started(uint64_t ticket) {
  if (ticket == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  FlightRecord& r = ring_[(ticket - 1) % capacity_];
  if (r.id == ticket - 1 && r.state == FlightState::Scheduled) r.state = FlightState::Started;
}

void FlightRecorder::finished(uint64_t ticket, FlightState state) {
  if (ticket == 0) return;
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mu_);
  FlightRecord& r = ring_[(ticket - 1) % capacity_];
  if (r.id != ticket - 1) return;  // overwritten since: the ring moved on
  r.state = state;
  r.end_us = t;
}

std::vector<FlightRecord> FlightRecorder::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightRecord> out;
  if (capacity_ == 0) return out;
  const uint64_t first = next_id_ > capacity_ ? next_id_ - capacity_ : 0;
  out.reserve(static_cast<size_t>(next_id_ - first));
  for (uint64_t id = first; id < next_id_; ++id) out.push_back(ring_[id % capacity_]);
  return out;
}

std::vector<FlightGroup> FlightRecorder::groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  return groups_;
}

uint64_t FlightRecorder::recorded() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_id_;
}

int FlightRecorder::own_rank() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (own_rank_ >= 0) return own_rank_;
  if (const char* r = std::getenv("RANK")) return std::atoi(r);
  return 0;
}

std::string FlightRecorder::to_jsonl(const std::string& reason) const {
  // Copy under the lock, format outside it.
  std::vector<FlightRecord> records;
  std::vector<FlightGroup> groups;
  uint64_t total = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    groups = groups_;
    total = next_id_;
    const uint64_t first = total > capacity_ ? total - capacity_ : 0;
    records.reserve(static_cast<size_t>(total - first));
    for (uint64_t id = first; id < total; ++id) records.push_back(ring_[id % capacity_]);
  }
  const int rank = own_rank();
  char host[256] = {0};
  if (gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "?");

  std::string out;
  out.reserve(256 + records.size() * 200);
  out += "{\"format\":\"fsdp-flight-recorder\",\"version\":1,\"rank\":" + std::to_string(rank) +
         ",\"pid\":" + std::to_string(getpid()) + ",\"host\":";
  append_json_string(out, host);
  out += ",\"capacity\":" + std::to_string(capacity_) + ",\"recorded\":" + std::to_string(total) + ",\"reason\":";
  append_json_string(out, reason);
  out += ",\"dumped_at_us\":" + std::to_string(now_us()) + ",\"groups\":[";
  for (size_t i = 0; i < groups.size(); ++i) {
    if (i) out += ',';
    out += "{\"name\":";
    append_json_string(out, groups[i].name);
    out += ",\"ranks\":";
    append_ranks(out, groups[i].global_ranks);
    out += ",\"issued\":" + std::to_string(groups[i].issued) + "}";
  }
  out += "]}\n";
  for (const FlightRecord& r : records) {
    const FlightGroup& g = groups.at(static_cast<size_t>(r.group));
    out += "{\"id\":" + std::to_string(r.id) + ",\"group\":";
    append_json_string(out, g.name);
    out += ",\"group_ranks\":";
    append_ranks(out, g.global_ranks);
    out += ",\"seq\":" + std::to_string(r.seq) + ",\"op\":";
    append_json_string(out, r.op);
    out += ",\"dtype\":";
    append_json_string(out, c10::toString(r.dtype));
    out += ",\"in_numel\":" + std::to_string(r.in_numel) + ",\"out_numel\":" + std::to_string(r.out_numel) +
           ",\"start_us\":" + std::to_string(r.start_us) + ",\"end_us\":" + std::to_string(r.end_us) + ",\"state\":";
    append_json_string(out, flight_state_name(r.state));
    out += "}\n";
  }
  return out;
}

std::string FlightRecorder::dump(const std::string& dir, const std::string& reason) const {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw std::runtime_error("fsdp: cannot create the flight-recorder folder " + dir + ": " + ec.message());
  const std::string path = (fs::path(dir) / ("rank_" + std::to_string(own_rank()) + ".jsonl")).string();
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  const std::string text = to_jsonl(reason);
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    f.flush();
    if (!f) {
      fs::remove(tmp, ec);
      throw std::runtime_error("fsdp: cannot write the flight-recorder dump " + tmp);
    }
  }
  fs::rename(tmp, path, ec);
  if (ec) {
    fs::remove(tmp, ec);
    throw std::runtime_error("fsdp: cannot rename " + tmp + " to " + path + ": " + ec.message());
  }
  return path;
}

std::string FlightRecorder::dump_on_failure(const std::string& reason) const {
  if (!enabled()) return "";
  const char* dir = std::getenv("FSDP_FLIGHT_RECORDER_DIR");
  if (dir == nullptr || *dir == '\0') return "";
  try {
    return dump(dir, reason);
  } catch (const std::exception& e) {
    std::cerr << e.what() << " (the flight recorder's dump after a failed collective)\n";
    return "";
  }
}

namespace detail {

namespace {
thread_local uint64_t t_issued = 0;
}

void flight_issue(const std::string& group_name, const std::vector<int>& global_ranks, int own_global_rank,
                  const char* op, c10::ScalarType dtype, int64_t in_numel, int64_t out_numel) {
  FlightRecorder& fr = FlightRecorder::process();
  if (!fr.enabled()) return;
  // A previous operation of this thread that threw before making its Work: it failed.
  if (t_issued != 0) fr.finished(std::exchange(t_issued, 0), FlightState::Failed);
  t_issued = fr.record(group_name, global_ranks, own_global_rank, op, dtype, in_numel, out_numel);
}

uint64_t flight_take_issued() {
  const uint64_t ticket = std::exchange(t_issued, 0);
  if (ticket != 0) FlightRecorder::process().started(ticket);
  return ticket;
}

}  // namespace detail

std::string dump_flight_recorder(const std::string& reason, const std::string& dir) {
  FlightRecorder& fr = FlightRecorder::process();
  if (!fr.enabled()) return "";
  std::string where = dir;
  if (where.empty()) {
    const char* env = std::getenv("FSDP_FLIGHT_RECORDER_DIR");
    if (env == nullptr || *env == '\0') return "";
    where = env;
  }
  return fr.dump(where, reason);
}

}  // namespace fsdp::comm
