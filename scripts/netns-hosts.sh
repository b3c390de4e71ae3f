#!/usr/bin/env bash
# Test hosts on one machine: N Linux network namespaces ("hosts") joined by a bridge that lives in
# a namespace of its own, on 10.77.0.0/24 (host K is 10.77.0.(K+1), interface mh0). Nothing is
# added to the machine's own namespace: no interface, no route, so nothing in a host can reach any
# address outside them (and nothing outside can reach them). The file system is shared, like a
# cluster's shared disk. Needs root (or CAP_SYS_ADMIN + CAP_NET_ADMIN) and iproute2.
#
#   scripts/netns-hosts.sh up 2                  # hosts fsdpmh-h0 (10.77.0.1) and fsdpmh-h1 (10.77.0.2)
#   scripts/netns-hosts.sh exec 0 build/bin/fsdprun --nnodes 2 --node-rank 0 --master-addr 10.77.0.1 ...
#   scripts/netns-hosts.sh exec 1 build/bin/fsdprun --nnodes 2 --node-rank 1 --master-addr 10.77.0.1 ...
#   FSDP_NETNS_HOSTNAME=1 scripts/netns-hosts.sh exec 1 CMD...   # CMD's host name: 10.77.0.2
#   scripts/netns-hosts.sh kill 1                # SIGKILL every process of host 1 ("the host died")
#   scripts/netns-hosts.sh link 1 down           # unplug host 1's cable (and `link 1 up` again)
#   scripts/netns-hosts.sh down                  # kill every process in the hosts, remove them all
#
# FSDP_NETNS_PREFIX (default fsdpmh) names the set, so that several sets can coexist; the tests
# use fsdpmh-<their pid>-<n> and `gc` removes sets whose test process is gone.
#   scripts/netns-hosts.sh addr K | ns K | list | gc
set -euo pipefail

P="${FSDP_NETNS_PREFIX:-fsdpmh}"
SW="$P-sw"
NET=10.77.0

die() { echo "netns-hosts: $*" >&2; exit 1; }
host_ns() { echo "$P-h$1"; }
# Runs a command inside namespace $1. nsenter rather than `ip -n` / `ip netns exec`: those also make
# "/" a slave mount, which fails (EINVAL) where "/" is no mount point, as in a plain chroot (the sid
# chroot of scripts/libtorch2-check.sh, where torchrun's multi-node test uses these hosts).
in_ns() { local ns="$1"; shift; nsenter --net="/run/netns/$ns" -- "$@"; }
need_root() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces): run it with sudo"
  command -v ip >/dev/null || die "needs iproute2's ip: apt-get install iproute2"
  command -v nsenter >/dev/null || die "needs util-linux's nsenter: apt-get install util-linux"
}
check_k() { [[ "$1" =~ ^[0-9]+$ ]] || die "'$1' is not a host number; give 0, 1, ..."; }
ours() { ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$(printf '%s' "$P" | sed 's/[.[\*^$]/\\&/g')-(sw|h[0-9]+)$" || true; }

kill_ns() {  # SIGKILL every process whose network namespace is $1
  local pids
  pids=$(ip netns pids "$1" 2>/dev/null || true)
  [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
  for _ in $(seq 50); do  # until they are gone (at most 5 s)
    [ -z "$(ip netns pids "$1" 2>/dev/null || true)" ] && return 0
    sleep 0.1
  done
}

down() {
  local ns
  for ns in $(ours); do kill_ns "$ns"; done
  for ns in $(ours); do ip netns delete "$ns" 2>/dev/null || true; done  # their veths go with them
}

up() {
  local n="$1" k
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "up needs a number of hosts 1..200, e.g. up 2"
  [ -z "$(ours)" ] || die "hosts with prefix $P already exist; run '$0 down' first (or set FSDP_NETNS_PREFIX)"
  trap 'down; die "up failed; removed what it had made"' ERR
  ip netns add "$SW"
  in_ns "$SW" ip link add br0 type bridge
  in_ns "$SW" ip link set br0 up
  for ((k = 0; k < n; k++)); do
    local h
    h=$(host_ns "$k")
    ip netns add "$h"
    in_ns "$h" ip link set lo up
    # Both ends are created inside the namespaces: the machine's own namespace never sees them.
    ip link add mh0 netns "$h" type veth peer name "p$k" netns "$SW"
    in_ns "$SW" ip link set "p$k" master br0
    in_ns "$SW" ip link set "p$k" up
    in_ns "$h" ip addr add "$NET.$((k + 1))/24" dev mh0
    in_ns "$h" ip link set mh0 up
  done
  trap - ERR
  for ((k = 0; k < n; k++)); do echo "$(host_ns "$k") $NET.$((k + 1))"; done
}

cmd="${1:-}"
shift || true
case "$cmd" in
  up) need_root; up "${1:-}" ;;
  down) need_root; down ;;
  exec)
    need_root
    check_k "${1:-x}"
    k="$1"; shift
    [ "${1:-}" = "--" ] && shift
    [ $# -ge 1 ] || die "exec needs a command, e.g. exec 0 hostname -I"
    ip netns list | awk '{print $1}' | grep -qx "$(host_ns "$k")" || die "no host $k (prefix $P); run '$0 up N' first"
    if [ "${FSDP_NETNS_HOSTNAME:-0}" = 1 ]; then
      # The command's host name is the host's address (a UTS namespace of its own), so that it
      # resolves, to this host, without any hosts file or DNS: programs that look up their own
      # name, as torchrun's c10d rendezvous does, find this host as on a real cluster's node.
      exec nsenter --net="/run/netns/$(host_ns "$k")" -- \
        unshare --uts -- sh -c 'hostname "$0" && exec "$@"' "$NET.$((k + 1))" "$@"
    fi
    exec nsenter --net="/run/netns/$(host_ns "$k")" -- "$@"
    ;;
  kill) need_root; check_k "${1:-x}"; kill_ns "$(host_ns "$1")" ;;
  link)
    need_root; check_k "${1:-x}"
    [ "${2:-}" = up ] || [ "${2:-}" = down ] || die "link needs up or down, e.g. link 1 down"
    in_ns "$SW" ip link set "p$1" "$2"
    ;;
  addr) check_k "${1:-x}"; echo "$NET.$(($1 + 1))" ;;
  ns) check_k "${1:-x}"; host_ns "$1" ;;
  list) ours ;;
  gc)
    # Sets named fsdpmh-<pid>[-<n>]-... whose process no longer exists (a test killed by its timeout).
    need_root
    for set in $(ip netns list | awk '{print $1}' | sed -nE 's/^(fsdpmh-[0-9]+(-[0-9]+)?)-(sw|h[0-9]+)$/\1/p' | sort -u); do
      pid=${set#fsdpmh-}
      pid=${pid%%-*}
      kill -0 "$pid" 2>/dev/null || FSDP_NETNS_PREFIX="$set" "$0" down
    done
    ;;
  *) die "usage: $0 up N | down | exec K CMD... | kill K | link K up|down | addr K | ns K | list | gc (FSDP_NETNS_PREFIX=${P})" ;;
esac
