// Launcher detection: torchrun's, Open MPI's and Slurm's variables, their precedence when
// launchers nest, the refusals, and Slurm's host-list expansion. Real launchers: tests/launcher.
#include <gtest/gtest.h>

#include "dist/launchers.h"  // src/dist: the library's private header
#include "fsdp/dist/env.h"

using fsdp::dist::DistError;
using fsdp::dist::parse_launch_env;
using fsdp::dist::detail::expand_nodelist;
using fsdp::dist::detail::port_from_job_id;
using fsdp::dist::detail::tasks_on_node;
using Env = std::map<std::string, std::string>;
using Names = std::vector<std::string>;

namespace {

std::string error_of(const Env& env) {
  try {
    parse_launch_env(env);
  } catch (const DistError& e) {
    return e.what();
  }
  return "";
}

std::string nodelist_error(const std::string& list) {
  try {
    expand_nodelist(list);
  } catch (const DistError& e) {
    return e.what();
  }
  return "";
}

// What `mpirun -np 4` on two hosts gives rank 3 (Open MPI 4.1, as printed by `mpirun ... env`).
Env ompi(int rank = 3, int size = 4, int local_rank = 1, int local_size = 2) {
  return {{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
          {"OMPI_COMM_WORLD_SIZE", std::to_string(size)},
          {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(local_rank)},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", std::to_string(local_size)},
          {"OMPI_COMM_WORLD_NODE_RANK", std::to_string(local_rank)},
          {"OMPI_MCA_ess_base_jobid", "1299185665"},
          {"PMIX_RANK", std::to_string(rank)}};
}

// What `srun -N 2 -n 3` gives its task 2 (the second node runs one task).
Env srun_step() {
  return {{"SLURM_JOB_ID", "4242"},
          {"SLURM_STEP_ID", "0"},
          {"SLURM_PROCID", "2"},
          {"SLURM_LOCALID", "0"},
          {"SLURM_NODEID", "1"},
          {"SLURM_STEP_NUM_TASKS", "3"},
          {"SLURM_STEP_NUM_NODES", "2"},
          {"SLURM_STEP_TASKS_PER_NODE", "2,1"},
          {"SLURM_NTASKS", "3"},
          {"SLURM_STEP_NODELIST", "gpu[007-008]"},
          {"SLURM_NODELIST", "gpu[001-008]"}};
}

// An sbatch script's (or salloc shell's) environment: a job, but no srun step.
Env sbatch_shell() {
  return {{"SLURM_JOB_ID", "4242"}, {"SLURM_NTASKS", "4"}, {"SLURM_NODELIST", "node[1-2]"},  {"SLURM_PROCID", "0"},
          {"SLURM_LOCALID", "0"},   {"SLURM_NODEID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x2)"}};
}

Env torchrun_worker() {
  return {{"RANK", "1"},
          {"WORLD_SIZE", "2"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "2"},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", "29511"},
          {"TORCHELASTIC_RUN_ID", "none"},
          {"TORCHELASTIC_RESTART_COUNT", "0"},
          {"TORCHELASTIC_USE_AGENT_STORE", "True"}};
}

Env merged(Env a, const Env& b) {
  for (const auto& [k, v] : b) a[k] = v;
  return a;
}

}  // namespace

TEST(Nodelist, PlainNamesAndLists) {
  EXPECT_EQ(expand_nodelist("node7"), Names({"node7"}));
  EXPECT_EQ(expand_nodelist("a,b.example.org,c-1"), Names({"a", "b.example.org", "c-1"}));
}

TEST(Nodelist, RangesListsAndZeroPadding) {
  EXPECT_EQ(expand_nodelist("node[01-04,07]"), Names({"node01", "node02", "node03", "node04", "node07"}));
  EXPECT_EQ(expand_nodelist("n[8-10]"), Names({"n8", "n9", "n10"}));  // no padding without a leading zero
  EXPECT_EQ(expand_nodelist("n[098-101]"), Names({"n098", "n099", "n100", "n101"}));
  EXPECT_EQ(expand_nodelist("n[3]"), Names({"n3"}));
}

TEST(Nodelist, SeveralBracketGroups) {
  // Groups in a list keep their order; groups within one name multiply, the first slowest.
  EXPECT_EQ(expand_nodelist("gpu[1-2],cpu[09-10],login"), Names({"gpu1", "gpu2", "cpu09", "cpu10", "login"}));
  EXPECT_EQ(expand_nodelist("rack[1-2]-n[01-02]"), Names({"rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"}));
  EXPECT_EQ(expand_nodelist("r[1,3]x[5-6].ib"), Names({"r1x5.ib", "r1x6.ib", "r3x5.ib", "r3x6.ib"}));
}

TEST(Nodelist, MalformedListsAreNamed) {
  EXPECT_NE(nodelist_error("node[1-2").find("unbalanced brackets"), std::string::npos);
  EXPECT_NE(nodelist_error("node1-2]").find("unbalanced brackets"), std::string::npos);
  EXPECT_NE(nodelist_error("node[4-2]").find("the range 4-2 runs backwards"), std::string::npos);
  EXPECT_NE(nodelist_error("node[a-b]").find("not a number or a range"), std::string::npos);
  EXPECT_NE(nodelist_error("node[1-2],,x").find("an empty name"), std::string::npos);
  EXPECT_NE(nodelist_error("n[0-99999999]").find("too many names"), std::string::npos);
  EXPECT_NE(nodelist_error("node[4-2]").find("set MASTER_ADDR"), std::string::npos);
}

TEST(SlurmTasksPerNode, CompressedForm) {
  EXPECT_EQ(tasks_on_node("2(x3),1", 0), 2);
  EXPECT_EQ(tasks_on_node("2(x3),1", 2), 2);
  EXPECT_EQ(tasks_on_node("2(x3),1", 3), 1);
  EXPECT_EQ(tasks_on_node("4", 0), 4);
  EXPECT_THROW(tasks_on_node("2(x3),1", 4), DistError);
  EXPECT_THROW(tasks_on_node("2(x3", 0), DistError);
  EXPECT_THROW(tasks_on_node("two", 0), DistError);
}

TEST(LaunchEnvOpenMpi, Mapping) {
  auto env = ompi();
  env["MASTER_ADDR"] = "10.0.0.5";  // several hosts: mpirun -x MASTER_ADDR
  auto e = parse_launch_env(env);
  EXPECT_TRUE(e.from_launcher);
  EXPECT_EQ(e.launcher, "openmpi");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_FALSE(e.all_local);
  EXPECT_FALSE(e.use_agent_store);  // rank 0 hosts the store
  EXPECT_EQ(e.master_addr, "10.0.0.5");
  EXPECT_EQ(e.master_port, port_from_job_id("1299185665"));
  EXPECT_NE(e.master_from.find("port from OMPI_MCA_ess_base_jobid"), std::string::npos);
}

TEST(LaunchEnvOpenMpi, OneHostNeedsNoMasterAddress) {
  auto e = parse_launch_env(ompi(1, 2, 1, 2));
  EXPECT_TRUE(e.all_local);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  EXPECT_NE(e.master_from.find("MASTER_ADDR unset: every rank is on this host"), std::string::npos);
  auto env = ompi(1, 2, 1, 2);
  env["MASTER_PORT"] = "23456";
  EXPECT_EQ(parse_launch_env(env).master_port, 23456);
  EXPECT_NE(fsdp::dist::describe(parse_launch_env(env)).find("launcher openmpi"), std::string::npos);
}

TEST(LaunchEnvOpenMpi, Refusals) {
  // Several hosts without MASTER_ADDR: one line naming the fix.
  const std::string several = error_of(ompi());
  EXPECT_NE(several.find("MASTER_ADDR is not set"), std::string::npos) << several;
  EXPECT_NE(several.find("mpirun -x MASTER_ADDR"), std::string::npos) << several;
  EXPECT_EQ(several.find('\n'), std::string::npos);
  auto partial = ompi();
  partial.erase("OMPI_COMM_WORLD_LOCAL_SIZE");
  const std::string p = error_of(partial);
  EXPECT_NE(p.find("Open MPI's variables are incomplete"), std::string::npos) << p;
  EXPECT_NE(p.find("OMPI_COMM_WORLD_LOCAL_SIZE missing"), std::string::npos) << p;
  EXPECT_NE(error_of(ompi(4, 4, 0, 1)).find("OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"),
            std::string::npos);
  auto bad = ompi(1, 2, 1, 2);
  bad["OMPI_COMM_WORLD_SIZE"] = "two";
  EXPECT_NE(error_of(bad).find("OMPI_COMM_WORLD_SIZE='two' is not a positive integer"), std::string::npos);
}

TEST(LaunchEnvSlurm, StepMapping) {
  auto e = parse_launch_env(srun_step());
  EXPECT_EQ(e.launcher, "slurm");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 3);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);  // "2,1": node 1 of the step runs one task
  EXPECT_FALSE(e.all_local);
  EXPECT_EQ(e.master_addr, "gpu007");  // the step's first node, not the job's
  EXPECT_EQ(e.master_port, port_from_job_id("4242.0"));
  EXPECT_GE(e.master_port, 15000);
  EXPECT_LE(e.master_port, 30999);
}

