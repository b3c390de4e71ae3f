#!/usr/bin/env bash
# train_gpt's FSDP world of one against its plain LibTorch run (docs/benchmarks.md, "FSDP's own
# cost"): PAIRS alternating pairs (the first of each pair alternates) of
#   train_gpt --parallel none --malloc glibc                    (glibc's malloc as it starts: the limit)
#   fsdprun --nproc-per-node 1 -- train_gpt --parallel fsdp --malloc glibc
# (MALLOC=warm runs both sides with train_gpt's default, fsdp::raise_malloc_thresholds)
# on bench's GPT, one thread, no validation, sample or checkpoint. Three figures per run: the last
# progress line's s/step (one step: noisy), the metrics summary's median step time and its median
# minor page faults per step (rank 0's getrusage, each step from the previous one's end; both
# medians over the steps after the first). Each pair line prints both sides' three; the summary
# prints, for each time, the median and min-max of world of one / plain and the median of each
# side, then each side's median faults per step and their ratio, with the load average (wall
# time: use a quiet machine; the faults are counts, steadier under load).
#
# INSTR=1 adds instructions per steady step (load does not move them): after the pairs, each side
# runs at 3 and at 6 steps under valgrind's callgrind (about 50x slower; for the world of one
# valgrind wraps the worker, fsdprun stays native), and (Ir(6 steps) - Ir(3 steps)) / 3 is the
# instructions of steps 4..6, start-up, first steps and exit cancelling out. Both sides' OpenBLAS
# runs OPENBLAS_CORETYPE=Sandybridge there (INSTR_CORETYPE to change it): valgrind has no AVX-512,
# runs the Haswell kernels' FMA instructions through slow helpers (minutes a step, against about 9 s
# with Sandybridge's AVX ones), and a re-executed train_gpt (tune_cpu_or_reexec) would leave
# valgrind behind. The counts are of those kernels, not of what a native run executes.
#
#   benchmarks/train_gpt_world_of_one.sh [BUILD_DIR] [PAIRS]      env: STEPS=15 ARGS="--layers 4 ..." INSTR=1 MALLOC=glibc
set -euo pipefail
BUILD="${1:-build}" PAIRS="${2:-7}" STEPS="${STEPS:-15}"
TRAIN="$BUILD/bin/train_gpt" FSDPRUN="$BUILD/bin/fsdprun"
if [ ! -x "$TRAIN" ] || [ ! -x "$FSDPRUN" ]; then echo "train_gpt_world_of_one: build train_gpt and fsdprun first ($BUILD/bin)" >&2; exit 2; fi
TMP="$(mktemp -d /tmp/train-gpt-world-of-one-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
# shellcheck disable=SC2206  # word splitting of ARGS is the point
MODEL=(${ARGS:---layers 4 --dim 256 --heads 4 --seq-len 128 --batch-size 4})
MALLOC="${MALLOC:-glibc}"
COMMON=("${MODEL[@]}" --malloc "$MALLOC" --data synthetic --eval-every 0 --sample-tokens 0 --checkpoint-dir ''
        --metrics "$TMP/metrics.jsonl")
