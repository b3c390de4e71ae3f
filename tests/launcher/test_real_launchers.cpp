// Real launchers start train_gpt as they would start a PyTorch program: Open MPI's mpirun (the
// ranks find each other from OMPI_COMM_WORLD_* alone) and torchrun 2.x (its agent's store) train
// as under fsdprun. A process that sees a launcher we do not read refuses to train alone. Each
// test skips, saying why, when its launcher is absent (Debian's openmpi-bin, which
// scripts/setup.sh installs; torchrun from python3-torch 2.x, e.g. the sid chroot of
// scripts/libtorch2-check.sh).
#include <sched.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <thread>

#include "../trainer/train_gpt_harness.h"
#include "netns_hosts.h"

using namespace train_gpt_test;

extern char** environ;

namespace {

// Every launcher's variables in the test's own environment (the test may itself run under srun
// or mpirun): the children must see only the launcher each test starts.
std::vector<std::string> launcher_scrub() {
  std::vector<std::string> out = kScrub;
  for (char** p = environ; *p != nullptr; ++p) {
    const std::string kv(*p);
    const std::string name = kv.substr(0, kv.find('='));
    for (const char* prefix : {"OMPI_", "PMIX_", "PMI_", "SLURM_", "MV2_", "TORCHELASTIC_", "FSDP_STORE_FILE"}) {
      if (name.rfind(prefix, 0) == 0) out.push_back(name);
    }
  }
  return out;
}

ProcessSpec scrubbed(std::vector<std::string> argv, std::chrono::milliseconds timeout) {
  ProcessSpec spec = spec_of(std::move(argv), timeout);
  spec.env_unset = launcher_scrub();
  return spec;
}

// The first executable `name` on PATH, or "".
std::string on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    const std::string candidate = (dir.empty() ? "." : dir) + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// Waits, at most 90 s, until the metrics file (one line per step) holds `steps` lines or the job
// has ended: a stop signal sent then reaches ranks that are training.
void wait_for_steps(Child& job, const std::string& metrics, size_t steps) {
  const auto written = [&] {
    std::ifstream in(metrics);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return count(text, "\n");
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  while (written() < steps && std::chrono::steady_clock::now() < deadline && !job.try_wait())
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

// Open MPI's mpirun on PATH, or "" (with the reason in `why`).
std::string find_open_mpi(std::string& why) {
  if (const std::string candidate = on_path("mpirun"); !candidate.empty()) {
    auto version = run_process(scrubbed({candidate, "--version"}, 30s));
    if (version.output.find("Open MPI") == std::string::npos && version.output.find("OpenRTE") == std::string::npos) {
      why = candidate + " is not Open MPI's (--version: " + version.output.substr(0, 80) + ")";
      return "";
    }
    return candidate;
  }
  why = "mpirun is not on PATH (install Debian's openmpi-bin, as scripts/setup.sh does)";
  return "";
}

// `mpirun -np 2 train_gpt ...` trains one job of two ranks (not two jobs of one) with fsdprun's
// losses.
TEST(Mpirun, TrainsWithFsdprunsLosses) {
  std::string why;
  const std::string mpirun = find_open_mpi(why);
  if (mpirun.empty()) GTEST_SKIP() << why;
  TempDir dir;
  const auto ref = ranks(2, tiny(dir / "fsdprun.jsonl"));
  ASSERT_TRUE(ref.ok()) << ref.output;

  std::vector<std::string> argv = {mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                                   // what spec_of sets, passed on explicitly (remote-launch safe)
                                   "-x", "OMP_NUM_THREADS", "-x", "CUDA_VISIBLE_DEVICES", kTrainGpt};
  const auto args = tiny(dir / "mpirun.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = run_process(scrubbed(argv, 120s));
  ASSERT_TRUE(r.ok()) << r.output;
  // Rank 0 says whose variables it read: one line, once (not two one-rank jobs).
  EXPECT_EQ(count(r.output, "fsdp: launcher openmpi (OMPI_COMM_WORLD_*): 2 ranks, 2 on this host, master 127.0.0.1:"),
            1u)
      << r.output;
  EXPECT_TRUE(trained(r.output)) << r.output;
  const auto got = losses(dir / "mpirun.jsonl");
  EXPECT_EQ(got.size(), 6u);
  expect_close(got, losses(dir / "fsdprun.jsonl"), 1e-5);
}

// SIGTERM to mpirun alone (not its process group): Open MPI 4.1's mpirun sends SIGCONT and SIGTERM
// to every rank, waits odls_base_sigkill_timeout seconds (default 1), then SIGKILLs what is left.
// With the wait raised the ranks agree to stop, save a checkpoint of the last finished step holding
// both ranks' shards and exit 0; mpirun itself exits 1 (it reports the job as aborted), after
// about twice the wait.
TEST(Mpirun, SigtermToMpirunSavesACheckpointOnEveryRank) {
  std::string why;
  const std::string mpirun = find_open_mpi(why);
  if (mpirun.empty()) GTEST_SKIP() << why;
  TempDir dir;
  std::vector<std::string> argv = {mpirun,
                                   "--allow-run-as-root",
                                   "--oversubscribe",
                                   "--mca",
                                   "odls_base_sigkill_timeout",
                                   "3",
                                   "-np",
                                   "2",
                                   "-x",
                                   "OMP_NUM_THREADS",
                                   "-x",
                                   "CUDA_VISIBLE_DEVICES",
                                   kTrainGpt};
  const auto args =
      tiny(dir / "m.jsonl", {"--steps", "1000000", "--checkpoint-dir", dir / "ck", "--checkpoint-every", "1000000"});
  argv.insert(argv.end(), args.begin(), args.end());
  Child job(scrubbed(argv, 120s));
  wait_for_steps(job, dir / "m.jsonl", 3);
  ASSERT_FALSE(job.try_wait()) << job.result().output;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(job.pid(), SIGTERM), 0);  // mpirun's pid only, as `kill PID` would
  const auto r = job.wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("SIGTERM to mpirun: exited %d after %.1f s\n", r.exit_code, seconds);
  EXPECT_EQ(r.exit_code, 1) << r.output;  // Open MPI's status for a job ended by a signal to mpirun
  EXPECT_LT(seconds, 30.0) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: stopped by a signal after step"), 1u) << r.output;
  EXPECT_EQ(count(r.output, "again: exiting now without saving"), 0u) << r.output;
  int saved = 0;
  for (const auto& e : fs::directory_iterator(dir / "ck")) {
    if (e.path().filename().string().rfind("step_", 0) == 0) {
      ++saved;
      EXPECT_EQ(data_files(e.path().string()).size(), 2u) << e.path();
    }
  }
  EXPECT_EQ(saved, 1) << r.output;
}

// A rank of a launcher whose variables we do not read stops before training, naming them.
TEST(Mpirun, UnknownLauncherIsRefusedNotTrainedAlone) {
  TempDir dir;
  std::vector<std::string> argv = {kTrainGpt};
  const auto args = tiny(dir / "m.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  auto spec = scrubbed(argv, 60s);
  spec.env_set["PMI_RANK"] = std::string("1");  // MPICH's Hydra (mpiexec.hydra -np 2)
  spec.env_set["PMI_SIZE"] = std::string("2");
  const auto r = run_process(spec);
  EXPECT_FALSE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("found PMI_RANK=1 (MPICH/Intel MPI (Hydra))"), std::string::npos) << r.output;
  EXPECT_FALSE(trained(r.output)) << r.output;
  EXPECT_FALSE(fs::exists(dir / "m.jsonl"));
}

// scripts/libtorch2-check.sh sets FSDP_REQUIRE_PYTHON_CHECKS=1 where it installs python3-torch:
// there a torchrun test that cannot run fails instead of skipping.
bool python_checks_required() {
  const char* v = std::getenv("FSDP_REQUIRE_PYTHON_CHECKS");
  return v != nullptr && std::string(v) == "1";
}

// torchrun 2.x as a command line (argv[0..]), or empty with the reason in `why`. Debian's
// python3-torch is built without libuv and its torchrun asks TCPStore for libuv regardless of
// USE_LIBUV, so plain `torchrun` dies there before any worker starts; torchrun_without_libuv.py
// then starts torchrun's own main() with TCPStore's use_libuv off (`--check` says which is needed).
std::vector<std::string> find_torchrun(std::string& why) {
  // Probed once per test binary (each probe is a Python start importing torch: seconds).
  static const auto probe = [] {
    std::pair<std::vector<std::string>, std::string> found;  // the command line, or the reason
    const std::string torchrun = on_path("torchrun");
    const std::string python = on_path("python3");
    if (torchrun.empty() || python.empty()) {
      found.second = "torchrun is not on PATH (python3-torch 2.x provides it)";
      return found;
    }
    const auto check = run_process(scrubbed({python, TORCHRUN_WITHOUT_LIBUV, "--check"}, 60s));
    if (check.exit_code == 0) {
      found.first = {torchrun};
    } else if (check.exit_code == 3) {
      std::printf(
          "torchrun: this PyTorch (%s) is built without libuv; starting torchrun's main() with "
          "TCPStore(use_libuv=False) (tests/launcher/torchrun_without_libuv.py)\n",
          check.output.substr(0, check.output.find('\n')).c_str());
      found.first = {python, TORCHRUN_WITHOUT_LIBUV};
    } else if (check.exit_code == 4) {
      // Debian 12's torchrun (1.13) fails on Python 3.11 before any worker starts: not a test of ours.
      found.second = "torchrun's torch is not 2.x: " + check.output;
    } else {
      found.second = "torchrun_without_libuv.py --check failed: " + check.output;
    }
    return found;
  }();
  why = probe.second;
  return probe.first;
}

}  // namespace

// `torchrun --no_python --nproc_per_node 2 train_gpt ...` (torchrun 2.x: its agent hosts the store,
// TORCHELASTIC_USE_AGENT_STORE=True, the workers are its clients) gives fsdprun's losses.
TEST(Torchrun, TrainsWithFsdprunsLosses) {
  std::string why;
  std::vector<std::string> argv = find_torchrun(why);
  if (argv.empty() && python_checks_required()) FAIL() << why << " (FSDP_REQUIRE_PYTHON_CHECKS=1: must run here)";
  if (argv.empty()) GTEST_SKIP() << why;
  TempDir dir;
  const auto ref = ranks(2, tiny(dir / "fsdprun.jsonl"));
  ASSERT_TRUE(ref.ok()) << ref.output;
  for (std::string a : {"--no_python", "--nproc_per_node", "2", "--master_port"}) argv.push_back(a);
  argv.push_back(std::to_string(fsdp::testing::pick_free_port()));
  argv.push_back(kTrainGpt);
  const auto args = tiny(dir / "torchrun.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = run_process(scrubbed(argv, 180s));
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_EQ(count(r.output, "fsdp: launcher torchrun"), 1u) << r.output;
  EXPECT_NE(r.output.find("the launcher's store under /worker/attempt_0"), std::string::npos) << r.output;
  const auto got = losses(dir / "torchrun.jsonl");
  EXPECT_EQ(got.size(), 6u);
  expect_close(got, losses(dir / "fsdprun.jsonl"), 1e-5);
}

// `torchrun --max_restarts 1`: rank 1 SIGKILLs itself before step 4 (train_gpt's test hook,
// first attempt only); torchrun's agent stops rank 0 and starts attempt 1, whose workers join the
// agent's store under /worker/attempt_1, resume from step_000002 and end bit for bit where an
// uninterrupted run ends (losses, parameters and optimizer state).
TEST(Torchrun, RestartResumesFromTheLastCheckpoint) {
  std::string why;
  std::vector<std::string> argv = find_torchrun(why);
  if (argv.empty() && python_checks_required()) FAIL() << why << " (FSDP_REQUIRE_PYTHON_CHECKS=1: must run here)";
  if (argv.empty()) GTEST_SKIP() << why;
  TempDir dir;
  const auto ckpt = [&](const std::string& name, std::vector<std::string> extra) {
    return tiny(dir / (name + ".jsonl"), apply({"--checkpoint-dir", dir / name, "--checkpoint-every", "2"}, extra));
  };
  const auto a = ranks(2, ckpt("a", {}));
  ASSERT_TRUE(a.ok()) << a.output;
  for (std::string s :
       {"--no_python", "--nproc_per_node", "2", "--max_restarts", "1", "--monitor_interval", "0.1", "--master_port"})
    argv.push_back(s);
  argv.push_back(std::to_string(fsdp::testing::pick_free_port()));
  argv.push_back(kTrainGpt);
  const auto args = ckpt("b", {"--resume"});
  argv.insert(argv.end(), args.begin(), args.end());
  auto spec = scrubbed(argv, 240s);
  spec.env_set["FSDP_TEST_KILL_AT_STEP"] = "3";
  const auto t0 = std::chrono::steady_clock::now();
  const auto b = run_process(spec);
  std::printf("torchrun with a restart: %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  ASSERT_TRUE(b.ok()) << b.output;
  EXPECT_NE(b.output.find("rank 1 kills itself"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("the launcher's store under /worker/attempt_1"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resumed " + (dir / "b") + "/step_000002 at step 2"), std::string::npos) << b.output;
  EXPECT_EQ(losses(dir / "b.jsonl"), losses(dir / "a.jsonl"));
  expect_same_checkpoint_tensors(fs::path(dir / "a") / "step_000006", fs::path(dir / "b") / "step_000006");
}

// torchrun's multi-node form, two agents on this machine (nodes of one process each): the c10d
// rendezvous (--rdzv_backend c10d, the identical command twice, no --node_rank) forms one job of
// two ranks whose workers share the rendezvous store (the agent store), and it trains with
// fsdprun's losses.
TEST(Torchrun, TwoNodesOfC10dRendezvousTrainWithFsdprunsLosses) {
  std::string why;
  std::vector<std::string> argv = find_torchrun(why);
  if (argv.empty() && python_checks_required()) FAIL() << why << " (FSDP_REQUIRE_PYTHON_CHECKS=1: must run here)";
  if (argv.empty()) GTEST_SKIP() << why;
  TempDir dir;
  const auto ref = ranks(2, tiny(dir / "fsdprun.jsonl"));
  ASSERT_TRUE(ref.ok()) << ref.output;
  const std::string endpoint = "127.0.0.1:" + std::to_string(fsdp::testing::pick_free_port());
  for (std::string a : {"--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                        endpoint.c_str(), "--rdzv_id", "two-nodes",
                        // the address the agents publish (by default this host's name, which a chroot
                        // may not resolve)
                        "--local_addr", "127.0.0.1", "--no_python"})
    argv.push_back(a);
  argv.push_back(kTrainGpt);
  const auto node = [&](const std::string& metrics) {
    std::vector<std::string> a = argv;
    const auto args = tiny(metrics);
    a.insert(a.end(), args.begin(), args.end());
    return scrubbed(a, 180s);
  };
  // Each node writes the metrics file of its rank 0 only if it holds global rank 0: one file.
  Child first(node(dir / "torchrun.jsonl"));
  Child second(node(dir / "torchrun.jsonl"));
  const auto r0 = first.wait();
  const auto r1 = second.wait();
  ASSERT_TRUE(r0.ok()) << r0.output;
  ASSERT_TRUE(r1.ok()) << r1.output;
  const std::string both = r0.output + r1.output;
  EXPECT_EQ(count(both, "fsdp: launcher torchrun (RANK, WORLD_SIZE, ...): 2 ranks, 1 on this host"), 1u) << both;
  EXPECT_EQ(count(both, "the launcher's store under /worker/attempt_0"), 1u) << both;
  const auto got = losses(dir / "torchrun.jsonl");
  EXPECT_EQ(got.size(), 6u);
  expect_close(got, losses(dir / "fsdprun.jsonl"), 1e-5);
}

// torchrun's multi-node form on two hosts: network namespaces (tests/multihost/netns_hosts.h), each
// process with the host's address as its host name (FSDP_NETNS_HOSTNAME=1: the name resolves, as a
// cluster node's does, which torchrun's c10d rendezvous needs). The identical command on both hosts,
// the endpoint on host 0 (whose agent hosts the store because the endpoint names it), no
// --node_rank and no --local_addr: one job of two ranks that trains with fsdprun's losses.
TEST(Torchrun, TwoHostsOfC10dRendezvousTrainWithFsdprunsLosses) {
  std::string why;
  std::vector<std::string> argv = find_torchrun(why);
  if (argv.empty() && python_checks_required()) FAIL() << why << " (FSDP_REQUIRE_PYTHON_CHECKS=1: must run here)";
  if (argv.empty()) GTEST_SKIP() << why;
  if (const std::string no = fsdp::testing::NetnsHosts::unavailable(); !no.empty()) {
    // CI's LibTorch 2.x half runs as root with iproute2 in its chroot: there this test must run.
    if (python_checks_required()) FAIL() << no << " (FSDP_REQUIRE_PYTHON_CHECKS=1: must run here)";
    GTEST_SKIP() << no;
  }
  TempDir dir;
  const auto ref = ranks(2, tiny(dir / "fsdprun.jsonl"));
  ASSERT_TRUE(ref.ok()) << ref.output;
  fsdp::testing::NetnsHosts hosts(2);
  const std::string endpoint = hosts.addr(0) + ":29400";  // torchrun's default port: each host is a fresh stack
  for (std::string a : {"--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
                        endpoint.c_str(), "--rdzv_id", "two-hosts", "--no_python"})
    argv.push_back(a);
  argv.push_back(kTrainGpt);
  const auto args = tiny(dir / "torchrun.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  const auto on_host = [&](int k) {
    ProcessSpec spec = hosts.spec(k, argv, 180s);
    spec.env_unset = launcher_scrub();
    spec.env_set["OMP_NUM_THREADS"] = "1";
    spec.env_set["CUDA_VISIBLE_DEVICES"] = "";
    spec.env_set["FSDP_NETNS_HOSTNAME"] = "1";
    return spec;
  };
  const auto t0 = std::chrono::steady_clock::now();
  Child second(on_host(1));  // the non-host node first: it waits for the store on host 0
  Child first(on_host(0));
  const auto r0 = first.wait();
  const auto r1 = second.wait();
  std::printf("torchrun on two hosts: %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  ASSERT_TRUE(r0.ok()) << r0.output;
  ASSERT_TRUE(r1.ok()) << r1.output;
  const std::string both = r0.output + r1.output;
  EXPECT_EQ(count(both, "fsdp: launcher torchrun (RANK, WORLD_SIZE, ...): 2 ranks, 1 on this host, master " +
                            hosts.addr(0) + ":"),
            1u)
      << both;
  EXPECT_EQ(count(both, "the launcher's store under /worker/attempt_0"), 1u) << both;
  const auto got = losses(dir / "torchrun.jsonl");
  EXPECT_EQ(got.size(), 6u);
  expect_close(got, losses(dir / "fsdprun.jsonl"), 1e-5);
}

// Slurm: a one-machine cluster (scripts/slurm-local.sh) for this suite; `srun -n 2 train_gpt`, an
// sbatch script and scancel, each as a user would run them.
class Slurm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (on_path("srun").empty() || on_path("sbatch").empty() || on_path("scancel").empty()) {
      skip_ = "srun/sbatch are not on PATH (Debian's slurm-client, slurmd, slurmctld, munge)";
      return;
    }
    if (::geteuid() != 0) {
      skip_ = "a local Slurm cluster needs root (slurmd)";
      return;
    }
    dir_ = std::make_unique<fsdp::testing::TempDir>("slurm_local");
    const int port = fsdp::testing::pick_free_port();
    ProcessSpec up = scrubbed({SLURM_LOCAL_SCRIPT, "up"}, 60s);
    // OMP_NUM_THREADS=1, as clusters often export it: the node still gets every core (nproc
    // honours the variable; a node of 1 CPU left `srun -n 2` waiting forever).
    up.env_set = {{"SLURM_LOCAL_DIR", dir_->path + "/cluster"},
                  {"SLURM_LOCAL_PORT", std::to_string(port)},
                  {"OMP_NUM_THREADS", "1"}};
    const auto r = run_process(up);
    if (!r.ok()) {
      skip_ = "scripts/slurm-local.sh up failed here: " + r.output;
      return;
    }
    conf_ = dir_->path + "/cluster/slurm.conf";
  }
  static void TearDownTestSuite() {
    if (!conf_.empty()) {
      ProcessSpec down = scrubbed({SLURM_LOCAL_SCRIPT, "down"}, 60s);
      down.env_set = {{"SLURM_LOCAL_DIR", dir_->path + "/cluster"}};
      run_process(down);
    }
    dir_.reset();
  }
  void SetUp() override {
    if (!skip_.empty()) GTEST_SKIP() << skip_;
  }
  // A command of the cluster's, with the test's environment scrubbed of launchers.
  static ProcessResult slurm(std::vector<std::string> argv, std::chrono::milliseconds timeout = 120s) {
    ProcessSpec spec = scrubbed(std::move(argv), timeout);
    spec.env_set["SLURM_CONF"] = conf_;
    return run_process(spec);
  }
  static inline std::unique_ptr<fsdp::testing::TempDir> dir_;
  static inline std::string conf_, skip_;
};

// The node's CPUs are the cores this process may run on, though `up` ran with OMP_NUM_THREADS=1.
TEST_F(Slurm, NodeHasEveryCoreWhateverOmpNumThreads) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof set, &set), 0);
  std::ifstream in(conf_);
  const std::string conf((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(conf.find(" CPUs=" + std::to_string(CPU_COUNT(&set)) + " "), std::string::npos) << conf;
}

TEST_F(Slurm, SrunTrainsWithFsdprunsLosses) {
  TempDir dir;
  const auto ref = ranks(2, tiny(dir / "fsdprun.jsonl"));
  ASSERT_TRUE(ref.ok()) << ref.output;
  std::vector<std::string> argv = {on_path("srun"), "-N", "1", "-n", "2", "--kill-on-bad-exit=1", kTrainGpt};
  const auto args = tiny(dir / "srun.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = slurm(argv);
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_EQ(count(r.output,
                  "fsdp: launcher slurm (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID): 2 ranks, 2 "
                  "on this host, master 127.0.0.1:"),
            1u)
      << r.output;
  expect_close(losses(dir / "srun.jsonl"), losses(dir / "fsdprun.jsonl"), 1e-5);
}

// An sbatch script whose srun step trains; the batch shell itself is no rank (no SLURM_STEP_ID).
TEST_F(Slurm, SbatchScriptTrainsWithFsdprunsLosses) {
  TempDir dir;
  const auto ref = ranks(2, tiny(dir / "fsdprun.jsonl"));
  ASSERT_TRUE(ref.ok()) << ref.output;
  std::string cmd = "srun " + kTrainGpt;
  for (const auto& a : tiny(dir / "sbatch.jsonl")) cmd += " '" + a + "'";
  {
    std::ofstream script(dir / "job.sh");
    script << "#!/bin/bash\n#SBATCH -N 1\n#SBATCH -n 2\n"
           << "echo \"batch shell: SLURM_STEP_ID=${SLURM_STEP_ID:-unset}\"\n"
           << "export OMP_NUM_THREADS=1\n"
           << cmd << "\n";
  }
  const auto r = slurm({on_path("sbatch"), "--wait", "-o", dir / "job.out", dir / "job.sh"});
  std::ifstream out(dir / "job.out");
  const std::string job_output((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  ASSERT_TRUE(r.ok()) << r.output << job_output;
  EXPECT_NE(job_output.find("batch shell: SLURM_STEP_ID=unset"), std::string::npos) << job_output;
  EXPECT_EQ(count(job_output, "fsdp: launcher slurm"), 1u) << job_output;
  expect_close(losses(dir / "sbatch.jsonl"), losses(dir / "fsdprun.jsonl"), 1e-5);
}

// scancel sends SIGTERM to every task of the step: the ranks agree to stop, save a checkpoint of
// the last finished step and exit 0, well within the cluster's KillWait (30 s).
TEST_F(Slurm, ScancelSavesACheckpointOnEveryRank) {
  TempDir dir;
  const std::string name = "fsdp-stop-" + std::to_string(::getpid());
  std::vector<std::string> argv = {on_path("srun"), "-J", name, "-N", "1", "-n", "2", kTrainGpt};
  const auto args =
      tiny(dir / "m.jsonl", {"--steps", "1000000", "--checkpoint-dir", dir / "ck", "--checkpoint-every", "1000000"});
  argv.insert(argv.end(), args.begin(), args.end());
  ProcessSpec spec = scrubbed(argv, 120s);
  spec.env_set["SLURM_CONF"] = conf_;
  Child job(spec);
  wait_for_steps(job, dir / "m.jsonl", 3);
  ASSERT_FALSE(job.try_wait()) << job.result().output;
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(slurm({on_path("scancel"), "-n", name}, 30s).ok());
  const auto r = job.wait();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_LT(seconds, 30.0) << r.output;
  EXPECT_EQ(count(r.output, "train_gpt: stopped by a signal after step"), 1u) << r.output;
  // The checkpoint holds every rank's shard.
  int saved = 0;
  for (const auto& e : fs::directory_iterator(dir / "ck")) {
    if (e.path().filename().string().rfind("step_", 0) == 0) {
      ++saved;
      EXPECT_EQ(data_files(e.path().string()).size(), 2u) << e.path();
    }
  }
  EXPECT_EQ(saved, 1) << r.output;
}

// srun on two hosts: network namespaces (tests/multihost/netns_hosts.h), a slurmd in each
// (scripts/slurm-local.sh with SLURM_LOCAL_HOSTS=2: node names are the hosts' addresses,
// slurmctld in host 0, munge's socket shared through the file system), srun started in host 0.
// `srun -N 2 -n 2` puts one rank on each host; they meet at the first node of
// SLURM_STEP_NODELIST (10.77.0.[1-2] -> 10.77.0.1) and train with fsdprun's losses.
TEST(SlurmTwoHosts, SrunOnTwoNodesTrainsWithFsdprunsLosses) {
  if (on_path("srun").empty()) GTEST_SKIP() << "srun is not on PATH (Debian's slurm-client, slurmd, slurmctld, munge)";
  if (const std::string no = fsdp::testing::NetnsHosts::unavailable(); !no.empty()) GTEST_SKIP() << no;
  TempDir dir;
  const auto ref = ranks(2, tiny(dir / "fsdprun.jsonl"));
  ASSERT_TRUE(ref.ok()) << ref.output;
  fsdp::testing::NetnsHosts hosts(2);
  const std::string cluster = dir / "cluster";
  const auto slurm_local = [&](const std::string& what) {
    ProcessSpec spec = scrubbed({SLURM_LOCAL_SCRIPT, what}, 60s);
    spec.env_set = {{"SLURM_LOCAL_DIR", cluster}, {"SLURM_LOCAL_HOSTS", "2"}, {"FSDP_NETNS_PREFIX", hosts.prefix()}};
    return run_process(spec);
  };
  const auto up = slurm_local("up");
  // Stopped before the hosts go (their destructor kills whatever is left in them).
  struct Down {
    std::function<void()> run;
    ~Down() { run(); }
  } down{[&] { slurm_local("down"); }};
  ASSERT_TRUE(up.ok()) << up.output;
  std::vector<std::string> argv = {on_path("srun"), "-N", "2", "-n", "2", "--kill-on-bad-exit=1", kTrainGpt};
  const auto args = tiny(dir / "srun.jsonl");
  argv.insert(argv.end(), args.begin(), args.end());
  ProcessSpec spec = hosts.spec(0, argv, 120s);
  spec.env_unset = launcher_scrub();
  spec.env_set = {{"OMP_NUM_THREADS", "1"},
                  {"CUDA_VISIBLE_DEVICES", ""},
                  {"SLURM_CONF", cluster + "/slurm.conf"},
                  {"FSDP_NETNS_PREFIX", hosts.prefix()},
                  {"FSDP_NETNS_HOSTNAME", "1"}};
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_process(spec);
  std::printf("srun on two hosts: %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  ASSERT_TRUE(r.ok()) << r.output;
  EXPECT_EQ(count(r.output,
                  "fsdp: launcher slurm (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID): 2 ranks, 1 on this "
                  "host, master " +
                      hosts.addr(0) + ":"),
            1u)
      << r.output;
  const auto got = losses(dir / "srun.jsonl");
  EXPECT_EQ(got.size(), 6u);
  expect_close(got, losses(dir / "fsdprun.jsonl"), 1e-5);
}