TEST(LaunchEnvSlurm, MasterVariablesOverrideAndStepsGetTheirOwnPort) {
  auto env = srun_step();
  env["MASTER_ADDR"] = "10.1.1.1";
  env["MASTER_PORT"] = "29999";
  auto e = parse_launch_env(env);
  EXPECT_EQ(e.master_addr, "10.1.1.1");
  EXPECT_EQ(e.master_port, 29999);
  EXPECT_EQ(e.master_from, "");
  auto other_step = srun_step();
  other_step["SLURM_STEP_ID"] = "1";
  EXPECT_NE(parse_launch_env(other_step).master_port, parse_launch_env(srun_step()).master_port);
  auto job_list = srun_step();  // older srun: only the job's list
  job_list.erase("SLURM_STEP_NODELIST");
  EXPECT_EQ(parse_launch_env(job_list).master_addr, "gpu001");
}

TEST(LaunchEnvSlurm, OneNodeStepStaysOnTheLoopback) {
  Env env = {{"SLURM_JOB_ID", "7"},         {"SLURM_STEP_ID", "3"},
             {"SLURM_PROCID", "1"},         {"SLURM_LOCALID", "1"},
             {"SLURM_NODEID", "0"},         {"SLURM_STEP_NUM_TASKS", "2"},
             {"SLURM_STEP_NUM_NODES", "1"}, {"SLURM_STEP_TASKS_PER_NODE", "2"},
             {"SLURM_STEP_NODELIST", "vm"}};
  auto e = parse_launch_env(env);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_TRUE(e.all_local);
  EXPECT_EQ(e.master_addr, "127.0.0.1");
  env.erase("SLURM_STEP_TASKS_PER_NODE");  // a one-node step without the per-node list
  EXPECT_EQ(parse_launch_env(env).local_world_size, 2);
}

