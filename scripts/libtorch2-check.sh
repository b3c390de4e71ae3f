#!/usr/bin/env bash
# Builds and tests the project against current LibTorch 2.x (Debian sid's libtorch-dev) inside a
# Debian sid chroot, from the same source tree as the Debian 12 (LibTorch 1.13) build.
#
#   scripts/libtorch2-check.sh           # CPU LibTorch 2.x: configure, build, whole ctest suite
#   scripts/libtorch2-check.sh --cuda    # CUDA LibTorch 2.x (sid contrib): configure + compile only
#
# The chroot lives outside the repository and is reused by later runs on the same machine:
#   FSDP_SID_CHROOT       CPU chroot      (default /var/cache/fsdp/chroot-sid)
#   FSDP_SID_CUDA_CHROOT  CUDA chroot     (default /var/cache/fsdp/chroot-sid-cuda)
#   FSDP_SID_MIRROR       Debian mirror   (default http://deb.debian.org/debian)
#   FSDP_SID_REFRESH=1    apt-get update + upgrade an existing chroot (otherwise it stays as made)
# A chroot is complete only once its marker file exists; a half-made one is deleted and rebuilt.
# The repository is bind-mounted read-only at /src; the build folder is inside the chroot
# (/build-torch2, /build-torch2-cuda), so it never touches the repository or the host's build/.
# Needs root (debootstrap, mount, chroot). Never more than -j2: two cores, heavy headers.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
FLAVOUR=cpu
for arg in "$@"; do
  case "$arg" in
    --cuda) FLAVOUR=cuda ;;
    -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "libtorch2-check: unknown argument '$arg' (use --cuda or nothing)" >&2; exit 2 ;;
  esac
done

MIRROR="${FSDP_SID_MIRROR:-http://deb.debian.org/debian}"
JOBS=2
if [ "$FLAVOUR" = cpu ]; then
  CHROOT="${FSDP_SID_CHROOT:-/var/cache/fsdp/chroot-sid}"
  COMPONENTS="main"
  PACKAGES=(libtorch-dev libgloo-dev libopenblas0-pthread cmake ninja-build g++ ccache libgtest-dev)
  BUILD=/build-torch2
else
  CHROOT="${FSDP_SID_CUDA_CHROOT:-/var/cache/fsdp/chroot-sid-cuda}"
  # libtorch-cuda-dev and libnccl-dev are in contrib; they depend on the CUDA toolkit (non-free).
  COMPONENTS="main contrib non-free"
  PACKAGES=(libtorch-cuda-dev libgloo-dev libnccl-dev cmake ninja-build g++ ccache libgtest-dev)
  BUILD=/build-torch2-cuda
fi
MARKER="$CHROOT/.fsdp-chroot-complete"
SRC=/src

log() { printf 'libtorch2-check: %s\n' "$*"; }
die() { printf 'libtorch2-check: %s\n' "$*" >&2; exit 1; }
t0=$SECONDS
elapsed() { printf '%dm%02ds' $(((SECONDS - t0) / 60)) $(((SECONDS - t0) % 60)); }

