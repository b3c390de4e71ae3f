// fsdp-fr: lines up the flight-recorder dumps of a job's ranks (fsdp/debug/flight_recorder.h:
// DIR/rank_<R>.jsonl, written when a collective fails or times out with FSDP_FLIGHT_RECORDER_DIR
// set) and names, per group, the first collective where the ranks diverge (different operation,
// dtype or sizes), that some rank never entered, or that some rank never completed:
//
//   fsdp-fr DIR            one line per group, the first problem of each, then a verdict
//   fsdp-fr DIR --records  also every rank's records around the problem
//
// Exit status: 0 the ranks that dumped agree on every collective they all recorded, 1 a problem
// was found (a divergence, a collective some rank never entered or never completed, a rank of a
// group with no dump), 2 a bad command line or a folder that cannot be read (missing, no dumps,
// a damaged dump).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr int kOk = 0, kProblem = 1, kUnusable = 2;

struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Record {
  uint64_t id = 0;
  uint64_t seq = 0;
  std::string op, dtype, state;
  int64_t in_numel = 0, out_numel = 0, start_us = 0, end_us = 0;
  std::string signature() const {
    if (op == "barrier") return "barrier";
    if (op == "all_to_all_uneven") return op + "(" + dtype + ")";  // each rank's splits are its own
    return op + "(" + dtype + ", in " + std::to_string(in_numel) + ", out " + std::to_string(out_numel) + ")";
  }
  bool completed() const { return state == "completed"; }
};

// A group as one rank saw it.
struct RankGroup {
  uint64_t issued = 0;              // collectives this rank issued on the group
  std::map<uint64_t, Record> recs;  // by seq: those still in its ring
};

struct Dump {
  int rank = -1;
  std::string file, host, reason;
  uint64_t capacity = 0, recorded = 0;
  std::map<std::string, RankGroup> groups;  // by group key
};

struct GroupInfo {
  std::string name;
  std::vector<int> ranks;
};

std::string group_key(const std::string& name, const std::vector<int>& ranks) {
  std::string k = name + "|";
  for (int r : ranks) k += std::to_string(r) + ",";
  return k;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? "," : "") + std::to_string(ranks[i]);
  return s;
}

std::string seconds(int64_t us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f s", static_cast<double>(us) / 1e6);
  return buf;
}

template <typename T>
T field(const json& j, const char* name, const std::string& where) {
  auto it = j.find(name);
  if (it == j.end()) throw InputError(where + ": no field \"" + name + "\"");
  try {
    return it->get<T>();
  } catch (const json::exception&) {
    throw InputError(where + ": field \"" + name + "\" has the wrong type");
  }
}

Dump load_dump(const fs::path& path, std::map<std::string, GroupInfo>& infos) {
  std::ifstream in(path);
  if (!in) throw InputError("cannot open " + path.string());
  Dump d;
  d.file = path.string();
  std::string line;
  size_t line_no = 0;
  const std::string damaged = " (a dump is written whole, then renamed: was the file edited or cut?)";
  while (std::getline(in, line)) {
    ++line_no;
    const std::string where = path.string() + " line " + std::to_string(line_no);
    if (line.empty()) continue;
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      throw InputError(where + ": not JSON" + damaged);
    }
    if (!j.is_object()) throw InputError(where + ": not a JSON object" + damaged);
    if (line_no == 1) {
      if (j.value("format", "") != "fsdp-flight-recorder") {
        throw InputError(where +
                         ": not a flight-recorder dump (the first line lacks \"format\":\"fsdp-flight-recorder\")");
      }
      if (field<int>(j, "version", where) != 1)
        throw InputError(where + ": format version " + j["version"].dump() + ", this fsdp-fr reads 1");
      d.rank = field<int>(j, "rank", where);
      d.host = j.value("host", "?");
      d.reason = j.value("reason", "");
      d.capacity = field<uint64_t>(j, "capacity", where);
      d.recorded = field<uint64_t>(j, "recorded", where);
      for (const json& g : field<json>(j, "groups", where)) {
        GroupInfo info{field<std::string>(g, "name", where), field<std::vector<int>>(g, "ranks", where)};
        const std::string key = group_key(info.name, info.ranks);
        infos.emplace(key, info);
        d.groups[key].issued = field<uint64_t>(g, "issued", where);
      }
      continue;
    }
    Record r;
    r.id = field<uint64_t>(j, "id", where);
    r.seq = field<uint64_t>(j, "seq", where);
    r.op = field<std::string>(j, "op", where);
    r.dtype = field<std::string>(j, "dtype", where);
    r.state = field<std::string>(j, "state", where);
    r.in_numel = field<int64_t>(j, "in_numel", where);
    r.out_numel = field<int64_t>(j, "out_numel", where);
    r.start_us = field<int64_t>(j, "start_us", where);
    r.end_us = field<int64_t>(j, "end_us", where);
    const std::string key =
        group_key(field<std::string>(j, "group", where), field<std::vector<int>>(j, "group_ranks", where));
    auto g = d.groups.find(key);
    if (g == d.groups.end()) throw InputError(where + ": a record of a group the header does not list" + damaged);
    if (r.seq >= g->second.issued)
      throw InputError(where + ": seq " + std::to_string(r.seq) + " beyond the group's issued count" + damaged);
    g->second.recs[r.seq] = r;
  }
  if (line_no == 0) throw InputError(path.string() + ": empty" + damaged);
  return d;
}