# command_for KIND N [WRAPPER...]: sets cmd to KIND's run of N steps, WRAPPER (valgrind ...) around train_gpt itself.
command_for() {
  local kind="$1" steps="$2"
  shift 2
  if [ "$kind" = plain ]; then
    cmd=("$@" "$TRAIN" --parallel none "${COMMON[@]}" --steps "$steps")
  else
    cmd=("$FSDPRUN" --nproc-per-node 1 --master-port 0 -- "$@" "$TRAIN" --parallel fsdp "${COMMON[@]}" --steps "$steps")
  fi
}
run_or_fail() {  # KIND: runs "${cmd[@]}" into $TMP/log
  OMP_NUM_THREADS=1 "${cmd[@]}" >"$TMP/log" 2>&1 || { tail -n 20 "$TMP/log" >&2; echo "train_gpt_world_of_one: the $1 run failed" >&2; exit 1; }
}
# measure KIND: "LAST MEDIAN FAULTS" of one run: the last progress line's s/step, the median step
# time, the median minor faults per step.
measure() {
  local cmd
  command_for "$1" "$STEPS"
  run_or_fail "$1"
  echo "$(grep -o '[0-9.]* s/step' "$TMP/log" | tail -n 1 | cut -d' ' -f1)" \
    "$(python3 -c 'import json, sys; s = json.loads(open(sys.argv[1]).read().splitlines()[-1]); print(round(s["median_step_time_s"], 4), round(s["median_minor_faults_per_step"]))' "$TMP/metrics.jsonl")"
}
echo "train_gpt_world_of_one: $PAIRS pairs, $STEPS steps; load average at start $(cut -d' ' -f1-3 /proc/loadavg)"
for ((i = 0; i < PAIRS; ++i)); do
  if ((i % 2 == 0)); then
    p=$(measure plain)
    f=$(measure fsdp)
  else
    f=$(measure fsdp)
    p=$(measure plain)
  fi
  echo "$p $f" >>"$TMP/pairs"
  read -r pl pm pf <<<"$p"
  read -r fl fm ff <<<"$f"
  echo "pair $((i + 1)): plain $pl $pm s $pf faults, world of one $fl $fm s $ff faults (last step, median step, median minor faults per step)"
done
echo "train_gpt_world_of_one: load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$TMP/pairs" <<'PY'
import statistics, sys
rows = [list(map(float, line.split())) for line in open(sys.argv[1])]  # plain last, median, faults, fsdp last, median, faults
for name, i in (("last progress line's s/step", 0), ("median step time", 1)):
    p, f = [r[i] for r in rows], [r[3 + i] for r in rows]
    ratios = [b / a for a, b in zip(p, f)]
    print(f"{name}: world of one / plain {statistics.median(ratios):.3f}x median ({min(ratios):.3f}x-"
          f"{max(ratios):.3f}x); median plain {statistics.median(p):.4f} s, world of one {statistics.median(f):.4f} s")
p, f = statistics.median(r[2] for r in rows), statistics.median(r[5] for r in rows)
ratio = f"{f / p:.3f}x" if p > 0 else "- (plain 0)"
print(f"minor page faults per step (median of the runs' medians): plain {p:.0f}, world of one {f:.0f}; "
      f"world of one / plain {ratio}")
PY

[ "${INSTR:-0}" = 1 ] || exit 0
if ! command -v valgrind >/dev/null; then
  echo "train_gpt_world_of_one: INSTR=1 but valgrind is not installed: instructions per step skipped"
  exit 0
fi
# Ir of one run under callgrind: its output file's "summary:" line (every thread's instructions).
instructions() {
  local cmd out="$TMP/callgrind.$1.$2"
  command_for "$1" "$2" valgrind --tool=callgrind --callgrind-out-file="$out"
  OPENBLAS_CORETYPE="${INSTR_CORETYPE:-Sandybridge}" FSDP_NO_REEXEC=1 run_or_fail "$1 (callgrind)"
  sed -n 's/^summary: *//p' "$out"
}
echo "train_gpt_world_of_one: instructions per steady step under callgrind (3 and 6 steps each side; OPENBLAS_CORETYPE=${INSTR_CORETYPE:-Sandybridge})"
declare -A ir
for kind in plain fsdp; do
  for n in 3 6; do ir[$kind.$n]=$(instructions "$kind" "$n"); done
done
python3 - "${ir[plain.3]}" "${ir[plain.6]}" "${ir[fsdp.3]}" "${ir[fsdp.6]}" <<'PY'
import sys
p3, p6, f3, f6 = map(int, sys.argv[1:])
p, f = (p6 - p3) / 3, (f6 - f3) / 3
print(f"instructions per steady step (steps 4..6): plain {p / 1e6:.1f}M (Ir {p3} at 3 steps, {p6} at 6), "
      f"world of one {f / 1e6:.1f}M (Ir {f3}, {f6}); world of one / plain {f / p:.3f}x")
PY
