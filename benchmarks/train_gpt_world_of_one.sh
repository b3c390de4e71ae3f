#!/usr/bin/env bash
# train_gpt's FSDP world of one against its plain LibTorch run (docs/benchmarks.md, "FSDP's own
# cost"): PAIRS alternating pairs (the first of each pair alternates) of
#   train_gpt --parallel none                                   (glibc's malloc defaults)
#   fsdprun --nproc-per-node 1 -- train_gpt --parallel fsdp
# on bench's GPT, one thread, no validation, sample or checkpoint; the figure of a run is the last
# progress line's s/step. Prints each pair, then the median and min-max of world of one / plain
# and the median s/step of each side, with the load average (wall time: use a quiet machine).
#
#   benchmarks/train_gpt_world_of_one.sh [BUILD_DIR] [PAIRS]      env: STEPS=15 ARGS="--layers 4 ..."
set -euo pipefail
BUILD="${1:-build}" PAIRS="${2:-7}" STEPS="${STEPS:-15}"
TRAIN="$BUILD/bin/train_gpt" FSDPRUN="$BUILD/bin/fsdprun"
if [ ! -x "$TRAIN" ] || [ ! -x "$FSDPRUN" ]; then echo "train_gpt_world_of_one: build train_gpt and fsdprun first ($BUILD/bin)" >&2; exit 2; fi
TMP="$(mktemp -d /tmp/train-gpt-world-of-one-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
# shellcheck disable=SC2206  # word splitting of ARGS is the point
MODEL=(${ARGS:---layers 4 --dim 256 --heads 4 --seq-len 128 --batch-size 4})
COMMON=("${MODEL[@]}" --data synthetic --eval-every 0 --sample-tokens 0 --steps "$STEPS" --checkpoint-dir ''
  --metrics "$TMP/metrics.jsonl")
# step_time KIND: the last progress line's s/step of one run.
step_time() {
  local cmd
  if [ "$1" = plain ]; then
    cmd=("$TRAIN" --parallel none "${COMMON[@]}")
  else
    cmd=("$FSDPRUN" --nproc-per-node 1 --master-port 0 -- "$TRAIN" --parallel fsdp "${COMMON[@]}")
  fi
  OMP_NUM_THREADS=1 "${cmd[@]}" >"$TMP/log" 2>&1 || { tail -n 20 "$TMP/log" >&2; echo "train_gpt_world_of_one: the $1 run failed" >&2; exit 1; }
  grep -o '[0-9.]* s/step' "$TMP/log" | tail -n 1 | cut -d' ' -f1
}
echo "train_gpt_world_of_one: $PAIRS pairs, $STEPS steps; load average at start $(cut -d' ' -f1-3 /proc/loadavg)"
for ((i = 0; i < PAIRS; ++i)); do
  if ((i % 2 == 0)); then
    p=$(step_time plain) f=$(step_time fsdp)
  else
    f=$(step_time fsdp) p=$(step_time plain)
  fi
  echo "$p $f" >>"$TMP/pairs"
  echo "pair $((i + 1)): plain $p s/step, world of one $f s/step, ratio $(python3 -c "print(f'{$f / $p:.3f}')")"
done
echo "train_gpt_world_of_one: load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$TMP/pairs" <<'PY'
import statistics, sys
pairs = [tuple(map(float, line.split())) for line in open(sys.argv[1])]
ratios = [f / p for p, f in pairs]
print(f"world of one / plain: {statistics.median(ratios):.3f}x median ({min(ratios):.3f}x-{max(ratios):.3f}x); "
      f"median s/step plain {statistics.median(p for p, _ in pairs):.4f}, world of one {statistics.median(f for _, f in pairs):.4f}")
PY