struct Finding {
  int64_t when_us = 0;  // for ordering the groups' problems
  std::string text;
};

// One group as the dumps see it: the ranks that wrote a dump and those that did not.
struct GroupView {
  const GroupInfo& info;
  const std::string& key;
  const std::map<int, Dump>& dumps;
  std::vector<int> present, absent;

  GroupView(const GroupInfo& i, const std::string& k, const std::map<int, Dump>& d) : info(i), key(k), dumps(d) {
    for (int r : info.ranks) (dumps.count(r) ? present : absent).push_back(r);
  }

  const RankGroup& rg(int r) const {
    static const RankGroup none;
    const auto& groups = dumps.at(r).groups;
    auto it = groups.find(key);
    return it == groups.end() ? none : it->second;
  }

  std::string last_text(int r) const {
    const RankGroup& g = rg(r);
    if (g.issued == 0) return std::string("it issued none on this group");
    const uint64_t last = g.issued - 1;
    auto it = g.recs.find(last);
    if (it == g.recs.end()) return "its last was seq " + std::to_string(last) + ", no longer in its ring";
    return "its last was seq " + std::to_string(last) + " " + it->second.op + ", " + it->second.state;
  }

  std::map<std::string, std::vector<int>> ranks_by_state(const std::vector<int>& ranks, uint64_t s) const {
    std::map<std::string, std::vector<int>> states;
    for (int r : ranks) states[rg(r).recs.at(s).state].push_back(r);
    return states;
  }
};

// Seq s entered by some present ranks only.
Finding missing_finding(const GroupView& v, uint64_t s, const std::string& head, const std::vector<int>& entered,
                        const std::vector<int>& missing) {
  const Record& first = v.rg(entered.front()).recs.at(s);
  std::string t = head + first.op + ": " + rank_list(entered) + " entered";
  const auto states = v.ranks_by_state(entered, s);
  t += " (";
  bool sep = false;
  for (const auto& [state, rs] : states) {
    t += std::string(sep ? "; " : "") + (states.size() > 1 ? rank_list(rs) + " " : "") + state;
    sep = true;
  }
  t += ")";
  for (int r : missing) t += ", rank " + std::to_string(r) + " never did (" + v.last_text(r) + ")";
  return Finding{first.start_us, t};
}

// Seq s entered by every present rank, but not with the same call everywhere.
std::optional<Finding> divergence_finding(const GroupView& v, uint64_t s, const std::string& head,
                                          const std::vector<int>& entered) {
  std::map<std::string, std::vector<int>> by_call;
  for (int r : entered) by_call[v.rg(r).recs.at(s).signature()].push_back(r);
  if (by_call.size() <= 1) return std::nullopt;
  std::string t = head + "diverges: ";
  bool sep = false;
  for (const auto& [call, rs] : by_call) {
    t += std::string(sep ? "; " : "") + rank_list(rs) + " called " + call;
    sep = true;
  }
  return Finding{v.rg(entered.front()).recs.at(s).start_us, t};
}

