# shellcheck shell=bash
# The set-up the chroot comparisons share (scripts/llama-fsdp2-compare.sh,
# scripts/moe-fsdp2-compare.sh): ours and PyTorch's side by side on LibTorch 2.14 in the sid chroot.
# Source it with CHROOT, REPO and NPROC set and die() defined, then call
#
#   compare_chroot_setup NAME
#
# which holds the chroot's lock (scripts/lib/chroot.sh), mounts REPO at /src (unmounted, and
# $CHROOT$OUT removed, when the script exits), checks that the chroot has python3-torch and
# python3-transformers, turns the benchmarks on in BUILD (libtorch2-check.sh configures that folder
# without them, and turns them off again) and builds llama_scale_bench and fsdprun there under the
# shared build lock. It sets OUT (/tmp/NAME inside the chroot, emptied), BUILD
# (FSDP_COMPARE_BUILD, default /build-torch2), THREADS (cores per rank) and defines in_chroot CMD...

compare_chroot_setup() {
  local name="$1"
  # shellcheck source-path=SCRIPTDIR source=chroot.sh disable=SC2153 # REPO: the caller's
  . "$REPO/scripts/lib/chroot.sh"
  chroot_lock "$name"
  OUT="/tmp/$name"
  trap 'chroot_unmount_all; rm -rf "$CHROOT$OUT"' EXIT
  chroot_unmount_all
  chroot_mount "$REPO" /src
  in_chroot() { chroot_run USE_LIBUV=0 -- "$@"; }
  in_chroot python3 -c 'import transformers, torch.distributed.fsdp' 2>/dev/null ||
    die "the chroot lacks python3-transformers or python3-torch (scripts/libtorch2-check.sh installs them)"
  BUILD="${FSDP_COMPARE_BUILD:-/build-torch2}"
  in_chroot cmake -S /src -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFSDP_BUILD_BENCHMARKS=ON >/dev/null
  (flock 8 && in_chroot cmake --build "$BUILD" --target llama_scale_bench fsdprun -- -j2 | tail -n 1) 8>/tmp/fsdp-build.lock
  THREADS=$(($(nproc) / NPROC))
  ((THREADS >= 1)) || THREADS=1
  in_chroot rm -rf "$OUT" && in_chroot mkdir -p "$OUT"
}
