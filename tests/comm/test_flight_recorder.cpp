// The flight recorder (fsdp/debug/flight_recorder.h) and its analysis tool fsdp-fr: the ring keeps
// exactly the last N records; a forced collective timeout (rank 1 skips a collective, or enters it
// past the timeout) writes one dump per rank with the expected last records and states, and
// fsdp-fr names the collective and the rank that never entered it; size 0 writes nothing; fsdp-fr
// rejects a missing, empty or damaged folder with one line.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "fsdp/debug/flight_recorder.h"
#include "fsdp/fsdp.h"
#include "multiprocess.h"
#include "subprocess.h"
#include "test_helpers.h"

using fsdp::comm::FlightRecorder;
using fsdp::comm::FlightState;
using fsdp::testing::RanksOptions;
using fsdp::testing::TempDir;
using nlohmann::json;

namespace {

// The dump's lines: [0] the header, then the records, oldest first.
std::vector<json> read_dump(const std::string& path) {
  std::ifstream in(path);
  TORCH_CHECK(in, "no dump at ", path);
  std::vector<json> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(json::parse(line));
  TORCH_CHECK(!lines.empty(), path, " is empty");
  return lines;
}

// The records of group 'world' in a dump.
std::vector<json> world_records(const std::vector<json>& dump) {
  std::vector<json> out;
  for (size_t i = 1; i < dump.size(); ++i) {
    if (dump[i]["group"] == "world") out.push_back(dump[i]);
  }
  return out;
}

size_t count_files(const std::string& dir) {
  if (!std::filesystem::exists(dir)) return 0;
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) n += e.is_regular_file() ? 1 : 0;
  return n;
}

fsdp::testing::ProcessResult run_fsdp_fr(const std::vector<std::string>& args) {
  fsdp::testing::ProcessSpec spec;
  spec.argv = {FSDP_FR_PATH};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.timeout = std::chrono::seconds(30);
  return fsdp::testing::run_process(spec);
}

void set_flag(const std::string& key) { fsdp::dist::store()->set(key, std::vector<uint8_t>{1}); }
void wait_flag(const std::string& key) { fsdp::dist::store()->wait({key}, std::chrono::seconds(60)); }

// Both ranks: all_reduce, broadcast; then rank 0 all-gathers while rank 1 (mode "skip") never
// does and, once rank 0 has timed out, dumps on demand; or (mode "late") enters the all-gather
// only after rank 0 timed out.
void forced_timeout(const std::string& mode) {
  auto world = fsdp::dist::world_comm();
  auto t = at::ones({10});
  world->all_reduce(t);
  world->broadcast(t, 0);
  auto in = at::full({4}, static_cast<double>(world->rank()));
  auto out = at::empty({8});
  if (world->rank() == 0) {
    std::string message;
    try {
      world->all_gather_into_tensor(out, in);
    } catch (const fsdp::comm::CommError& e) {
      message = e.what();
    }
    TORCH_CHECK(!message.empty(), "the all-gather did not fail");
    std::cout << "rank 0: " << message << std::endl;
    set_flag("test/rank0_failed");
    wait_flag("test/rank1_done");  // rank 0 hosts the store: stay until rank 1 is done
  } else if (mode == "skip") {
    wait_flag("test/rank0_failed");
    const std::string path = fsdp::comm::dump_flight_recorder("rank 1 skipped the all-gather");
    std::cout << "rank 1 dumped to '" << path << "'" << std::endl;
    set_flag("test/rank1_done");
  } else {
    wait_flag("test/rank0_failed");
    try {
      world->all_gather_into_tensor(out, in);
    } catch (const fsdp::comm::CommError& e) {
      std::cout << "rank 1: " << e.what() << std::endl;
    }
    set_flag("test/rank1_done");
  }
  std::_Exit(0);  // the world group is poisoned: skip its orderly teardown
}

RanksOptions timeout_options(const std::string& dir) {
  RanksOptions opts;
  opts.env["FSDP_COLLECTIVE_TIMEOUT_S"] = "2";
  opts.env["FSDP_FLIGHT_RECORDER_DIR"] = dir;
  opts.timeout = std::chrono::seconds(60);
  return opts;
}

}  // namespace

FSDP_RANK_WORKER(fr_skip) { forced_timeout("skip"); }
FSDP_RANK_WORKER(fr_late) { forced_timeout("late"); }