// A rank that entered only after another had given up (e.g. it was late past the timeout).
std::string late_entries(const GroupView& v, uint64_t s, const std::vector<int>& entered) {
  int64_t earliest_end = 0;
  int gave_up = -1;
  for (int r : entered) {
    const Record& rec = v.rg(r).recs.at(s);
    if (!rec.completed() && rec.end_us > 0 && (gave_up < 0 || rec.end_us < earliest_end)) {
      earliest_end = rec.end_us;
      gave_up = r;
    }
  }
  std::string t;
  for (int r : entered) {
    const Record& rec = v.rg(r).recs.at(s);
    if (gave_up >= 0 && r != gave_up && rec.start_us > earliest_end) {
      t += "; rank " + std::to_string(r) + " entered " + seconds(rec.start_us - v.rg(gave_up).recs.at(s).start_us) +
           " after rank " + std::to_string(gave_up) + ", which had already " + v.rg(gave_up).recs.at(s).state;
    }
  }
  return t;
}

// Seq s entered by every present rank with the same call, but not completed everywhere.
std::optional<Finding> incomplete_finding(const GroupView& v, uint64_t s, const std::string& head,
                                          const std::vector<int>& entered) {
  const auto states = v.ranks_by_state(entered, s);
  if (states.size() == 1 && states.count("completed")) return std::nullopt;
  const Record& first = v.rg(entered.front()).recs.at(s);
  std::string t = head + first.signature() +
                  (v.absent.empty() ? ": every rank entered, not every rank completed: " : ": not completed: ");
  bool sep = false;
  for (const auto& [state, rs] : states) {
    t += std::string(sep ? ", " : "") + rank_list(rs) + " " + state;
    sep = true;
  }
  t += late_entries(v, s, entered);
  return Finding{first.start_us, t};
}

// The problem at seq s, if any: a rank missing, ranks diverging, or the call not completed.
std::optional<Finding> problem_at(const GroupView& v, uint64_t s) {
  std::vector<int> entered, missing;
  for (int r : v.present) (v.rg(r).issued > s ? entered : missing).push_back(r);
  const std::string head = "group '" + v.info.name + "' seq " + std::to_string(s) + " ";
  if (!missing.empty()) return missing_finding(v, s, head, entered, missing);
  if (auto found = divergence_finding(v, s, head, entered)) return found;
  return incomplete_finding(v, s, head, entered);
}

// The records around the problem (or from `from` when there is none), each rank's.
std::string records_text(const GroupView& v, const std::optional<Finding>& found, uint64_t from, uint64_t problem_seq) {
  std::string text;
  const uint64_t lo = found ? (problem_seq >= 3 ? problem_seq - 3 : 0) : from;
  for (int r : v.present) {
    for (const auto& [s, rec] : v.rg(r).recs) {
      if (s < lo || (found && s > problem_seq + 1)) continue;
      text += "\n    rank " + std::to_string(r) + " seq " + std::to_string(s) + " " + rec.signature() + " " + rec.state;
    }
  }
  return text;
}

std::string seq_range(uint64_t from, uint64_t to) {
  return std::to_string(from) + ".." + (to == 0 ? std::string("(none)") : std::to_string(to - 1));
}

// The first problem of one group, if any.
std::optional<Finding> analyse_group(const GroupInfo& info, const std::string& key, const std::map<int, Dump>& dumps,
                                     std::string& summary, bool show_records) {
  const GroupView v(info, key, dumps);
  const std::string title = "group '" + info.name + "' (" + rank_list(info.ranks) + ")";
  if (v.present.empty()) {
    summary = title + ": no rank of it wrote a dump";
    return std::nullopt;
  }
  // Compare from the first seq every present rank still holds.
  uint64_t from = 0, to = 0;
  for (int r : v.present) {
    const RankGroup& g = v.rg(r);
    from = std::max(from, g.recs.empty() ? g.issued : g.recs.begin()->first);
    to = std::max(to, g.issued);
  }
  std::optional<Finding> found;
  uint64_t problem_seq = 0;
  for (uint64_t s = from; s < to && !found; ++s) {
    found = problem_at(v, s);
    if (found) problem_seq = s;
  }
  if (!found && !v.absent.empty()) {
    found = Finding{0, "group '" + info.name + "': " + rank_list(v.absent) +
                           " wrote no dump (killed, or never saw a collective fail?); " + rank_list(v.present) +
                           " agree on seq " + seq_range(from, to)};
  } else if (found && !v.absent.empty()) {
    found->text +=
        "; " + rank_list(v.absent) + " wrote no dump (stopped before it could, or none of its collectives failed)";
  }
  if (found) {
    summary = title + ": PROBLEM\n  " + found->text;
  } else {
    summary = title + ": consistent, seq " + seq_range(from, to) + " lined up on " + rank_list(v.present);
  }
  if (show_records) summary += records_text(v, found, from, problem_seq);
  return found;
}

