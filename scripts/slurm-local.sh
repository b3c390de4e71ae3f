#!/usr/bin/env bash
# A one-machine Slurm cluster for tests: munge with a fresh key, slurmctld and one slurmd on this
# host (CPUs = this machine's cores), everything under one folder, nothing of the system's Slurm
# configuration touched.
#
#   scripts/slurm-local.sh up      # start it; prints `export SLURM_CONF=...` for srun/sbatch/sinfo
#   scripts/slurm-local.sh down    # stop it and remove the folder
#   scripts/slurm-local.sh env     # print the export line of a running one
#
# SLURM_LOCAL_DIR (default /tmp/slurm-local) holds the configuration, keys, state and logs.
# Needs root (slurmd starts the tasks as their user) and Debian's slurmd, slurmctld,
# slurm-client and munge (apt-get install slurmd slurmctld slurm-client munge). Ports: 6917/6918
# (SLURM_LOCAL_PORT, +1), so that a system Slurm on 6817/6818 is left alone.
set -euo pipefail

DIR="${SLURM_LOCAL_DIR:-/tmp/slurm-local}"
PORT="${SLURM_LOCAL_PORT:-6917}"
CONF="$DIR/slurm.conf"

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
  stop_pidfile "$DIR/run/slurmd.pid"
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
  local host cpus
  host="$(hostname -s)"
  cpus="$(nproc)"
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
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
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
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  export SLURM_CONF="$CONF"
  slurmctld -f "$CONF" || die "slurmctld did not start; see $DIR/log/slurmctld.log"
  slurmd -f "$CONF" || die "slurmd did not start; see $DIR/log/slurmd.log"
  for _ in $(seq 100); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    sleep 0.2
  done
  die "the node did not come up within 20 s: $(sinfo -h -o '%T %E' 2>&1 | head -1); logs in $DIR/log"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  env) [ -f "$CONF" ] || die "not running (scripts/slurm-local.sh up)"; echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: scripts/slurm-local.sh up|down|env" >&2; exit 2 ;;
esac
