#!/usr/bin/env bash
# Where a rank's CPU time goes in FSDP (or replicate) at N ranks: CPU-time samples (perf record -e
# cpu-clock, DWARF stacks, 499 Hz; a sample lands only while a thread runs, so the shares hold on a
# loaded machine) of every rank and thread of one bench run, classified by thread and call stack:
#   start-up             model construction, fully_shard/replicate, process-group set-up
#   compute              a rank's main thread outside FSDP's runtime (forward, backward, optimizer;
#                        also the samples whose stack did not unwind: OpenBLAS's kernels have no
#                        unwind tables)
#   fsdp main thread     inside FSDP's runtime (copy-in/out, reduce-scatter input, hooks, the
#                        reduce-scatter's local sum), by the innermost frame of ours
#   comm threads         the backend's worker threads (Gloo: its copies, reductions, socket I/O)
#   launcher             fsdprun itself
# "(kernel)" marks samples taken in the kernel (socket copies, page faults).
#
#   scripts/fsdp_cpu_profile.sh [BUILD_DIR] [fsdp|replicate]   env: STEPS=6 NPROC=2 BENCH_ARGS
set -euo pipefail
BUILD="${1:-build}" MODE="${2:-fsdp}"
STEPS="${STEPS:-6}" NPROC="${NPROC:-2}"
command -v perf >/dev/null || { echo "fsdp_cpu_profile: perf is not installed (apt-get install linux-perf)" >&2; exit 2; }
TMP="$(mktemp -d /tmp/fsdp-cpu-profile-XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
# shellcheck disable=SC2206  # word splitting of BENCH_ARGS is the point
EXTRA=(${BENCH_ARGS:-})
echo "fsdp_cpu_profile: $MODE, $NPROC ranks, 1 + $STEPS steps; load average $(cut -d' ' -f1-3 /proc/loadavg)"
perf record -q -F 499 -e cpu-clock --call-graph dwarf,32768 -o "$TMP/p" -- \
  "$BUILD/bin/fsdprun" --nproc-per-node "$NPROC" --master-port 0 -- "$BUILD/bin/bench" --role fsdp --parallel "$MODE" \
  --steps "$STEPS" --warmup 1 --nproc "$NPROC" "${EXTRA[@]}" >"$TMP/log" 2>&1 ||
  { tail -n 20 "$TMP/log" >&2; echo "fsdp_cpu_profile: the run failed under perf" >&2; exit 1; }
perf script -i "$TMP/p" -F comm,pid,tid,ip,sym 2>/dev/null >"$TMP/s"
python3 - "$TMP/s" "$((STEPS + 1))" "$NPROC" <<'PY'
import collections, re, sys
path, steps, nproc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
START = re.compile(r"FSDPParam::FSDPParam|fully_shard|~FSDPState|reset_parameters|GPTImpl::GPTImpl|"
                   r"init_distributed|_dl_|Reducer::Reducer|replicate\(")
samples, head, frames = [], None, []
for line in open(path):
    if line.startswith("\t"):
        p = line.strip().split(None, 1)
        frames.append((p[0], p[1] if len(p) > 1 else ""))
        continue
    if head: samples.append((head, frames))
    head, frames = None, []
    m = re.match(r"\s*(\S+)\s+(\d+)/(\d+)", line)
    if m: head = m.groups()
if head: samples.append((head, frames))
parts, where = collections.Counter(), collections.Counter()
for (comm, pid, tid), fr in samples:
    names = [f for _, f in fr]
    kernel = " (kernel)" if fr and fr[0][0].startswith("ffffffff") else ""
    if comm.startswith("fsdprun"): parts["launcher"] += 1; continue
    if any(START.search(f) for f in names): parts["start-up"] += 1; continue
    if pid != tid: parts["comm threads" + kernel] += 1; continue
    ours = [f for f in names if re.search(r"fsdp::(detail|comm)::", f) and "call_unwrapped" not in f]
    if ours:
        parts["fsdp main thread" + kernel] += 1
        where[re.sub(r"\(.*", "", ours[0])[:70]] += 1
    else:
        parts["compute" + kernel] += 1
ms = lambda n: 1000.0 * n / 499 / steps / nproc
compute = parts["compute"] + parts["compute (kernel)"]
print(f"\n{steps} steps x {nproc} ranks; ms = samples / 499 Hz per step per rank (start-up included in steps)")
print("| part | samples | ms / step / rank | vs compute |\n|---|---|---|---|")
for k, v in parts.most_common():
    print(f"| {k} | {v} | {ms(v):.1f} | {100 * v / max(compute, 1):.1f}% |")
print("\nFSDP's main-thread samples by innermost frame of ours:")
for k, v in where.most_common(12): print(f"  {v:5d}  {k}")
PY