TEST(LaunchEnvSlurm, OutsideAStepIsNoLauncher) {
  // sbatch/salloc shell: fsdprun or a plain program there must not wait for SLURM_NTASKS ranks.
  EXPECT_FALSE(parse_launch_env(sbatch_shell()).from_launcher);
  auto batch_step = sbatch_shell();
  batch_step["SLURM_STEP_ID"] = "4294967291";  // the batch script's step
  EXPECT_FALSE(parse_launch_env(batch_step).from_launcher);
  batch_step["SLURM_STEP_ID"] = "batch";
  EXPECT_FALSE(parse_launch_env(batch_step).from_launcher);
}

TEST(LaunchEnvSlurm, Refusals) {
  auto partial = srun_step();
  partial.erase("SLURM_STEP_NUM_TASKS");
  const std::string p = error_of(partial);
  EXPECT_NE(p.find("Slurm (SLURM_STEP_ID=0)'s variables are incomplete"), std::string::npos) << p;
  EXPECT_NE(p.find("SLURM_STEP_NUM_TASKS missing"), std::string::npos) << p;
  auto no_layout = srun_step();
  no_layout.erase("SLURM_STEP_TASKS_PER_NODE");
  EXPECT_NE(error_of(no_layout).find("SLURM_STEP_TASKS_PER_NODE"), std::string::npos);
  auto no_list = srun_step();
  no_list.erase("SLURM_STEP_NODELIST");
  no_list.erase("SLURM_NODELIST");
  EXPECT_NE(error_of(no_list).find("MASTER_ADDR is not set"), std::string::npos);
  auto bad_list = srun_step();
  bad_list["SLURM_STEP_NODELIST"] = "gpu[7-";
  EXPECT_NE(error_of(bad_list).find("SLURM_STEP_NODELIST='gpu[7-' is not a Slurm host list"), std::string::npos);
}

