// fsdprun's worker logs, as torchrun's: --log-dir (per-rank stdout/stderr files), --redirects,
// --tee, --local-ranks-filter; and a failed worker's last lines, printed with its rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "subprocess.h"
#include "test_helpers.h"

namespace {

using namespace std::chrono_literals;
using fsdp::testing::ProcessResult;
using fsdp::testing::ProcessSpec;
using fsdp::testing::run_process;
namespace fs = std::filesystem;

const std::string kFsdprun = FSDPRUN_PATH;
const std::string kProbe = PROBE_PATH;

ProcessResult fsdprun(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 60s) {
  ProcessSpec spec;
  spec.argv = {kFsdprun};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  spec.env_unset = {"RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    "MASTER_ADDR",
                    "MASTER_PORT",
                    "TORCHELASTIC_RESTART_COUNT",
                    "TORCHELASTIC_USE_AGENT_STORE"};
  spec.timeout = timeout;
  return run_process(spec);
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// DIR/<run id>_node0/attempt_0/<local rank>/<stream>.log
std::string log_file(const std::string& dir, int local, const std::string& stream) {
  return dir + "/job_node0/attempt_0/" + std::to_string(local) + "/" + stream + ".log";
}

TEST(LauncherLogs, LogDirWritesEachWorkersStreamsToFilesAndStillToTheConsole) {
  fsdp::testing::TempDir dir("fsdprun_logs");
  auto r = fsdprun({"--nproc-per-node", "2", "--rdzv-id", "job", "--log-dir", dir.path, "--", kProbe, "output"});
  ASSERT_TRUE(r.ok()) << r.output;
  for (int local = 0; local < 2; ++local) {
    // Unprefixed, one file per stream, the partial last line completed.
    EXPECT_EQ(read(log_file(dir.path, local, "stdout")), "out-line\npartial-no-newline\n") << local;
    EXPECT_EQ(read(log_file(dir.path, local, "stderr")), "err-line\n") << local;
    EXPECT_TRUE(has(r.output, "[rank" + std::to_string(local) + "]: out-line")) << r.output;
    EXPECT_TRUE(has(r.output, "[rank" + std::to_string(local) + "]: err-line")) << r.output;
  }
  EXPECT_TRUE(has(r.output, "fsdprun: worker logs in " + dir.path + "/job_node0")) << r.output;
}

TEST(LauncherLogs, RedirectsTakeAStreamOffTheConsole) {
  fsdp::testing::TempDir dir("fsdprun_logs");
  auto r = fsdprun(
      {"--nproc-per-node", "2", "--rdzv-id", "job", "--log-dir", dir.path, "--redirects", "1", "--", kProbe, "output"});
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_FALSE(has(r.output, "out-line")) << r.output;  // stdout only in the files
  EXPECT_TRUE(has(r.output, "[rank1]: err-line")) << r.output;
  EXPECT_EQ(read(log_file(dir.path, 1, "stdout")), "out-line\npartial-no-newline\n");
  EXPECT_FALSE(fs::exists(log_file(dir.path, 1, "stderr")));  // stderr neither redirected nor teed
}

TEST(LauncherLogs, TeePerLocalRankAndShortFlags) {
  fsdp::testing::TempDir dir("fsdprun_logs");
  auto r = fsdprun({"--nproc-per-node", "2", "--rdzv-id", "job", "--log-dir", dir.path, "-t", "1:3", "-r", "0:2", "--",
                    kProbe, "output"});
  ASSERT_TRUE(r.ok()) << r.output;
  // local rank 0: stderr redirected (file only); local rank 1: both teed (files and console).
  EXPECT_EQ(read(log_file(dir.path, 0, "stderr")), "err-line\n");
  EXPECT_FALSE(fs::exists(log_file(dir.path, 0, "stdout")));
  EXPECT_FALSE(has(r.output, "[rank0]: err-line")) << r.output;
  EXPECT_TRUE(has(r.output, "[rank0]: out-line")) << r.output;
  EXPECT_EQ(read(log_file(dir.path, 1, "stdout")), "out-line\npartial-no-newline\n");
  EXPECT_EQ(read(log_file(dir.path, 1, "stderr")), "err-line\n");
  EXPECT_TRUE(has(r.output, "[rank1]: err-line")) << r.output;
  EXPECT_TRUE(has(r.output, "[rank1]: out-line")) << r.output;
}

TEST(LauncherLogs, RedirectsWithoutLogDirUseANewFolderThatIsNamed) {
  fsdp::testing::TempDir tmp("fsdprun_logs");
  ProcessSpec spec;
  spec.argv = {kFsdprun, "--nproc-per-node", "1", "--rdzv-id", "job", "--redirects", "3", "--", kProbe, "output"};
  spec.env_set["TMPDIR"] = tmp.path;
  spec.timeout = 60s;
  auto r = run_process(spec);
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_FALSE(has(r.output, "out-line")) << r.output;
  const std::string marker = "fsdprun: worker logs in ";
  auto at = r.output.find(marker);
  ASSERT_NE(at, std::string::npos) << r.output;
  std::string base = r.output.substr(at + marker.size());
  base = base.substr(0, base.find("/attempt_"));
  EXPECT_EQ(base.rfind(tmp.path + "/fsdprun_logs_", 0), 0u) << base;
  EXPECT_EQ(read(base + "/attempt_0/0/stdout.log"), "out-line\npartial-no-newline\n");
}

TEST(LauncherLogs, LocalRanksFilterShowsOnlyThoseRanksOnTheConsole) {
  fsdp::testing::TempDir dir("fsdprun_logs");
  auto r = fsdprun({"--nproc-per-node", "3", "--rdzv-id", "job", "--log-dir", dir.path, "--local-ranks-filter", "1",
                    "--", kProbe, "output"});
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_TRUE(has(r.output, "[rank1]: out-line")) << r.output;
  EXPECT_FALSE(has(r.output, "[rank0]:")) << r.output;
  EXPECT_FALSE(has(r.output, "[rank2]:")) << r.output;
  EXPECT_EQ(read(log_file(dir.path, 2, "stdout")), "out-line\npartial-no-newline\n");  // files keep everything
}

// The failed worker's output was redirected away from the console: its last 20 lines are
// printed, with its rank, after the failure line (and not when they reached the console).
TEST(LauncherLogs, FailedWorkersLastLinesArePrintedWithItsRank) {
  fsdp::testing::TempDir dir("fsdprun_logs");
  auto r = fsdprun({"--nproc-per-node", "2", "--rdzv-id", "job", "--log-dir", dir.path, "--redirects", "3", "--",
                    kProbe, "lines", "30", "7"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(has(r.output, "fsdprun: last 20 output lines of rank 1:\n  [rank1]: r1 line 11\n")) << r.output;
  EXPECT_TRUE(has(r.output, "  [rank1]: r1 line 30\n")) << r.output;
  EXPECT_FALSE(has(r.output, "r1 line 10\n")) << r.output;
  EXPECT_FALSE(has(r.output, "r0 line")) << r.output;  // rank 0 succeeded: its output stays in its files
  EXPECT_TRUE(has(r.output, "worker rank 1 (pid")) << r.output;
  EXPECT_TRUE(has(read(log_file(dir.path, 1, "stdout")), "r1 line 1\n"));
  // Output that reached the console is not repeated.
  auto shown = fsdprun({"--nproc-per-node", "2", "--", kProbe, "lines", "30", "7"});
  EXPECT_EQ(shown.exit_code, 1) << shown.output;
  EXPECT_TRUE(has(shown.output, "[rank1]: r1 line 30\n")) << shown.output;
  EXPECT_FALSE(has(shown.output, "output lines of rank")) << shown.output;
}

TEST(LauncherLogs, BadValuesGetOneClearLine) {
  for (const auto& [args, expected] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--redirects", "4", kProbe, "env"}, "--redirects '4' is not valid; give 0 (none), 1 (stdout)"},
           {{"--tee", "0:1,x", kProbe, "env"}, "--tee '0:1,x' is not valid"},
           {{"--local-ranks-filter", "a", kProbe, "env"}, "--local-ranks-filter 'a' is not valid"},
           {{"--log-dir", "", kProbe, "env"}, "--log-dir is empty"}}) {
    auto r = fsdprun(args, 30s);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_TRUE(has(r.output, expected)) << r.output;
  }
}

TEST(LauncherLogs, HelpDocumentsTheLogAndHeartbeatFlags) {
  auto r = fsdprun({"--help"}, 30s);
  ASSERT_TRUE(r.ok()) << r.output;
  for (const char* flag : {"--log-dir", "-r, --redirects", "-t, --tee", "--local-ranks-filter", "--heartbeat-timeout-s",
                           "{stdout,stderr}.log", "last output lines"}) {
    EXPECT_TRUE(has(r.output, flag)) << flag;
  }
}

}  // namespace
