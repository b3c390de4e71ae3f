#!/usr/bin/env bash
# Our mixture of experts (models/moe's Mixtral, built against Debian sid's LibTorch 2.x) under FSDP
# and under expert parallelism next to PyTorch's FSDP2 on transformers' MixtralForCausalLM (sid's
# python3-torch and python3-transformers: the same LibTorch), same shape, per-rank batch, fp32 and
# threads, inside the sid chroot that scripts/libtorch2-check.sh makes. By hand, never in CI (a
# step of the default 0.9B model is seconds to tens of seconds and a run holds 9-10.5 GiB a rank).
#
#   scripts/moe-fsdp2-compare.sh [--rounds 1] [--steps 3] [--warmup 1] [--nproc 2]
#       [--shape "8 1024 16 8 32000"] [--experts 16] [--top-k 2] [--moe-ffn 2048] [--seq 256]
#       [--batch 1] [--experts-impl I]
#
# --shape: layers, hidden, heads, KV heads, vocabulary (default: 0.896B parameters in all, 0.192B
# per token with the default experts). Each round runs, one at a time: ours FSDP (fsdprun +
# llama_scale_bench --role train --model moe --ep 1), ours EP (--ep NPROC: the experts split over
# the ranks, the rest FSDP), theirs FSDP2 (benchmarks/fsdp2_bench.py moe; --experts-impl: its
# experts_implementation, default transformers' choice); every run gets OMP_NUM_THREADS = cores /
# nproc. Prints each run's rank-0 summary, then a table of the medians over rounds (step, peak
# RSS of rank 0, all-to-all seconds and share, all-to-all bytes per step) and last the line
#   ours_fsdp2/pytorch=X ours_ep2/pytorch=Y
# (step-time ratios; the "2" is the default --nproc). Builds llama_scale_bench and fsdprun in
# /build-torch2 (the chroot's build folder of libtorch2-check.sh) under /tmp/fsdp-build.lock.
#
#   FSDP_SID_CHROOT     the chroot (default /var/cache/fsdp/chroot-sid)
#   FSDP_COMPARE_BUILD  the build folder inside it (default /build-torch2)
# Needs root (mount, chroot); holds the chroot's lock throughout.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CHROOT="${FSDP_SID_CHROOT:-/var/cache/fsdp/chroot-sid}"
CHROOT="${CHROOT%/}"
ROUNDS=1 STEPS=3 WARMUP=1 NPROC=2 SHAPE="8 1024 16 8 32000" EXPERTS=16 TOPK=2 MOEFFN=2048 SEQ=256 BATCH=1 IMPL=""
while (($#)); do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --nproc) NPROC="$2"; shift 2 ;;
    --shape) SHAPE="$2"; shift 2 ;;
    --experts) EXPERTS="$2"; shift 2 ;;
    --top-k) TOPK="$2"; shift 2 ;;
    --moe-ffn) MOEFFN="$2"; shift 2 ;;
    --seq) SEQ="$2"; shift 2 ;;
    --batch) BATCH="$2"; shift 2 ;;
    --experts-impl) IMPL="$2"; shift 2 ;;
    -h|--help) sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "moe-fsdp2-compare: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