// Ten all-reduces under FSDP_FLIGHT_RECORDER_SIZE=3, then an on-demand dump.
FSDP_RANK_WORKER(fr_ring_from_env) {
  auto world = fsdp::dist::world_comm();
  TORCH_CHECK(FlightRecorder::process().capacity() == 3, "capacity ", FlightRecorder::process().capacity());
  for (int i = 0; i < 10; ++i) {
    auto t = at::ones({i + 1});
    world->all_reduce(t);
  }
  TORCH_CHECK(!fsdp::comm::dump_flight_recorder("test").empty(), "no dump written");
}

TEST(FlightRecorder, RingKeepsExactlyTheLastN) {
  FlightRecorder fr(5);
  const int world = fr.register_group("world", {0, 1}, 1);
  const int other = fr.register_group("pair", {1, 2}, 1);
  EXPECT_EQ(fr.register_group("world", {0, 1}, 1), world);  // same name and ranks: same group
  std::vector<uint64_t> tickets;
  for (int i = 0; i < 12; ++i) {
    tickets.push_back(fr.record(i % 3 == 2 ? other : world, "all_reduce", at::kFloat, i, i));
    fr.started(tickets.back());
    if (i != 10) fr.finished(tickets.back(), FlightState::Completed);
  }
  fr.finished(tickets[1], FlightState::Failed);  // long overwritten: must not touch the ring
  const auto recs = fr.snapshot();
  ASSERT_EQ(recs.size(), 5u);
  EXPECT_EQ(fr.recorded(), 12u);
  for (size_t i = 0; i < recs.size(); ++i) {
    EXPECT_EQ(recs[i].id, 7 + i);
    EXPECT_EQ(recs[i].in_numel, static_cast<int64_t>(7 + i));
    EXPECT_EQ(recs[i].state, i == 3 ? FlightState::Started : FlightState::Completed) << i;
  }
  // Per-group sequence numbers: records 0..11 go to world, world, pair, world, world, pair, ...;
  // ids 7..11 are world 5, pair 2, world 6, world 7, pair 3.
  const std::vector<uint64_t> seqs = {5, 2, 6, 7, 3};
  for (size_t i = 0; i < recs.size(); ++i) EXPECT_EQ(recs[i].seq, seqs[i]) << i;
  EXPECT_GT(recs[0].start_us, 0);
  EXPECT_GE(recs[0].end_us, recs[0].start_us);
  EXPECT_EQ(recs[3].end_us, 0);  // not over

  TempDir dir("fr_ring");
  const std::string path = fr.dump(dir.path, "unit test");
  EXPECT_EQ(path, dir / "rank_1.jsonl");
  const auto dump = read_dump(path);
  ASSERT_EQ(dump.size(), 6u);
  EXPECT_EQ(dump[0]["format"], "fsdp-flight-recorder");
  EXPECT_EQ(dump[0]["rank"], 1);
  EXPECT_EQ(dump[0]["capacity"], 5);
  EXPECT_EQ(dump[0]["recorded"], 12);
  EXPECT_EQ(dump[0]["groups"][0]["issued"], 8);
  EXPECT_EQ(dump[0]["groups"][1]["name"], "pair");
  EXPECT_EQ(dump[1]["seq"], 5);
  EXPECT_EQ(dump[4]["state"], "started");
  EXPECT_EQ(dump[5]["group"], "pair");
  EXPECT_EQ(dump[5]["dtype"], "Float");
  EXPECT_EQ(count_files(dir.path), 1u);  // no temporary left behind
}

TEST(FlightRecorder, SizeZeroIsOffAndBadSizesAreNamed) {
  FlightRecorder off(0);
  EXPECT_FALSE(off.enabled());
  EXPECT_EQ(off.register_group("world", {0, 1}, 0), -1);
  EXPECT_EQ(off.record(0, "all_reduce", at::kFloat, 1, 1), 0u);
  EXPECT_TRUE(off.snapshot().empty());

  setenv("FSDP_FLIGHT_RECORDER_SIZE", "lots", 1);
  EXPECT_ERROR_CONTAINS(FlightRecorder::capacity_from_env(), "FSDP_FLIGHT_RECORDER_SIZE='lots' is not a number");
  setenv("FSDP_FLIGHT_RECORDER_SIZE", "0", 1);
  EXPECT_EQ(FlightRecorder::capacity_from_env(), 0u);
  unsetenv("FSDP_FLIGHT_RECORDER_SIZE");
  setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "64", 1);  // PyTorch's name, when ours is unset
  EXPECT_EQ(FlightRecorder::capacity_from_env(), 64u);
  unsetenv("TORCH_NCCL_TRACE_BUFFER_SIZE");
  EXPECT_EQ(FlightRecorder::capacity_from_env(), 2000u);
}

