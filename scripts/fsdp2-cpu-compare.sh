#!/usr/bin/env bash
# Ours (fully_shard, built against Debian sid's LibTorch 2.x) next to PyTorch's own FSDP2 (Python,
# sid's python3-torch: the same LibTorch), on the same GPT, batch and threads, in one run with
# alternating repetitions, inside the sid chroot that scripts/libtorch2-check.sh makes.
#
#   scripts/fsdp2-cpu-compare.sh [--rounds 2] [--steps 8] [--warmup 2] [--rows ROWS] [--ddp]
#                                [--malloc default|speed|warm] [--bind none|cores|both] [--bucket-mb 25]
#                                [--ours-bucket-mb N]
#
# ROWS: space-separated NAME:LAYERS:DIM:HEADS:SEQ:BATCH_PER_RANK:RANKS entries (default: bench's
# GPT at 2 ranks, "3M:4:256:4:128:4:2"); --rows all adds ~3M at 3 and 4 ranks, ~25M and ~85M at 2.
# Per row and round: ours one process (the per-rank share: the limit), ours FSDP (fsdprun + bench
# --role fsdp), theirs one process, theirs FSDP2 (benchmarks/fsdp2_bench.py cpu). Every run gets
# OMP_NUM_THREADS = cores / ranks. Prints median step times and the ratios. --ddp adds, per round,
# our replicate (bench --parallel replicate) and PyTorch's DistributedDataParallel on the same work,
# and a second table with them and replicate's transport floor (bench's transport_floor: its
# all-reduces of a step replayed alone; the best ours / theirs that transport allows). It also builds and runs
# tests/models/test_attention (fused attention against the written-out one) against that LibTorch.
# --malloc speed gives every run, ours and theirs, the same fixed glibc malloc settings through
# GLIBC_TUNABLES (mmap threshold 32 MiB, trim threshold 256 MiB: fsdp::tune_malloc_for_speed's
# values). With glibc's defaults (--malloc default) the thresholds move with what each process has
# freed since it started, so the two sides do not run the same allocator: Python's imports leave
# it a high threshold, and our one-process step faults ~7,300 pages in again where Python's faults
# ~1,000 (docs/benchmarks.md, "Against PyTorch's FSDP2 and DDP"). --malloc warm gives ours that
# state: our runs call fsdp::raise_malloc_thresholds() first (bench --malloc warm: glibc's dynamic
# thresholds at 32 MiB / 64 MiB, where Python's imports leave them); theirs are left as they are.
#
# --bucket-mb N: both sides' replicate / DDP all-reduce in buckets of N MiB (DDP's bucket_cap_mb,
# our ReplicateOptions::bucket_cap_bytes; 25 by default, as DDP's). --ours-bucket-mb N gives ours
# N MiB and leaves DDP at --bucket-mb's (another bucket size of ours against DDP's default).
#
# --bind cores runs our FSDP and replicate with FSDP_CPU_BIND=cores (each rank and its transport
# threads on its own core, Gloo's threads with a short scheduler slice: fsdp/debug/cpu_tuning.h) and
# theirs as PyTorch leaves them; --bind both binds theirs too (each rank to its own core with
# os.sched_setaffinity before it joins the group: the binding without the slice, which Python
# cannot ask for), so neither side gains from a setting the other was denied.
#
#   FSDP_SID_CHROOT   the chroot (default /var/cache/fsdp/chroot-sid; run libtorch2-check.sh once to
#                     make it). python3-torch is installed into it when missing.
# Needs root (mount, chroot). Holds the chroot's lock (the one libtorch2-check.sh takes) throughout.
set -euo pipefail
main() {
REPO="$(cd "$(dirname "$0")/.." && pwd)"
CHROOT="${FSDP_SID_CHROOT:-/var/cache/fsdp/chroot-sid}"
CHROOT="${CHROOT%/}"
ROUNDS=2 STEPS=8 WARMUP=2 ROWS="3M:4:256:4:128:4:2" DDP=0 MALLOC=default BIND=none BUCKET_MB=25 OURS_BUCKET_MB=
while (($#)); do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --steps) STEPS="$2"; shift 2 ;;
    --warmup) WARMUP="$2"; shift 2 ;;
    --rows) ROWS="$2"; shift 2 ;;
    --ddp) DDP=1; shift ;;
    --malloc) MALLOC="$2"; shift 2 ;;
    --bind) BIND="$2"; shift 2 ;;
    --bucket-mb) BUCKET_MB="$2"; shift 2 ;;
    --ours-bucket-mb) OURS_BUCKET_MB="$2"; shift 2 ;;
    -h|--help) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "fsdp2-cpu-compare: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case "$MALLOC" in
  default | warm) MALLOC_ENV=() ;;
  speed) MALLOC_ENV=(GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456) ;;
  *) echo "fsdp2-cpu-compare: --malloc must be default, speed or warm, not '$MALLOC'" >&2; exit 2 ;;
