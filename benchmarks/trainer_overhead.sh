#!/usr/bin/env bash
# What train_gpt adds per step beyond forward, backward and the optimizer step, from CPU-time
# samples (perf record -e cpu-clock: a sample lands only while the process runs, so the shares
# hold on a loaded machine where wall-clock timings do not; callgrind was too slow there).
#
#   benchmarks/trainer_overhead.sh [BUILD_DIR] [-- extra train_gpt options]   (S1=4 S2=16 steps)
#
# Runs `train_gpt --parallel none` (one thread, metrics on; no checkpoints, validation or sample)
# for S1 and S2 steps with DWARF call stacks, and classifies every sample by its stack: forward
# (GPTImpl::forward, gpt_loss), backward (autograd Engine::execute), step (AdamW::step),
# start-up (model build and init, data load, loader), trainer (the rest of main: clipping,
# zero_grad, the batch slice, loss and memory reads, metrics), unattributed (stack not unwound).
# The difference of the two runs is S2 - S1 steady-state steps. Target: trainer < 2%.
set -euo pipefail
BUILD="${1:-build}"
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
S1="${S1:-4}" S2="${S2:-16}"
TRAIN="$BUILD/bin/train_gpt"
[ -x "$TRAIN" ] || { echo "trainer_overhead: no $TRAIN (cmake --build $BUILD --target train_gpt)" >&2; exit 2; }
command -v perf >/dev/null || { echo "trainer_overhead: perf is not installed (apt-get install linux-perf)" >&2; exit 2; }
TMP="$(mktemp -d /tmp/trainer-overhead-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
run() {
  local steps=$1
  shift
  OMP_NUM_THREADS=1 perf record -q -F 999 -e cpu-clock --call-graph dwarf,16384 -o "$TMP/p.$steps" \
    "$TRAIN" --parallel none --steps "$steps" --eval-every 0 --checkpoint-dir '' --sample-tokens 0 \
    --metrics "$TMP/m.$steps.jsonl" "$@" >"$TMP/log.$steps" 2>&1 ||
    { tail -n 20 "$TMP/log.$steps" >&2; echo "trainer_overhead: train_gpt failed under perf" >&2; exit 1; }
  perf script -i "$TMP/p.$steps" -F comm,tid,ip,sym 2>/dev/null >"$TMP/s.$steps"
}
run "$S1" "$@" &
p1=$!
run "$S2" "$@" &
p2=$!
wait "$p1" && wait "$p2"
grep -m1 'train_gpt: GPT' "$TMP/log.$S2" || true
python3 - "$TMP/s.$S1" "$TMP/s.$S2" "$((S2 - S1))" <<'PY'
import collections, re, sys
WORK = [("backward", "torch::autograd::Engine::execute"), ("forward", "fsdp::models::GPTImpl::forward"),
        ("forward", "fsdp::models::gpt_loss"), ("step", "torch::optim::AdamW::step")]
START = ["build_model", "GPTImpl::GPTImpl", "reset_parameters", "TokenSource::TokenSource", "check_memory",
         "_dl_start", "_dl_init", "init_distributed", "build_optimizer", "parse_options", "tune_cpu", "~GPTImpl"]
def classify(path):
    counts, inside = collections.Counter(), collections.Counter()
    frames = []
    def flush():
        if not frames: return
        for label, pat in WORK:
            if any(pat in f for f in frames):
                counts[label] += 1; return
        if any(s in f for f in frames for s in START):
            counts["startup"] += 1; return
        if not any(re.search(r"\bmain\b", f) for f in frames):
            counts["unattributed"] += 1; return
        counts["trainer"] += 1
        idx = [i for i, f in enumerate(frames) if "train_step" in f or "run_training" in f]
        inner = [f for f in frames[:idx[0]] if not f.startswith("std::")] if idx else frames
        inside[(inner[-1] if inner else "run_training itself")[:80]] += 1
    for line in open(path, errors="replace"):
        if not line.strip() or line[0] not in " \t":
            flush(); frames = []; continue
        parts = line.strip().split(None, 1)
        if len(parts) == 2: frames.append(re.sub(r"\s*\(.*\)$", "", parts[1]))
    flush()
    return counts, inside
(c1, i1), (c2, i2), n = classify(sys.argv[1]), classify(sys.argv[2]), int(sys.argv[3])
d = {k: c2[k] - c1[k] for k in set(c1) | set(c2)}
work = d.get("forward", 0) + d.get("backward", 0) + d.get("step", 0)
print(f"cpu-clock samples (1 ms each) over {n} steady steps (the {n}-step difference of the two runs):")
for k in ["forward", "backward", "step", "trainer", "unattributed", "startup"]:
    print(f"  {k:14s} {d.get(k, 0):6d}  ({100 * d.get(k, 0) / max(work, 1):5.2f}% of forward + backward + step)")
print("trainer samples by what main/train_step called (run with more steps; frees of the step's autograd graph")
print("show up as ~TensorImpl, which is backward's memory, not the trainer's):")
for k in set(i1) | set(i2):
    v = i2[k] - i1[k]
    if v > 0: print(f"  {v:5d} {k}")
PY
