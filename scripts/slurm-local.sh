#!/usr/bin/env bash
# A one-machine Slurm cluster for tests: munge with a fresh key, slurmctld and one slurmd on this
# host (CPUs = this machine's cores, whatever OMP_NUM_THREADS says), everything under one folder, nothing of the system's Slurm
# configuration touched.
#
#   scripts/slurm-local.sh up      # start it; prints `export SLURM_CONF=...` for srun/sbatch/sinfo
#   scripts/slurm-local.sh down    # stop it and remove the folder
#   scripts/slurm-local.sh env     # print the export line of a running one
#
# Several nodes on this machine: with SLURM_LOCAL_HOSTS=N and FSDP_NETNS_PREFIX=P naming hosts
# that `scripts/netns-hosts.sh up N` made (network namespaces), each host runs a slurmd whose node
# name is its address (10.77.0.1, 10.77.0.2, ...: it resolves without DNS) and host 0 also runs
# slurmctld; srun and sbatch then run inside host 0, like on a login node:
#   FSDP_NETNS_PREFIX=P SLURM_LOCAL_HOSTS=2 scripts/slurm-local.sh up
#   FSDP_NETNS_PREFIX=P scripts/netns-hosts.sh exec 0 srun -N 2 -n 2 build/bin/train_gpt ...
# munge's socket is a file, which every host reaches (the hosts share the file system).
#
# SLURM_LOCAL_DIR (default /tmp/slurm-local) holds the configuration, keys, state and logs.
# Needs root (slurmd starts the tasks as their user) and Debian's slurmd, slurmctld,
# slurm-client and munge (apt-get install slurmd slurmctld slurm-client munge). Ports: 6917/6918
# (SLURM_LOCAL_PORT, +1), so that a system Slurm on 6817/6818 is left alone.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/slurm-local}"
PORT="${SLURM_LOCAL_PORT:-6917}"
CONF="$DIR/slurm.conf"
HOSTS="${SLURM_LOCAL_HOSTS:-0}"
NETNS="$(cd "$(dirname "$0")" && pwd)/netns-hosts.sh"

die() { echo "slurm-local: $*" >&2; exit 1; }

need() {
  for tool in slurmctld slurmd srun sinfo munged; do
    command -v "$tool" >/dev/null || PATH="$PATH:/usr/sbin" command -v "$tool" >/dev/null ||
      die "$tool not found; install Debian's slurmd slurmctld slurm-client munge"
  done
  [ "$(id -u)" -eq 0 ] || die "needs root (slurmd runs every task as its user)"
}

stop_pidfile() {
  local f="$1"
  [ -f "$f" ] || return 0
  local pid
  pid="$(cat "$f")"
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$f"
}

down() {
  local f
  for f in "$DIR"/run/slurmd*.pid; do stop_pidfile "$f"; done
  stop_pidfile "$DIR/run/slurmctld.pid"
  stop_pidfile "$DIR/run/munged.pid"
  rm -rf "$DIR"
}

up() {
  need
  export PATH="$PATH:/usr/sbin"
  [ -f "$DIR/run/slurmctld.pid" ] && kill -0 "$(cat "$DIR/run/slurmctld.pid")" 2>/dev/null &&
    die "already running in $DIR (scripts/slurm-local.sh down first)"
  down
  mkdir -p "$DIR"/{munge,state,spool,log,run}
  chmod 700 "$DIR/munge"
  # munge: a fresh key, its own socket (the system's munged, if any, is not used).
  dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$DIR/munge/munge.key"
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed" ||
    die "munged did not start; see $DIR/log/munged.log"
  local host cpus nodes k
  host="$(hostname -s)"
  # Every core this host lets us run on, whatever the caller's OMP_NUM_THREADS: nproc honours
  # OMP_NUM_THREADS and OMP_THREAD_LIMIT (clusters often export OMP_NUM_THREADS=1, which made a
  # node of 1 CPU, and `srun -n 2` waited forever). Without them nproc counts the CPUs of this
  # process's affinity (a cgroup cpuset included), which slurmd can give its tasks; `nproc --all`
  # would count installed CPUs that a cpuset excludes.
  cpus="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
  nodes="NodeName=$host CPUs=$cpus State=UNKNOWN"
  if [ "$HOSTS" != 0 ]; then
    [[ "$HOSTS" =~ ^[0-9]+$ ]] || die "SLURM_LOCAL_HOSTS='$HOSTS' is not a number of hosts; give e.g. 2"
    [ -n "${FSDP_NETNS_PREFIX:-}" ] || die "SLURM_LOCAL_HOSTS needs FSDP_NETNS_PREFIX naming hosts of netns-hosts.sh up"
    host="$("$NETNS" addr 0)"
    nodes=""
    for ((k = 0; k < HOSTS; k++)); do
      nodes+="NodeName=$("$NETNS" addr "$k") NodeAddr=$("$NETNS" addr "$k") CPUs=$cpus State=UNKNOWN"$'\n'
    done
  fi
  cat >"$CONF" <<EOF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
AuthType=auth/munge
AuthInfo=socket=$DIR/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=30
$nodes
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  export SLURM_CONF="$CONF"
  local want=1
  if [ "$HOSTS" = 0 ]; then
    slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
    slurmd -f "$CONF" || die "slurmd did not start; see $DIR/log/slurmd-$host.log"
  else
    want="$HOSTS"
    on_host 0 slurmctld -f "$CONF" || die "slurmctld did not start in host 0; see $DIR/log/slurmctld.log"
    for ((k = 0; k < HOSTS; k++)); do
      on_host "$k" slurmd -f "$CONF" -N "$("$NETNS" addr "$k")" ||
        die "slurmd did not start in host $k; see $DIR/log/slurmd-$("$NETNS" addr "$k").log"
    done
  fi
  for _ in $(seq 100); do
    if [ "$(in_cluster sinfo -N -h -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated)')" -ge "$want" ]; then
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 0.2
  done
  die "$want node(s) did not come up within 20 s: $(in_cluster sinfo -N -h -o '%N %T %E' 2>&1 | tr '\n' ' '); logs in $DIR/log"
}

# A command inside netns host $1, with the host's address as its host name.
on_host() { local k="$1"; shift; FSDP_NETNS_HOSTNAME=1 "$NETNS" exec "$k" "$@"; }
# A client command where slurmctld is reachable: here, or in host 0.
in_cluster() { if [ "$HOSTS" = 0 ]; then "$@"; else on_host 0 "$@"; fi; }

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) [ -f "$CONF" ] || die "not running (scripts/slurm-local.sh up)"; echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: scripts/slurm-local.sh up|down|env" >&2; exit 2 ;;
esac