esac
OURS_MALLOC=(--malloc default)
[ "$MALLOC" = warm ] && OURS_MALLOC=(--malloc warm)
case "$BIND" in
  none) OURS_BIND=(FSDP_CPU_BIND=none) THEIRS_BIND=() ;;
  cores) OURS_BIND=(FSDP_CPU_BIND=cores) THEIRS_BIND=() ;;
  both) OURS_BIND=(FSDP_CPU_BIND=cores) THEIRS_BIND=(--bind) ;;
  *) echo "fsdp2-cpu-compare: --bind must be none, cores or both, not '$BIND'" >&2; exit 2 ;;
esac
[ "$ROWS" = all ] && ROWS="3M:4:256:4:128:4:2 3M:4:256:4:128:4:3 3M:4:256:4:128:4:4 25M:8:512:8:128:4:2 85M:12:768:12:256:2:2"
log() { printf 'fsdp2-cpu-compare: %s\n' "$*"; }
die() { printf 'fsdp2-cpu-compare: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "needs root (mount, chroot)"
[ -f "$CHROOT/.fsdp-chroot-complete" ] || die "no chroot at $CHROOT: make it with FSDP_SID_CHROOT=$CHROOT scripts/libtorch2-check.sh"

# The lock, mounts and unmounts (shared with libtorch2-check.sh, whose lock this holds throughout).
# shellcheck source-path=SCRIPTDIR source=lib/chroot.sh
. "$REPO/scripts/lib/chroot.sh"
chroot_lock fsdp2-cpu-compare
trap 'chroot_unmount_all; rm -f "${DDP_ROWS:-}"' EXIT
chroot_unmount_all
[ -z "$(chroot_mounts_under "$CHROOT")" ] || die "mounts remain under $CHROOT; unmount them first"
chroot_mount "$REPO" /src
in_chroot() { chroot_run USE_LIBUV=0 -- "$@"; }
run_side() { chroot_run USE_LIBUV=0 "${MALLOC_ENV[@]}" -- "$@"; }  # a timed run: both sides, the same malloc
if ! in_chroot python3 -c 'import torch.distributed.fsdp' 2>/dev/null; then
  log "installing python3-torch into $CHROOT"
  in_chroot apt-get update -q >/dev/null || die "apt-get update failed in $CHROOT"
  in_chroot apt-get install -y -q --no-install-recommends python3-torch python3-numpy >"$CHROOT/var/log/fsdp-apt.log" 2>&1 ||
    { tail -n 20 "$CHROOT/var/log/fsdp-apt.log" >&2; die "apt-get install python3-torch failed"; }
fi
BUILD=/build-fsdp2-compare
DDP_ROWS="$(mktemp /tmp/fsdp2-compare-ddp-XXXXXX)"
log "torch $(in_chroot python3 -c 'import torch; print(torch.__version__)'); building bench, fsdprun, test_attention in $BUILD (chroot)"
# libtorch2-check.sh configures this folder without benchmarks: turn them on (it turns them off again).
in_chroot cmake -S /src -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_BENCHMARKS=ON >/dev/null
in_chroot cmake --build "$BUILD" --target bench fsdprun test_attention -- -j2 | tail -n 1
in_chroot timeout 300 "$BUILD/bin/test_attention" --gtest_brief=1 || die "test_attention failed against this LibTorch"

CORES=$(nproc)
printf '\nfsdp2-cpu-compare: %s rounds x %s steps after %s warm-up; %s cores; malloc %s; buckets %s MiB (ours %s); load average at start: %s\n' \
  "$ROUNDS" "$STEPS" "$WARMUP" "$CORES" "$MALLOC${MALLOC_ENV[*]:+ (${MALLOC_ENV[*]})}" "$BUCKET_MB" "${OURS_BUCKET_MB:-$BUCKET_MB}" "$(cut -d' ' -f1-3 /proc/loadavg)"
printf '\n| model | params | ranks | threads/rank | ours 1 proc | ours FSDP | ours / limit | theirs 1 proc | theirs FSDP2 | theirs / limit | ours FSDP / theirs FSDP2 | first loss ours / theirs | faults / step, 1 proc ours / theirs |\n'
printf '|---|---|---|---|---|---|---|---|---|---|---|---|---|\n'
for row in $ROWS; do
  IFS=: read -r name layers dim heads seq per_rank nproc <<<"$row"
  batch=$((per_rank * nproc)) threads=$((CORES / nproc)); ((threads >= 1)) || threads=1
  out="/tmp/fsdp2-compare-$name-$nproc"
  in_chroot rm -rf "$out" && in_chroot mkdir -p "$out"
  shape=(--layers "$layers" --dim "$dim" --heads "$heads" --seq "$seq" --batch "$batch" --nproc "$nproc"
         --steps "$STEPS" --warmup "$WARMUP")
  ours_shape=("${shape[@]}" "${OURS_MALLOC[@]}" --bucket-mb "${OURS_BUCKET_MB:-$BUCKET_MB}")
  for ((r = 0; r < ROUNDS; ++r)); do
    run_side env OMP_NUM_THREADS="$threads" timeout 3600 "$BUILD/bin/bench" --role single --result "$out/ours_single" "${ours_shape[@]}"
    run_side env OMP_NUM_THREADS="$threads" "${OURS_BIND[@]}" timeout 3600 "$BUILD/bin/fsdprun" --nproc-per-node "$nproc" --master-port 0 -- \
      "$BUILD/bin/bench" --role fsdp --result "$out/ours_fsdp" "${ours_shape[@]}" >/dev/null
    run_side env OMP_NUM_THREADS="$threads" timeout 3600 python3 /src/benchmarks/fsdp2_bench.py cpu --role single \
      --threads "$threads" --result "$out/theirs_single" "${shape[@]}"
    run_side env OMP_NUM_THREADS="$threads" timeout 3600 python3 /src/benchmarks/fsdp2_bench.py cpu --role fsdp2 \
      --threads "$threads" "${THEIRS_BIND[@]}" --result "$out/theirs_fsdp" "${shape[@]}"
    if ((DDP)); then
      run_side env OMP_NUM_THREADS="$threads" "${OURS_BIND[@]}" timeout 3600 "$BUILD/bin/fsdprun" --nproc-per-node "$nproc" --master-port 0 -- \
        "$BUILD/bin/bench" --role fsdp --parallel replicate --floor-steps "$STEPS" --result "$out/ours_ddp" "${ours_shape[@]}" >/dev/null
      run_side env OMP_NUM_THREADS="$threads" timeout 3600 python3 /src/benchmarks/fsdp2_bench.py cpu --role ddp \
        --bucket-mb "$BUCKET_MB" --threads "$threads" "${THEIRS_BIND[@]}" --result "$out/theirs_ddp" "${shape[@]}"
    fi
  done
  # Median over rounds of each run's median step; first losses and parameter counts from the files.
  in_chroot python3 - "$out" "$name" "$nproc" "$threads" <<'EOF'
import statistics, sys
out, name, nproc, threads = sys.argv[1:]
def read(f):
    rows = [dict(zip(l.split()[0::2], map(float, l.split()[1::2]))) for l in open(f"{out}/{f}") if l.strip()]
    return statistics.median(r["median_step_s"] for r in rows), rows[-1]
os_, osr = read("ours_single"); of, ofr = read("ours_fsdp"); ts, tsr = read("theirs_single"); tf, tfr = read("theirs_fsdp")
params = int(tsr["params"])
ours_params = int(ofr["param_bytes"] / 4)  # bench prints 6 significant digits
if abs(ours_params - params) > 1e-5 * params:
    sys.exit(f"fsdp2-cpu-compare: the models differ: ours {ours_params} parameters, theirs {params}")
print(f"| {name} | {params / 1e6:.2f}M | {nproc} | {threads} | {os_ * 1e3:.1f} ms | {of * 1e3:.1f} ms | {of / os_:.2f}x "
      f"| {ts * 1e3:.1f} ms | {tf * 1e3:.1f} ms | {tf / ts:.2f}x | {of / tf:.2f}x | {ofr['first_loss']:.4f} / {tfr['first_loss']:.4f} "
      f"| {osr['faults_per_step']:.0f} / {tsr['faults_per_step']:.0f} |")
EOF
  if ((DDP)); then
    in_chroot python3 - "$out" "$name" "$nproc" >>"$DDP_ROWS" <<'EOF'
import statistics, sys
out, name, nproc = sys.argv[1:]
rows = lambda f: [dict(zip(l.split()[0::2], map(float, l.split()[1::2]))) for l in open(f"{out}/{f}") if l.strip()]
med = lambda f, key="median_step_s": statistics.median(r[key] for r in rows(f))
os_, od, ts, td = med("ours_single"), med("ours_ddp"), med("theirs_single"), med("theirs_ddp")
# The floor (bench's transport_floor): our replicate's bucket all-reduces of a step replayed alone;
# with every core computing, no replicate, ours or theirs, beats limit + that CPU on Gloo.
fcpu = med("ours_ddp", "floor_cpu_s")
floor = (os_ + fcpu) / os_
print(f"| {name} | {nproc} | {os_ * 1e3:.1f} ms | {od * 1e3:.1f} ms | {od / os_:.3f}x | {fcpu * 1e3:.1f} ms "
      f"| {floor:.3f}x | {ts * 1e3:.1f} ms | {td * 1e3:.1f} ms | {td / ts:.3f}x | {od / td:.3f}x "
      f"| {floor * os_ / td:.3f}x |")
EOF
  fi
done
if ((DDP)); then
  printf '\nReplicate (DDP) on the same work (floor: ours 1 proc + the CPU of our replicate'"'"'s all-reduces of a step replayed alone; best: floor x ours 1 proc / theirs DDP, the lowest ours / theirs this transport allows):\n\n| model | ranks | ours 1 proc | ours replicate | ours / limit | floor CPU | floor / limit | theirs 1 proc | theirs DDP | theirs / limit | ours replicate / theirs DDP | best ours / theirs DDP |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n'
  cat "$DDP_ROWS"
fi
printf '\nfsdp2-cpu-compare: load average at the end: %s\n' "$(cut -d' ' -f1-3 /proc/loadavg)"
}
main "$@"
exit
