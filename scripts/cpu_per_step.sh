#!/usr/bin/env bash
# CPU time per training step of the runs bench compares, counted the way that holds on a loaded
# machine: user + system seconds of every process and thread of a run (ranks, Gloo's threads, the
# kernel's loopback copies on their behalf), from getrusage of the launcher's children
# (/usr/bin/time), as the difference of an S1-step and an S2-step run (start-up cancels out).
#
#   scripts/cpu_per_step.sh [BUILD_DIR] [ROUNDS]        env: S1=3 S2=9 WARMUP=2 NPROC=2
#                                                          BENCH_ARGS="--layers 4 --dim 256 ..."
#
# Rows (bench's GPT, global batch 8 unless BENCH_ARGS says otherwise, one thread per rank):
#   single     one process, the per-rank share of the batch (the limit)
#   world      fully_shard in a world of one on the same share (FSDP's own work, no network)
#   fsdp       NPROC ranks under fsdprun, FSDP fp32 on the global batch
#   replicate  NPROC ranks, fsdp::replicate (DDP)
# For the distributed rows the per-rank figure is the total / NPROC, so "x single" is what a
# rank spends per step against one process doing the same share: the extra is FSDP's and Gloo's
# work (copies, collectives, the kernel's socket copies). Rows alternate within each round;
# the median over rounds is printed, with the load average. CPU time still grows with cache and
# core contention: under load the same binary's rows move between rounds by more than FSDP's
# share, so use it on a quiet machine; under load prefer fsdp_cpu_profile.sh.
set -euo pipefail
BUILD="${1:-build}"
ROUNDS="${2:-2}"
S1="${S1:-3}" S2="${S2:-9}" WARMUP="${WARMUP:-2}" NPROC="${NPROC:-2}"
BENCH="$BUILD/bin/bench" FSDPRUN="$BUILD/bin/fsdprun"
if [ ! -x "$BENCH" ] || [ ! -x "$FSDPRUN" ]; then echo "cpu_per_step: build bench and fsdprun first ($BUILD/bin)" >&2; exit 2; fi
((S2 > S1)) || { echo "cpu_per_step: S2 must exceed S1" >&2; exit 2; }
TMP="$(mktemp -d /tmp/cpu-per-step-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
# shellcheck disable=SC2206  # word splitting of BENCH_ARGS is the point
EXTRA=(${BENCH_ARGS:-})
# cpu ROW STEPS: prints "user sys" seconds of one run.
cpu() {
  local row=$1 common=(--steps "$2" --warmup "$WARMUP" --nproc "$NPROC" "${EXTRA[@]}")
  local cmd
  case "$row" in
    single) cmd=(env OMP_NUM_THREADS=1 "$BENCH" --role single "${common[@]}") ;;
    world) cmd=(env OMP_NUM_THREADS=1 "$BENCH" --role fsdp "${common[@]}") ;;
    fsdp) cmd=("$FSDPRUN" --nproc-per-node "$NPROC" --master-port 0 -- "$BENCH" --role fsdp "${common[@]}") ;;
    replicate) cmd=("$FSDPRUN" --nproc-per-node "$NPROC" --master-port 0 -- "$BENCH" --role fsdp --parallel replicate "${common[@]}") ;;
  esac
  /usr/bin/time -f "%U %S" -o "$TMP/t" "${cmd[@]}" >"$TMP/log" 2>&1 ||
    { tail -n 20 "$TMP/log" >&2; echo "cpu_per_step: the $row run failed" >&2; exit 1; }
  cat "$TMP/t"
}
echo "cpu_per_step: load average at start $(cut -d' ' -f1-3 /proc/loadavg); $NPROC ranks; steps $S1 vs $S2 after $WARMUP warm-up; $ROUNDS rounds"
for ((r = 0; r < ROUNDS; ++r)); do
  for row in single world fsdp replicate; do
    read -r u1 s1 < <(cpu "$row" "$S1")
    read -r u2 s2 < <(cpu "$row" "$S2")
    echo "$row $u1 $s1 $u2 $s2" >>"$TMP/results"
  done
done
echo "cpu_per_step: load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$TMP/results" "$((S2 - S1))" "$NPROC" <<'PY'
import statistics, sys
path, steps, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rows = {}
for line in open(path):
    name, u1, s1, u2, s2 = line.split()
    per = 1 if name in ("single", "world") else nproc
    rows.setdefault(name, []).append(((float(u2) - float(u1)) / steps / per, (float(s2) - float(s1)) / steps / per))
med = {k: (statistics.median(u for u, _ in v), statistics.median(s for _, s in v)) for k, v in rows.items()}
base = sum(med["single"])
print("\n| run | CPU s / step / rank: user | system | total | x single | extra over single (ms / step / rank) |")
print("|---|---|---|---|---|---|")
for k in ("single", "world", "fsdp", "replicate"):
    u, s = med[k]
    print(f"| {k} | {u:.4f} | {s:.4f} | {u + s:.4f} | {(u + s) / base:.3f}x | {1e3 * (u + s - base):+.1f} |")
print("\nper round (total CPU s / step / rank):", {k: [round(u + s, 4) for u, s in v] for k, v in rows.items()})
PY