int run(const std::string& dir, bool show_records) {
  if (!fs::exists(dir))
    throw InputError("no folder " + dir +
                     "; give the folder FSDP_FLIGHT_RECORDER_DIR named (fsdprun --flight-recorder-dir)");
  if (!fs::is_directory(dir))
    throw InputError(dir + " is not a folder; give the folder that holds the rank_<R>.jsonl dumps");
  static const std::regex dump_name("rank_([0-9]+)\\.jsonl");
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.is_regular_file() && std::regex_match(e.path().filename().string(), dump_name)) files.push_back(e.path());
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    throw InputError(dir +
                     " holds no flight-recorder dumps (rank_<R>.jsonl); a rank writes one when a collective fails "
                     "or times out with FSDP_FLIGHT_RECORDER_DIR set, or on fsdp::comm::dump_flight_recorder()");
  }
  std::map<std::string, GroupInfo> infos;
  std::map<int, Dump> dumps;
  for (const auto& f : files) {
    Dump d = load_dump(f, infos);
    if (dumps.count(d.rank))
      throw InputError(f.string() + " and " + dumps[d.rank].file + " both hold rank " + std::to_string(d.rank));
    dumps.emplace(d.rank, std::move(d));
  }
  std::vector<int> ranks;
  for (const auto& [r, d] : dumps) ranks.push_back(r);
  std::cout << "fsdp-fr: " << dir << ": " << dumps.size() << " dump" << (dumps.size() == 1 ? "" : "s") << " ("
            << rank_list(ranks) << "), " << infos.size() << " group" << (infos.size() == 1 ? "" : "s") << "\n";
  for (const auto& [r, d] : dumps) {
    std::cout << "  rank " << r << " on " << d.host << ": " << d.recorded << " collectives recorded, the last "
              << std::min(d.recorded, d.capacity) << " kept; dumped after: " << d.reason.substr(0, d.reason.find('\n'))
              << "\n";
  }
  std::vector<Finding> findings;
  for (const auto& [key, info] : infos) {
    if (info.ranks.size() < 2) continue;  // a group of one: nothing to line up
    std::string summary;
    if (auto f = analyse_group(info, key, dumps, summary, show_records)) findings.push_back(*f);
    std::cout << summary << "\n";
  }
  if (findings.empty()) {
    std::cout << "fsdp-fr: no problem found: the ranks agree on every collective they all recorded\n";
    return kOk;
  }
  std::stable_sort(findings.begin(), findings.end(),
                   [](const Finding& a, const Finding& b) { return a.when_us < b.when_us; });
  std::cout << "fsdp-fr: first problem: " << findings.front().text << "\n";
  return kProblem;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "fsdp-fr: line up the ranks' flight-recorder dumps (FSDP_FLIGHT_RECORDER_DIR) and name the first "
      "collective where they diverge, that a rank never entered or never completed"};
  std::string dir;
  bool records = false;
  app.add_option("DIR", dir, "folder of rank_<R>.jsonl dumps")->required();
  app.add_flag("--records", records, "also print every rank's records around each group's problem");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kOk : kUnusable;
  }
  try {
    return run(dir, records);
  } catch (const InputError& e) {
    std::cerr << "fsdp-fr: " << e.what() << "\n";
    return kUnusable;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-fr: " << e.what() << "\n";
    return kUnusable;
  }
}
