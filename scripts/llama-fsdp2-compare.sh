#!/usr/bin/env bash
# Our fully_shard on models/llama (built against Debian sid's LibTorch 2.x) next to PyTorch's FSDP2
# on transformers' LlamaForCausalLM (sid's python3-torch and python3-transformers: the same
# LibTorch), same shape, per-rank batch, fp32, fused attention (sdpa) and threads, inside the sid
# chroot that scripts/libtorch2-check.sh makes. By hand, never in CI (a step is seconds).
#
#   scripts/llama-fsdp2-compare.sh [--rounds 3] [--steps 3] [--warmup 1] [--nproc 2]
#       [--shape "12 768 12 4 2048 32000"] [--seq 256] [--batch 2] [--wrap layers|split]
#
# --shape: layers, hidden, heads, KV heads, intermediate, vocabulary (default: the ~100M Llama of
# docs/benchmarks.md). --wrap: the units, the same on both sides (layers: one per decoder layer,
# the rest in the root's; split: also the embedding and [norm, lm_head], torchtitan's). Each round
# runs, in turn: ours one process (one rank's batch: the limit), ours FSDP (fsdprun +
# llama_scale_bench --role train), theirs one process, theirs FSDP2
# (benchmarks/fsdp2_bench.py llama); every run gets OMP_NUM_THREADS = cores / nproc. Prints each
# round's step times and the medians over rounds, with ours / theirs and the FSDP / one-process
# ratios, and each side's median forward / backward / optimizer seconds. Builds llama_scale_bench and fsdprun in /build-torch2 (the chroot's build folder of
# libtorch2-check.sh) under /tmp/fsdp-build.lock.
#
#   FSDP_SID_CHROOT   the chroot (default /var/cache/fsdp/chroot-sid)
#   FSDP_COMPARE_BUILD  the build folder inside it (default /build-torch2; another one keeps a
#                     checkout's builds apart from libtorch2-check.sh's)
# Needs root (mount, chroot); holds the chroot's lock throughout.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CHROOT="${FSDP_SID_CHROOT:-/var/cache/fsdp/chroot-sid}"
CHROOT="${CHROOT%/}"
ROUNDS=3 STEPS=3 WARMUP=1 NPROC=2 SHAPE="12 768 12 4 2048 32000" SEQ=256 BATCH=2 WRAP=layers
while (($#)); do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --shape) SHAPE="$2"; shift 2 ;;
    --seq) SEQ="$2"; shift 2 ;;
    --batch) BATCH="$2"; shift 2 ;;
    --wrap) WRAP="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "llama-fsdp2-compare: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { printf 'llama-fsdp2-compare: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (mount, chroot)"
[ -f "$CHROOT/.fsdp-chroot-complete" ] || die "no chroot at $CHROOT: make it with FSDP_SID_CHROOT=$CHROOT scripts/libtorch2-check.sh"
read -r LAYERS HIDDEN HEADS KV FFN VOCAB <<<"$SHAPE"
[ -n "$VOCAB" ] || die "--shape takes six numbers: layers hidden heads kv-heads intermediate vocab"
[ "$WRAP" = layers ] || [ "$WRAP" = split ] || die "--wrap takes layers or split, got '$WRAP'"

# shellcheck source-path=SCRIPTDIR source=../scripts/lib/compare_chroot.sh
. "$REPO/scripts/lib/compare_chroot.sh"
compare_chroot_setup llama-fsdp2-compare
CORES=$(nproc)
common=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS" --kv-heads "$KV" --ffn "$FFN" --vocab "$VOCAB"
        --seq "$SEQ" --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP")
printf 'llama-fsdp2-compare: torch %s, transformers %s; %s rounds x %s steps after %s warm-up; %s ranks x %s threads (%s cores); wrap %s; load average at start: %s\n' \
  "$(in_chroot python3 -c 'import torch; print(torch.__version__)')" \
  "$(in_chroot python3 -c 'import transformers; print(transformers.__version__)')" \
  "$ROUNDS" "$STEPS" "$WARMUP" "$NPROC" "$THREADS" "$CORES" "$WRAP" "$(cut -d' ' -f1-3 /proc/loadavg)"
run() { in_chroot env OMP_NUM_THREADS="$THREADS" timeout 3600 "$@"; }
for ((r = 0; r < ROUNDS; ++r)); do
  run "$BUILD/bin/llama_scale_bench" --role train --plain --result "$OUT/ours_single" "${common[@]}" | grep 'rank 0:' || true
  # rank 0's summary lines (and its table of FSDP's phases under FSDP_PHASE_TIMERS=1)
  run "$BUILD/bin/fsdprun" --nproc-per-node "$NPROC" --master-port 0 -- \
    "$BUILD/bin/llama_scale_bench" --role train --wrap "$WRAP" --result "$OUT/ours_fsdp" "${common[@]}" |
    awk '/^rank 0:/ { p = 1 } /^rank [1-9]/ { p = 0 } p' || true
  run python3 /src/benchmarks/fsdp2_bench.py llama --role single --nproc "$NPROC" --threads "$THREADS" \
    --result "$OUT/theirs_single" "${common[@]}"
  run python3 /src/benchmarks/fsdp2_bench.py llama --role fsdp2 --nproc "$NPROC" --threads "$THREADS" \
    --wrap "$WRAP" --result "$OUT/theirs_fsdp" "${common[@]}"
done
in_chroot python3 - "$OUT" "$NPROC" <<'EOF'
import statistics, sys
out, nproc = sys.argv[1:]
def rows(f):
    return [dict(zip(l.split()[0::2], map(float, l.split()[1::2]))) for l in open(f"{out}/{f}") if l.strip()]
runs = {k: rows(k) for k in ("ours_single", "ours_fsdp", "theirs_single", "theirs_fsdp")}
pc = {k: int(v[-1]["params"]) for k, v in runs.items()}
if len(set(pc.values())) != 1:
    sys.exit(f"llama-fsdp2-compare: the models differ in parameter count: {pc}")
print(f"\n{pc['ours_single'] / 1e6:.1f}M parameters; step seconds per round (ours 1 proc / ours FSDP / theirs 1 proc / theirs FSDP2):")
for i in range(len(runs["ours_single"])):
    print("  round %d: " % (i + 1) + " / ".join(f"{runs[k][i]['median_step_s']:.3f}" for k in runs))
m = {k: statistics.median(r["median_step_s"] for r in v) for k, v in runs.items()}
print("\n| ranks | ours 1 proc | ours FSDP | ours FSDP / 1 proc | theirs 1 proc | theirs FSDP2 | theirs FSDP2 / 1 proc "
      "| ours FSDP / theirs FSDP2 | first loss ours / theirs |\n|---|---|---|---|---|---|---|---|---|")
print(f"| {nproc} | {m['ours_single']:.3f} s | {m['ours_fsdp']:.3f} s | {m['ours_fsdp'] / m['ours_single']:.2f}x "
      f"| {m['theirs_single']:.3f} s | {m['theirs_fsdp']:.3f} s | {m['theirs_fsdp'] / m['theirs_single']:.2f}x "
      f"| {m['ours_fsdp'] / m['theirs_fsdp']:.2f}x | {runs['ours_fsdp'][0]['first_loss']:.4f} / "
      f"{runs['theirs_fsdp'][0]['first_loss']:.4f} |")
if all("forward_s" in r for v in runs.values() for r in v):
    print("\nmedian seconds of a step's parts (forward + loss / backward / optimizer step), rank 0:")
    for k, v in runs.items():
        print(f"  {k}: " + " / ".join(f"{statistics.median(r[p] for r in v):.3f}"
                                      for p in ("forward_s", "backward_s", "optimizer_s")))
EOF
printf '\nllama-fsdp2-compare: load average at the end: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