die() { printf 'moe-fsdp2-compare: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (mount, chroot)"
[ -f "$CHROOT/.fsdp-chroot-complete" ] || die "no chroot at $CHROOT: make it with FSDP_SID_CHROOT=$CHROOT scripts/libtorch2-check.sh"
read -r LAYERS HIDDEN HEADS KV VOCAB <<<"$SHAPE"
[ -n "$VOCAB" ] || die "--shape takes five numbers: layers hidden heads kv-heads vocab"

# shellcheck source-path=SCRIPTDIR source=../scripts/lib/compare_chroot.sh
. "$REPO/scripts/lib/compare_chroot.sh"
compare_chroot_setup moe-fsdp2-compare
CORES=$(nproc)
common=(--layers "$LAYERS" --hidden "$HIDDEN" --heads "$HEADS" --kv-heads "$KV" --vocab "$VOCAB" --experts "$EXPERTS"
        --top-k "$TOPK" --moe-ffn "$MOEFFN" --seq "$SEQ" --batch "$BATCH" --steps "$STEPS" --warmup "$WARMUP")
impl=()
[ -z "$IMPL" ] || impl=(--experts-impl "$IMPL")
printf 'moe-fsdp2-compare: torch %s, transformers %s; %s rounds x %s steps after %s warm-up; %s ranks x %s threads (%s cores); load average at start: %s\n' \
  "$(in_chroot python3 -c 'import torch; print(torch.__version__)')" \
  "$(in_chroot python3 -c 'import transformers; print(transformers.__version__)')" \
  "$ROUNDS" "$STEPS" "$WARMUP" "$NPROC" "$THREADS" "$CORES" "$(cut -d' ' -f1-3 /proc/loadavg)"
run() { in_chroot env OMP_NUM_THREADS="$THREADS" timeout 3600 "$@"; }
ours() {  # ours with --ep $1, results to $OUT/$2; rank 0's lines
  run "$BUILD/bin/fsdprun" --nproc-per-node "$NPROC" --master-port 0 -- "$BUILD/bin/llama_scale_bench" --role train \
    --model moe --ep "$1" --result "$OUT/$2" "${common[@]}" | grep -E '^(\[rank0\]: )?(llama_scale_bench|rank 0:)' || true
}
for ((r = 0; r < ROUNDS; ++r)); do
  ours 1 ours_fsdp
  ours "$NPROC" ours_ep
  run python3 /src/benchmarks/fsdp2_bench.py moe --role fsdp2 --nproc "$NPROC" --threads "$THREADS" "${impl[@]}" \
    --result "$OUT/theirs_fsdp" "${common[@]}" | grep -E '^(fsdp2_bench|rank 0:)' || true
done
printf 'moe-fsdp2-compare: load average at the end: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
in_chroot python3 - "$OUT" "$NPROC" <<'EOF'
import statistics, sys
out, nproc = sys.argv[1:]
def rows(f):
    return [dict(zip(l.split()[0::2], map(float, l.split()[1::2]))) for l in open(f"{out}/{f}") if l.strip()]
runs = {k: rows(k) for k in ("ours_fsdp", "ours_ep", "theirs_fsdp")}
pc = {k: int(v[-1]["params"]) for k, v in runs.items()}
if len(set(pc.values())) != 1:
    sys.exit(f"moe-fsdp2-compare: the models differ in parameter count: {pc}")
med = lambda k, key: statistics.median(r.get(key, 0.0) for r in runs[k])
names = {"ours_fsdp": f"ours FSDP {nproc}", "ours_ep": f"ours EP {nproc}", "theirs_fsdp": f"PyTorch FSDP2 {nproc}"}
print(f"\n{pc['ours_fsdp'] / 1e9:.3f}B parameters; medians over {len(runs['ours_fsdp'])} rounds, rank 0:")
print("| run | step | forward + loss / backward / optimizer | peak RSS rank 0 | all-to-all | share | all-to-all bytes per step | first loss |")
print("|---|---|---|---|---|---|---|---|")
for k, name in names.items():
    step, a2a = med(k, "median_step_s"), med(k, "a2a_s")
    print(f"| {name} | {step:.2f} s | {med(k, 'forward_s'):.2f} / {med(k, 'backward_s'):.2f} / {med(k, 'optimizer_s'):.2f} s "
          f"| {med(k, 'peak_rss_bytes') / 2**30:.2f} GiB | {a2a:.3f} s | {100 * a2a / step:.1f}% "
          f"| {med(k, 'a2a_bytes') / 1e6:.1f} MB | {runs[k][0]['first_loss']:.4f} |")
theirs = med("theirs_fsdp", "median_step_s")
print(f"ours_fsdp{nproc}/pytorch={med('ours_fsdp', 'median_step_s') / theirs:.2f} "
      f"ours_ep{nproc}/pytorch={med('ours_ep', 'median_step_s') / theirs:.2f}")
EOF