TEST(LaunchEnvPrecedence, TorchrunInsideSrunOrMpirun) {
  // srun starting fsdprun/torchrun: the workers see both; torchrun's describe them.
  auto e = parse_launch_env(merged(srun_step(), torchrun_worker()));
  EXPECT_EQ(e.launcher, "torchrun");
  EXPECT_EQ(e.rank, 1);
  EXPECT_EQ(e.world_size, 2);
  EXPECT_TRUE(e.use_agent_store);
  EXPECT_EQ(parse_launch_env(merged(ompi(), torchrun_worker())).launcher, "torchrun");
  // A PyTorchJob pod: RANK/WORLD_SIZE/MASTER_* without torchrun's agent.
  Env pod = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "job-master-0"}, {"MASTER_PORT", "23456"}};
  EXPECT_EQ(parse_launch_env(pod).launcher, "env");
}

TEST(LaunchEnvPrecedence, MpirunInsideSbatchOrSrun) {
  auto e = parse_launch_env(merged(sbatch_shell(), ompi(1, 2, 1, 2)));
  EXPECT_EQ(e.launcher, "openmpi");
  EXPECT_EQ(e.world_size, 2);
  EXPECT_EQ(parse_launch_env(merged(srun_step(), ompi(1, 2, 1, 2))).launcher, "openmpi");
}

TEST(LaunchEnvPrecedence, IncompleteTorchrunIsNotRescuedByAnotherLauncher) {
  auto env = merged(ompi(1, 2, 1, 2), {{"RANK", "1"}});
  EXPECT_NE(error_of(env).find("RANK is set but WORLD_SIZE is not"), std::string::npos);
}

TEST(LaunchEnvUnknownLauncher, RefusedNamingWhatWasFound) {
  for (const auto& [k, who] : std::vector<std::pair<std::string, std::string>>{
           {"PMI_RANK", "Hydra"}, {"PMIX_RANK", "PMIx"}, {"MV2_COMM_WORLD_RANK", "MVAPICH2"}}) {
    const std::string e = error_of({{k, "1"}});
    EXPECT_NE(e.find("found " + k + "=1"), std::string::npos) << e;
    EXPECT_NE(e.find(who), std::string::npos) << e;
    EXPECT_NE(e.find("cannot tell which rank it is"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  // Open MPI 5 / srun --mpi=pmix also set PMIX_RANK, but what we read comes first.
  EXPECT_EQ(error_of(merged(srun_step(), {{"PMIX_RANK", "2"}})), "");
  // torchrun's variables set from such a launcher's values are fine.
  EXPECT_EQ(error_of(merged(torchrun_worker(), {{"PMI_RANK", "1"}})), "");
}

TEST(LaunchEnvDescribe, NamesTheLauncherAndTheValues) {
  const std::string line = fsdp::dist::describe(parse_launch_env(srun_step()));
  EXPECT_NE(line.find("launcher slurm"), std::string::npos) << line;
  EXPECT_NE(line.find("3 ranks, 1 on this host"), std::string::npos) << line;
  EXPECT_NE(line.find("master gpu007:" + std::to_string(port_from_job_id("4242.0"))), std::string::npos) << line;
  EXPECT_NE(line.find("port from SLURM_JOB_ID"), std::string::npos) << line;
  EXPECT_EQ(line.find('\n'), std::string::npos);
}