TEST(FlightRecorder, ForcedTimeoutDumpsEveryRankAndFsdpFrNamesTheMissingRank) {
  TempDir dir("fr_skip");
  auto result = fsdp::testing::run_ranks(2, "fr_skip", timeout_options(dir.path));
  ASSERT_TRUE(result.all_ok()) << result.report();
  EXPECT_NE(
      result.ranks[0].output.find("Flight recorder: this rank's last collectives are in " + (dir / "rank_0.jsonl")),
      std::string::npos)
      << result.ranks[0].output;
  ASSERT_EQ(count_files(dir.path), 2u);

  const auto r0 = world_records(read_dump(dir / "rank_0.jsonl"));
  const auto r1 = world_records(read_dump(dir / "rank_1.jsonl"));
  ASSERT_GE(r0.size(), 3u);
  ASSERT_GE(r1.size(), 2u);
  const json& gather = r0.back();
  EXPECT_EQ(gather["op"], "all_gather_into_tensor");
  EXPECT_EQ(gather["state"], "timed out");
  EXPECT_EQ(gather["in_numel"], 4);
  EXPECT_EQ(gather["out_numel"], 8);
  EXPECT_GE(gather["end_us"].get<int64_t>() - gather["start_us"].get<int64_t>(), 1500000);  // ~ the 2 s timeout
  EXPECT_EQ(r0[r0.size() - 2]["op"], "broadcast");
  EXPECT_EQ(r0[r0.size() - 2]["state"], "completed");
  EXPECT_EQ(r0[r0.size() - 3]["op"], "all_reduce");
  EXPECT_EQ(r1.back()["op"], "broadcast");
  EXPECT_EQ(r1.back()["state"], "completed");
  EXPECT_EQ(r1.back()["seq"], r0[r0.size() - 2]["seq"]);  // the ranks' sequences line up

  const auto fr = run_fsdp_fr({dir.path});
  EXPECT_EQ(fr.exit_code, 1) << fr.output;
  const std::string seq = std::to_string(gather["seq"].get<int>());
  const std::string prev = std::to_string(gather["seq"].get<int>() - 1);
  EXPECT_NE(fr.output.find("first problem: group 'world' seq " + seq +
                           " all_gather_into_tensor: rank 0 entered (timed out), rank 1 never did (its last was seq " +
                           prev + " broadcast, completed)"),
            std::string::npos)
      << fr.output;
  std::cout << fr.output;
}

TEST(FlightRecorder, LateRankIsNamedAsEnteringAfterTheTimeout) {
  TempDir dir("fr_late");
  auto result = fsdp::testing::run_ranks(2, "fr_late", timeout_options(dir.path));
  ASSERT_TRUE(result.all_ok()) << result.report();
  ASSERT_EQ(count_files(dir.path), 2u) << result.report();
  const auto r1 = world_records(read_dump(dir / "rank_1.jsonl"));
  EXPECT_EQ(r1.back()["op"], "all_gather_into_tensor");
  EXPECT_NE(r1.back()["state"], "completed");
  const auto fr = run_fsdp_fr({dir.path, "--records"});
  EXPECT_EQ(fr.exit_code, 1) << fr.output;
  EXPECT_NE(fr.output.find("every rank entered, not every rank completed"), std::string::npos) << fr.output;
  EXPECT_NE(fr.output.find("rank 1 entered"), std::string::npos) << fr.output;
  EXPECT_NE(fr.output.find("after rank 0, which had already timed out"), std::string::npos) << fr.output;
  std::cout << fr.output;
}

// Two ranks' recorders, written into one folder: at seq 2 rank 0 all-gathers, rank 1 calls a
// barrier (what a rank that took another branch does).
TEST(FsdpFr, DivergingCollectivesAreNamed) {
  TempDir dir("fr_diverge");
  for (int rank = 0; rank < 2; ++rank) {
    FlightRecorder fr(100);
    const int world = fr.register_group("world", {0, 1}, rank);
    fr.register_group("solo", {rank}, rank);  // a group of one: nothing to line up
    for (const char* op : {"all_reduce", "broadcast"}) {
      const uint64_t t = fr.record(world, op, at::kFloat, 10, 10);
      fr.finished(t, FlightState::Completed);
    }
    const uint64_t t = rank == 0 ? fr.record(world, "all_gather_into_tensor", at::kFloat, 4, 8)
                                 : fr.record(world, "barrier", at::ScalarType::Undefined, 0, 0);
    fr.started(t);
    fr.finished(t, FlightState::TimedOut);
    fr.dump(dir.path, "test");
  }
  const auto fr = run_fsdp_fr({dir.path});
  EXPECT_EQ(fr.exit_code, 1) << fr.output;
  EXPECT_NE(
      fr.output.find("first problem: group 'world' seq 2 diverges: rank 0 called all_gather_into_tensor(Float, in 4, "
                     "out 8); rank 1 called barrier"),
      std::string::npos)
      << fr.output;
  std::cout << fr.output;
}

