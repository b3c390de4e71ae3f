#!/usr/bin/env bash
# train_gpt's FSDP world of one against its plain LibTorch run (docs/benchmarks.md, "FSDP's own
# cost"): PAIRS alternating pairs (the first of each pair alternates) of
#   train_gpt --parallel none                                   (glibc's malloc defaults)
#   fsdprun --nproc-per-node 1 -- train_gpt --parallel fsdp
# on bench's GPT, one thread, no validation, sample or checkpoint. Two figures per run: the last
# progress line's s/step (one step: noisy) and the metrics summary's median step time over all
# steps. Prints each pair, then for each figure the median and min-max of world of one / plain and
# the median of each side, with the load average (wall time: use a quiet machine).
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
# step_time KIND: "LAST MEDIAN" of one run: the last progress line's s/step, the median step time.
step_time() {
  local cmd
  if [ "$1" = plain ]; then
    cmd=("$TRAIN" --parallel none "${COMMON[@]}")
  else
    cmd=("$FSDPRUN" --nproc-per-node 1 --master-port 0 -- "$TRAIN" --parallel fsdp "${COMMON[@]}")
  fi
  OMP_NUM_THREADS=1 "${cmd[@]}" >"$TMP/log" 2>&1 || { tail -n 20 "$TMP/log" >&2; echo "train_gpt_world_of_one: the $1 run failed" >&2; exit 1; }
  echo "$(grep -o '[0-9.]* s/step' "$TMP/log" | tail -n 1 | cut -d' ' -f1)" \
    "$(python3 -c 'import json, sys; print(round(json.loads(open(sys.argv[1]).read().splitlines()[-1])["median_step_time_s"], 4))' "$TMP/metrics.jsonl")"
}
echo "train_gpt_world_of_one: $PAIRS pairs, $STEPS steps; load average at start $(cut -d' ' -f1-3 /proc/loadavg)"
for ((i = 0; i < PAIRS; ++i)); do
  if ((i % 2 == 0)); then
    p=$(step_time plain) f=$(step_time fsdp)
  else
    f=$(step_time fsdp) p=$(step_time plain)
  fi
  echo "$p $f" >>"$TMP/pairs"
  echo "pair $((i + 1)): plain $p s, world of one $f s (last step, median step)"
done
echo "train_gpt_world_of_one: load average at end $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$TMP/pairs" <<'PY'
import statistics, sys
rows = [list(map(float, line.split())) for line in open(sys.argv[1])]  # plain last, median, fsdp last, median
for name, i in (("last progress line's s/step", 0), ("median step time", 1)):
    p, f = [r[i] for r in rows], [r[2 + i] for r in rows]
    ratios = [b / a for a, b in zip(p, f)]
    print(f"{name}: world of one / plain {statistics.median(ratios):.3f}x median ({min(ratios):.3f}x-"
          f"{max(ratios):.3f}x); median plain {statistics.median(p):.4f} s, world of one {statistics.median(f):.4f} s")
PY