[ "$(id -u)" -eq 0 ] || die "needs root (debootstrap, mount, chroot); run it as root or with sudo"
case "$CHROOT" in
  /*) ;;
  *) die "the chroot path must be absolute: $CHROOT" ;;
esac
CHROOT="${CHROOT%/}"
[ "$CHROOT" != "" ] && [ "$CHROOT" != "/" ] || die "refusing to use / as the chroot"
case "$CHROOT/" in
  "$REPO"/*) die "the chroot ($CHROOT) must live outside the repository ($REPO)" ;;
esac

# Mount points under the chroot, deepest first (from /proc/self/mountinfo; octal escapes decoded).
mounts_under() {
  awk -v root="$1" '{ p = $5; gsub(/\\040/, " ", p); if (p == root || index(p, root "/") == 1) print p }' \
    /proc/self/mountinfo | sort -r
}
unmount_all() {
  local m
  for m in $(mounts_under "$CHROOT"); do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
  done
}

# One run per chroot at a time (a CI run and a developer's run on the same machine).
mkdir -p "$(dirname "$CHROOT")"
exec 9>"$CHROOT.lock"
if ! flock -n 9; then
  log "waiting for another run using $CHROOT"
  flock 9
fi

cleanup() {
  local rc=$?
  unmount_all
  if [ -n "$(mounts_under "$CHROOT")" ]; then
    echo "libtorch2-check: could not unmount everything under $CHROOT:" >&2
    mounts_under "$CHROOT" >&2
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Left-over mounts from a run that was killed -9: unmount before anything else.
unmount_all
[ -z "$(mounts_under "$CHROOT")" ] || die "mounts remain under $CHROOT; unmount them first"

do_mounts() {
  mkdir -p "$CHROOT/proc" "$CHROOT/sys" "$CHROOT/dev" "$CHROOT/dev/pts" "$CHROOT$SRC"
  mount -t proc proc "$CHROOT/proc"
  mount -t sysfs sysfs "$CHROOT/sys"
  mount --bind /dev "$CHROOT/dev"
  mount --bind /dev/pts "$CHROOT/dev/pts"
  if mountpoint -q /dev/shm; then mount --bind /dev/shm "$CHROOT/dev/shm"; fi
  mount --bind "$REPO" "$CHROOT$SRC"
  mount -o remount,bind,ro "$CHROOT$SRC"
  # debootstrap's copy can be stale; name resolution inside needs the host's.
  cp -L /etc/resolv.conf "$CHROOT/etc/resolv.conf" 2>/dev/null || true
}

in_chroot() {
  env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    DEBIAN_FRONTEND=noninteractive TERM="${TERM:-dumb}" chroot "$CHROOT" "$@"
}

# A mirror that serves a frozen snapshot of sid (as on machines whose clock is past the snapshot's
# Valid-Until) makes apt refuse its Release file; accept it then, and say so.
apt_update() {
  local out
  if out=$(in_chroot apt-get update -q 2>&1); then return 0; fi
  if grep -q "is expired" <<<"$out" && [ ! -f "$CHROOT/etc/apt/apt.conf.d/99fsdp-valid-until" ]; then
    log "the mirror's sid Release file has expired (a frozen snapshot?): apt accepts it in this chroot"
    echo 'Acquire::Check-Valid-Until "false";' >"$CHROOT/etc/apt/apt.conf.d/99fsdp-valid-until"
    out=$(in_chroot apt-get update -q 2>&1) && return 0
  fi
  printf '%s\n' "$out" | tail -n 20 >&2
  die "apt-get update failed in $CHROOT"
}

apt_install() {
  in_chroot apt-get install -y -q --no-install-recommends "$@" >"$CHROOT/var/log/fsdp-apt.log" 2>&1 ||
    { tail -n 40 "$CHROOT/var/log/fsdp-apt.log" >&2; die "apt-get install failed in $CHROOT"; }
}

# ---- the chroot ----------------------------------------------------------------------------------
want="$FLAVOUR: ${PACKAGES[*]} [$COMPONENTS]"
if [ -f "$MARKER" ]; then
  log "reusing $CHROOT ($(cat "$MARKER"))"
  do_mounts
  if [ "${FSDP_SID_REFRESH:-0}" = 1 ]; then
    log "refreshing: apt-get update + upgrade"
    apt_update
    in_chroot apt-get upgrade -y -q >"$CHROOT/var/log/fsdp-apt.log" 2>&1
  fi
  missing=()
  for p in "${PACKAGES[@]}"; do
    in_chroot dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt_update
    apt_install "${missing[@]}"
    echo "$want" >"$MARKER"
  fi
else
  if [ -e "$CHROOT" ]; then
    log "removing incomplete chroot $CHROOT"
    # Nothing is mounted under it (checked above), so rm cannot reach the host's /dev or the repo.
    rm -rf --one-file-system "$CHROOT"
  fi
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap on the host"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
  fi
  log "debootstrap sid into $CHROOT (minbase; a few minutes)"
  debootstrap --variant=minbase --components="${COMPONENTS// /,}" sid "$CHROOT" "$MIRROR" \
    >"$CHROOT.debootstrap.log" 2>&1 ||
    { tail -n 40 "$CHROOT.debootstrap.log" >&2; die "debootstrap failed (log: $CHROOT.debootstrap.log)"; }
  echo "deb $MIRROR sid $COMPONENTS" >"$CHROOT/etc/apt/sources.list"
  # Keep the chroot lean: no documentation or man pages from the packages below.
  cat >"$CHROOT/etc/dpkg/dpkg.cfg.d/01-fsdp-nodoc" <<'EOF'
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
EOF
  do_mounts
  log "apt-get install ${PACKAGES[*]} ($(elapsed) so far)"
  apt_update
  apt_install "${PACKAGES[@]}"
  in_chroot apt-get clean
  echo "$want" >"$MARKER"
  log "chroot ready in $(elapsed): $(du -sh --one-file-system "$CHROOT" 2>/dev/null | cut -f1)"
fi

torch_version() {
  local h
  h=$(in_chroot sh -c 'ls /usr/include/torch/version.h /usr/include/*/torch/version.h \
      /usr/lib/*/torch/include/torch/version.h 2>/dev/null | head -n1') || true
  if [ -n "$h" ]; then
    in_chroot sed -n 's/^#define TORCH_VERSION "\(.*\)"/\1/p' "$h"
  fi
}
pkg=${PACKAGES[0]}
log "LibTorch $(torch_version) ($pkg $(in_chroot dpkg-query -W -f='${Version}' "$pkg"), $(in_chroot g++ -dumpfullversion) g++, cmake $(in_chroot cmake --version | head -n1 | awk '{print $3}'))"

# ---- configure, build, test ----------------------------------------------------------------------
# TCPStore's libuv path (default on in 2.x) is missing from Debian's LibTorch: compat reads USE_LIBUV.
inside() {
  env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    USE_LIBUV=0 TERM="${TERM:-dumb}" chroot "$CHROOT" bash -c "$1"
}
if [ ! -f "$CHROOT$BUILD/build.ninja" ]; then
  log "configure ($BUILD inside the chroot)"
  cmake_args="-DCMAKE_BUILD_TYPE=Release"
  if [ "$FLAVOUR" = cuda ]; then
    # Compile only: no GPU here, so no tests; the CUDA toolkit's nvcc is needed by Caffe2's CMake.
    cmake_args+=" -DFSDP_BUILD_TESTS=ON"
  fi
  inside "cmake -S $SRC -B $BUILD -G Ninja $cmake_args"
else
  inside "cmake $BUILD >/dev/null"
fi
log "build (-j$JOBS, $(elapsed) so far)"
inside "cmake --build $BUILD -- -j$JOBS"
if [ "$FLAVOUR" = cuda ]; then
  inside "grep -q 'FSDP_HAS_NCCL:.*=ON' $BUILD/CMakeCache.txt || grep -q 'FSDP_HAS_NCCL=1' $BUILD/build.ninja" ||
    die "CUDA flavour built, but without the NCCL backend (FSDP_HAS_NCCL off)"
  log "CUDA flavour: configured and compiled with FSDP_HAS_NCCL (no tests: no GPU) in $(elapsed)"
  exit 0
fi
log "ctest ($(elapsed) so far)"
inside "cd $BUILD && ctest --output-on-failure"
log "LibTorch $(torch_version): build and tests passed in $(elapsed)"