// A rank of the group wrote no dump (killed before it could): named, exit status 1.
TEST(FsdpFr, ARankWithoutADumpIsNamed) {
  TempDir dir("fr_absent");
  FlightRecorder fr(10);
  const int world = fr.register_group("world", {0, 1, 2}, 0);
  fr.finished(fr.record(world, "all_reduce", at::kFloat, 10, 10), FlightState::Completed);
  fr.dump(dir.path, "test");
  const auto out = run_fsdp_fr({dir.path});
  EXPECT_EQ(out.exit_code, 1) << out.output;
  EXPECT_NE(out.output.find("ranks 1,2 wrote no dump"), std::string::npos) << out.output;
}

TEST(FlightRecorder, SizeZeroWritesNothing) {
  TempDir dir("fr_off");
  auto opts = timeout_options(dir.path);
  opts.env["FSDP_FLIGHT_RECORDER_SIZE"] = "0";
  auto result = fsdp::testing::run_ranks(2, "fr_skip", opts);
  ASSERT_TRUE(result.all_ok()) << result.report();
  EXPECT_EQ(result.ranks[0].output.find("Flight recorder"), std::string::npos) << result.ranks[0].output;
  EXPECT_NE(result.ranks[1].output.find("rank 1 dumped to ''"), std::string::npos) << result.ranks[1].output;
  EXPECT_EQ(count_files(dir.path), 0u);
}

TEST(FlightRecorder, SizeFromTheEnvironmentKeepsTheLastN) {
  TempDir dir("fr_env");
  RanksOptions opts;
  opts.env["FSDP_FLIGHT_RECORDER_SIZE"] = "3";
  opts.env["FSDP_FLIGHT_RECORDER_DIR"] = dir.path;
  auto result = fsdp::testing::run_ranks(2, "fr_ring_from_env", opts);
  ASSERT_TRUE(result.all_ok()) << result.report();
  for (int r = 0; r < 2; ++r) {
    const auto dump = read_dump(dir / ("rank_" + std::to_string(r) + ".jsonl"));
    ASSERT_EQ(dump.size(), 4u) << r;
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(dump[static_cast<size_t>(1 + i)]["op"], "all_reduce");
      EXPECT_EQ(dump[static_cast<size_t>(1 + i)]["in_numel"], 8 + i);  // the last three of 1..10
      EXPECT_EQ(dump[static_cast<size_t>(1 + i)]["state"], "completed");
    }
  }
  const auto fr = run_fsdp_fr({dir.path});
  EXPECT_EQ(fr.exit_code, 0) << fr.output;
  EXPECT_NE(fr.output.find("no problem found"), std::string::npos) << fr.output;
}

TEST(FsdpFr, MissingEmptyOrDamagedFolderIsOneClearLine) {
  TempDir dir("fr_bad");
  auto missing = run_fsdp_fr({dir / "nope"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_NE(missing.output.find("fsdp-fr: no folder " + (dir / "nope")), std::string::npos) << missing.output;

  auto empty = run_fsdp_fr({dir.path});
  EXPECT_EQ(empty.exit_code, 2);
  EXPECT_NE(empty.output.find("holds no flight-recorder dumps"), std::string::npos) << empty.output;

  std::ofstream(dir / "rank_0.jsonl")
      << "{\"format\":\"fsdp-flight-recorder\",\"version\":1,\"rank\":0,\"capacity\":5,"
         "\"recorded\":1,\"groups\":[{\"name\":\"world\",\"ranks\":[0,1],\"issued\":1}]}\n"
         "{\"id\":0,\"group\":\"world\",\"gro";
  auto damaged = run_fsdp_fr({dir.path});
  EXPECT_EQ(damaged.exit_code, 2);
  EXPECT_NE(damaged.output.find(dir / "rank_0.jsonl" + " line 2: not JSON"), std::string::npos) << damaged.output;
  EXPECT_EQ(std::count(damaged.output.begin(), damaged.output.end(), '\n'), 1) << damaged.output;

  std::ofstream(dir / "rank_0.jsonl") << "{\"hello\":1}\n";
  auto foreign = run_fsdp_fr({dir.path});
  EXPECT_EQ(foreign.exit_code, 2);
  EXPECT_NE(foreign.output.find("not a flight-recorder dump"), std::string::npos) << foreign.output;
}
