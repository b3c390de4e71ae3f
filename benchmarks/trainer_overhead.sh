#!/usr/bin/env bash
# What train_gpt adds per step beyond forward, backward and the optimizer step, in instructions
# (callgrind: repeatable on a loaded machine, unlike timings).
#
#   benchmarks/trainer_overhead.sh [BUILD_DIR] [-- extra train_gpt options]     (S1=2 S2=4 steps by default)
#
# Runs `train_gpt --parallel none` (one thread, default model unless overridden, metrics on, no
# checkpoints, validation or sample) under callgrind twice, for S1 and S2 steps; the difference is
# S2 - S1 steady-state steps, so start-up (model build, data load) cancels out. Per step it
# prints the whole loop, the model's forward (GPT forward + loss), backward (the autograd engine),
# AdamW's step, and the rest: the trainer's own work (data slice, zero_grad, clipping, loss and
# memory all-reduce/reads, metrics line, progress), as a share of forward + backward + step.
# Target (issue 16): under 2%.
set -euo pipefail
BUILD="${1:-build}"
[ $# -gt 0 ] && shift
[ "${1:-}" = "--" ] && shift
S1="${S1:-2}" S2="${S2:-4}"
TRAIN="$BUILD/bin/train_gpt"
[ -x "$TRAIN" ] || { echo "trainer_overhead: no $TRAIN (build it: cmake --build $BUILD --target train_gpt)" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "trainer_overhead: valgrind is not installed (apt-get install valgrind)" >&2; exit 2; }
TMP="$(mktemp -d /tmp/trainer-overhead-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
# Valgrind runs AVX2 but not AVX-512 and shows its own CPU model, on which OpenBLAS would fall back
# to generic kernels (and train_gpt's re-exec cannot run under valgrind): force its AVX2 kernels.
CORE=Prescott
grep -qw avx2 /proc/cpuinfo && CORE=Haswell
run() {  # steps [train_gpt options] -> callgrind output file
  local steps=$1
  shift
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=$CORE FSDP_NO_REEXEC=1 valgrind --tool=callgrind --callgrind-out-file="$TMP/cg.$steps" \
    "$TRAIN" --parallel none --steps "$steps" --eval-every 0 --checkpoint-dir '' --sample-tokens 0 \
    --metrics "$TMP/metrics.$steps.jsonl" "$@" >"$TMP/log.$steps" 2>&1 ||
    { tail -n 20 "$TMP/log.$steps" >&2; echo "trainer_overhead: train_gpt failed under callgrind" >&2; exit 1; }
  callgrind_annotate --inclusive=yes --threshold=100 "$TMP/cg.$steps" >"$TMP/inc.$steps" 2>/dev/null
}
# Both at once (two processes: callgrind runs one thread at a time, so this halves the wall time).
run "$S1" "$@" &
p1=$!
run "$S2" "$@" &
p2=$!
wait "$p1" && wait "$p2"
grep -m1 'train_gpt: GPT' "$TMP/log.$S2" || true
python3 - "$TMP/inc.$S1" "$TMP/inc.$S2" "$((S2 - S1))" <<'EOF'
import re, sys
def parse(path):
    total, funcs = None, {}
    for line in open(path, errors="replace"):
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?PROGRAM TOTALS", line)
        if m: total = int(m.group(1).replace(",", ""))
        m = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(?:\S*:)?(.*?)\s*(?:\[.*\])?$", line)
        if m and not line.strip().startswith("--"):
            name = m.group(2)
            funcs[name] = max(funcs.get(name, 0), int(m.group(1).replace(",", "")))
    return total, funcs
def pick(funcs, pattern):
    best = 0
    for name, v in funcs.items():
        if re.search(pattern, name): best = max(best, v)
    return best
(t1, f1), (t2, f2), n = parse(sys.argv[1]), parse(sys.argv[2]), int(sys.argv[3])
parts = {
    "forward (GPT + loss)": r"fsdp::models::GPTImpl::forward\(|fsdp::models::gpt_loss\(",
    "backward (autograd engine)": r"torch::autograd::Engine::execute\(",
    "AdamW step": r"torch::optim::AdamW::step\(",
}
per = {}
for k, pat in parts.items():
    if k.startswith("forward"):
        v = lambda f: pick(f, r"fsdp::models::GPTImpl::forward\(") + pick(f, r"fsdp::models::gpt_loss\(")
    else:
        v = lambda f, pat=pat: pick(f, pat)
    per[k] = (v(f2) - v(f1)) / n
total = (t2 - t1) / n
work = sum(per.values())
rest = total - work
print(f"instructions per step (callgrind, steps {n} = difference of two runs):")
for k, v in per.items():
    print(f"  {k:32s} {v / 1e6:12.1f} M")
print(f"  {'forward + backward + step':32s} {work / 1e6:12.1f} M")
print(f"  {'whole step (loop)':32s} {total / 1e6:12.1f} M")
print(f"  {'trainer overhead (the rest)':32s} {rest / 1e6:12.1f} M = {100 * rest / work:.2f}% of forward + backward + step")
for label, pat in [("  of which clip_grad_norm_", r"clip_grad_norm_"), ("  of which metrics line", r"MetricsWriter::step"),
                   ("  of which RSS reads", r"(current|peak)_rss_bytes"), ("  of which zero_grad", r"Optimizer::zero_grad"),
                   ("  of which train_batch", r"TokenSource::train_batch")]:
    v = (pick(f2, pat) - pick(f1, pat)) / n
    if v > 0: print(f"{label:34s} {v / 1e6:12.2f} M ({100 * v / work:.2f}%)")
EOF
