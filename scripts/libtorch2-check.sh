#!/usr/bin/env bash
# Builds and tests the project against current LibTorch 2.x (Debian sid's libtorch-dev) inside a
# Debian sid chroot, from the same source tree as the Debian 12 (LibTorch 1.13) build.
#
#   scripts/libtorch2-check.sh           # CPU LibTorch 2.x: configure, build, ctest -LE version_neutral
#   scripts/libtorch2-check.sh --cuda    # CUDA LibTorch 2.x + NCCL: configure and compile only
#
# Each chroot lives outside the repository and is reused by later runs on the same machine:
#   FSDP_SID_CHROOT       CPU chroot     (default /var/cache/fsdp/chroot-sid)
#   FSDP_CUDA_CHROOT      CUDA chroot    (default /var/cache/fsdp/chroot-cuda)
#   FSDP_CUDA_SUITE       CUDA's suite   (default trixie: sid's contrib libtorch-cuda-dev 2.6 is
#                                         uninstallable there now, it needs the gone libonnx1t64)
#   FSDP_SID_MIRROR       Debian mirror  (default http://deb.debian.org/debian)
#   FSDP_SID_REFRESH=1    apt-get update + upgrade an existing chroot (otherwise it stays as made)
# A chroot counts only once its marker file exists; a half-made one is deleted and made again.
# The repository is bind-mounted read-only at /src; the build folder is inside the chroot
# (/build-torch2, /build-torch2-cuda), so it never touches the repository or the host's build/.
# Needs root (debootstrap, mount, chroot). Builds with -j2: two cores, heavy headers.
set -euo pipefail
# shellcheck disable=SC2317,SC2016  # trap handlers are called indirectly; dpkg's ${...} formats
# The whole script is read before it runs (main), so editing it during a run cannot break that run.
main() {

REPO="$(cd "$(dirname "$0")/.." && pwd)"
FLAVOUR=cpu
for arg in "$@"; do
  case "$arg" in
    --cuda) FLAVOUR=cuda ;;
    -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "libtorch2-check: unknown argument '$arg' (use --cuda or nothing)" >&2; exit 2 ;;
  esac
done

MIRROR="${FSDP_SID_MIRROR:-http://deb.debian.org/debian}"
JOBS=2
CMAKE_ARGS="-DCMAKE_BUILD_TYPE=Release"
# What this half builds and runs (docs/building.md, "What the LibTorch 2.x half runs"): no benchmark
# programs, and not the suites labelled version_neutral, whose LibTorch calls the others make too.
SUBSET_ARGS="-DFSDP_BUILD_BENCHMARKS=OFF -DFSDP_VERSION_NEUTRAL_TESTS=OFF"
if [ "$FLAVOUR" = cpu ]; then
  CHROOT="${FSDP_SID_CHROOT:-/var/cache/fsdp/chroot-sid}"
  SUITE=sid
  COMPONENTS="main"
  PACKAGES=(libtorch-dev libgloo-dev libopenblas0-pthread cmake ninja-build g++ ccache libgtest-dev iproute2
            nlohmann-json3-dev zlib1g-dev libcli11-dev libsentencepiece-dev libabsl-dev sentencepiece)
  # The other side of the checks against PyTorch's own tools: torchrun (python3-torch), transformers
  # and its tokenizers (protobuf reads a tokenizer.model). ~107 MB of downloads, ~1 min to install;
  # an existing chroot gets whichever are missing.
  PACKAGES+=(python3-torch python3-transformers python3-safetensors python3-tokenizers python3-sentencepiece
             python3-protobuf)
  # Tests that skip where these are absent must run here: they fail instead of skipping.
  REQUIRE_PYTHON=1
  BUILD=/build-torch2
  CMAKE_ARGS+=" $SUBSET_ARGS"
else
  CHROOT="${FSDP_CUDA_CHROOT:-/var/cache/fsdp/chroot-cuda}"
  SUITE="${FSDP_CUDA_SUITE:-trixie}"
  # libtorch-cuda-dev, libgloo-cuda-dev and libnccl-dev are in contrib; the CUDA toolkit (nvcc,
  # which Caffe2's CMake config looks for) is in non-free. libgloo-dev conflicts with the CUDA Gloo.
  COMPONENTS="main contrib non-free"
  PACKAGES=(libtorch-cuda-dev libgloo-cuda-dev libnccl-dev nvidia-cuda-toolkit cmake ninja-build g++ ccache libgtest-dev
            nlohmann-json3-dev zlib1g-dev libcli11-dev libsentencepiece-dev libabsl-dev)
  BUILD=/build-torch2-cuda
  REQUIRE_PYTHON=0
  # No cuDNN (see the stub below): executables link with its symbols unresolved; nothing runs.
  CMAKE_ARGS+=" -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined"
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
[ -n "$CHROOT" ] || die "refusing to use / as the chroot"
case "$CHROOT/" in
  "$REPO"/*) die "the chroot ($CHROOT) must live outside the repository ($REPO)" ;;
esac

# The lock, mounts and unmounts (shared with fsdp2-cpu-compare.sh).
# shellcheck source-path=SCRIPTDIR source=lib/chroot.sh
. "$REPO/scripts/lib/chroot.sh"

# One run per chroot at a time (a CI run and a developer's run on the same machine).
chroot_lock libtorch2-check

cleanup() {
  local rc=$?
  chroot_unmount_all
  if [ -n "$(chroot_mounts_under "$CHROOT")" ]; then
    echo "libtorch2-check: could not unmount everything under $CHROOT:" >&2
    chroot_mounts_under "$CHROOT" >&2
  fi
  exit "$rc"
}
# SIGINT/SIGTERM (Ctrl-C, a CI timeout) stop the build or the tests at once: every process of the
# child's session (ctest, and the rank processes that tests put in process groups of their own),
# then the EXIT trap unmounts.
CHILD=""
stop() {
  if [ -n "$CHILD" ]; then
    pkill -TERM -s "$CHILD" 2>/dev/null || kill -TERM -- "-$CHILD" 2>/dev/null || true
  fi
  exit "$1"
}
trap cleanup EXIT
trap 'stop 130' INT
trap 'stop 143' TERM

# Mounts left by a run that was killed with SIGKILL: unmount them before anything else.
chroot_unmount_all
[ -z "$(chroot_mounts_under "$CHROOT")" ] || die "mounts remain under $CHROOT; unmount them first"

do_mounts() { chroot_mount "$REPO" "$SRC"; }

in_chroot() { chroot_run -- "$@"; }

# A mirror that serves a frozen snapshot (as on machines whose clock is past the snapshot's
# Valid-Until) makes apt refuse its Release file; accept it then, and say so.
apt_update() {
  local out
  if out=$(in_chroot apt-get update -q 2>&1); then return 0; fi
  if grep -q "is expired" <<<"$out" && [ ! -f "$CHROOT/etc/apt/apt.conf.d/99fsdp-valid-until" ]; then
    log "the mirror's $SUITE Release file has expired (a frozen snapshot?): apt accepts it in this chroot"
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

# Debian's nvidia-cudnn (a dependency of libtorch-cuda) is an installer that downloads cuDNN from
# NVIDIA when configured: unreachable here, and the compile check needs no cuDNN (Caffe2's CMake
# config says USE_CUDNN=0 without it). A local stand-in with a higher version takes its place
# before apt sees the real one, so its installer never runs; held so an upgrade keeps it.
install_cudnn_stub() {
  local d=/tmp/fsdp-nvidia-cudnn-stub
  rm -rf "$CHROOT$d" && mkdir -p "$CHROOT$d/DEBIAN"
  cat >"$CHROOT$d/DEBIAN/control" <<'EOF'
Package: nvidia-cudnn
Version: 99:0+fsdp.stub
Architecture: amd64
Maintainer: fsdp scripts/libtorch2-check.sh <root@localhost>
Section: contrib/libs
Priority: optional
Description: stand-in for Debian's cuDNN installer (compile checks only)
 Debian's nvidia-cudnn downloads cuDNN from NVIDIA when configured. The compile check of
 scripts/libtorch2-check.sh --cuda runs no CUDA code and reaches only the Debian mirror.
EOF
  in_chroot dpkg-deb --build --root-owner-group "$d" "$d.deb" >/dev/null
  in_chroot dpkg -i "$d.deb" >/dev/null
  in_chroot apt-mark hold nvidia-cudnn >/dev/null
}

# ---- the chroot ----------------------------------------------------------------------------------
want="$FLAVOUR $SUITE [$COMPONENTS]: ${PACKAGES[*]}"
if [ -f "$MARKER" ] && [ "$(head -n1 "$MARKER" | cut -d: -f1)" != "${want%%:*}" ]; then
  log "$CHROOT was made for '$(head -n1 "$MARKER" | cut -d: -f1)', not '${want%%:*}': making it again"
  rm -f "$MARKER"
fi
if [ -f "$MARKER" ]; then
  log "reusing $CHROOT ($(cat "$MARKER"))"
  do_mounts
  if [ "${FSDP_SID_REFRESH:-0}" = 1 ]; then
    log "refreshing: apt-get update + upgrade"
    apt_update
    in_chroot apt-get upgrade -y -q >"$CHROOT/var/log/fsdp-apt.log" 2>&1 ||
      { tail -n 40 "$CHROOT/var/log/fsdp-apt.log" >&2; die "apt-get upgrade failed in $CHROOT"; }
  fi
  missing=()
  for p in "${PACKAGES[@]}"; do
    in_chroot dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    t_install=$SECONDS
    log "installing ${missing[*]}"
    apt_update
    apt_install "${missing[@]}"
    in_chroot apt-get clean
    echo "$want" >"$MARKER"
    log "installed in $((SECONDS - t_install)) s"
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
  log "debootstrap $SUITE into $CHROOT (minbase)"
  mkdir -p "$CHROOT"
  debootstrap --variant=minbase --components="${COMPONENTS// /,}" "$SUITE" "$CHROOT" "$MIRROR" \
    >"$CHROOT.debootstrap.log" 2>&1 ||
    { tail -n 40 "$CHROOT.debootstrap.log" >&2; die "debootstrap failed (log: $CHROOT.debootstrap.log)"; }
  echo "deb $MIRROR $SUITE $COMPONENTS" >"$CHROOT/etc/apt/sources.list"
  # Keep the chroot lean: no documentation or man pages from the packages below.
  cat >"$CHROOT/etc/dpkg/dpkg.cfg.d/01-fsdp-nodoc" <<'EOF'
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
EOF
  do_mounts
  if [ "$FLAVOUR" = cuda ]; then install_cudnn_stub; fi
  log "apt-get install ${PACKAGES[*]} ($(elapsed) so far)"
  apt_update
  apt_install "${PACKAGES[@]}"
  in_chroot apt-get clean
  echo "$want" >"$MARKER"
  log "chroot ready in $(elapsed): $(du -sh --one-file-system "$CHROOT" 2>/dev/null | cut -f1)"
fi

# TORCH_VERSION_MAJOR/MINOR/PATCH (2.14 keeps them in torch/headeronly/version.h).
torch_version() {
  in_chroot sh -c 'cat /usr/include/torch/headeronly/version.h /usr/include/torch/csrc/api/include/torch/version.h \
      2>/dev/null' | awk '$1 == "#define" && $2 ~ /^TORCH_VERSION_(MAJOR|MINOR|PATCH)$/ { v[$2] = $3 }
      END { if (v["TORCH_VERSION_MAJOR"] != "") printf "%s.%s.%s", v["TORCH_VERSION_MAJOR"], v["TORCH_VERSION_MINOR"], v["TORCH_VERSION_PATCH"] }'
}
pkg_version() { in_chroot dpkg-query -W -f='${Version}' "$1" 2>/dev/null || echo "?"; }
about="${PACKAGES[0]} $(pkg_version "${PACKAGES[0]}"), g++ $(in_chroot g++ -dumpfullversion)"
about+=", cmake $(in_chroot cmake --version | head -n1 | awk '{print $3}')"
if [ "$FLAVOUR" = cuda ]; then
  about+=", nvcc $(in_chroot nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), libnccl-dev $(pkg_version libnccl-dev)"
fi
log "LibTorch $(torch_version) on Debian $SUITE ($about)"

# ---- configure, build, test ----------------------------------------------------------------------
# TCPStore's libuv path (default on in 2.x) is missing from Debian's LibTorch; compat reads
# USE_LIBUV (default off), set here explicitly.
# Runs in the background of its own session so that a signal to this script is handled at once
# (bash defers traps until a foreground child ends) and can stop the whole group.
inside() {
  local rc=0
  setsid env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
    USE_LIBUV=0 FSDP_REQUIRE_PYTHON_CHECKS="$REQUIRE_PYTHON" TERM="${TERM:-dumb}" chroot "$CHROOT" bash -c "$1" </dev/null &
  CHILD=$!
  wait "$CHILD" || rc=$?
  CHILD=""
  return "$rc"
}
# Configured every run (seconds), so that a build folder made by an older version of this script
# gets today's options.
log "configure ($BUILD inside the chroot)"
inside "cmake -S $SRC -B $BUILD -G Ninja $CMAKE_ARGS >/dev/null"
# Always from clean, through ccache (kept in the chroot): the build folder is shared by every checkout
# that runs this on the machine (all are /src inside), and ninja's timestamps would take another
# checkout's older files for up to date. A warm rebuild costs seconds.
log "build (-j$JOBS, from clean through ccache, $(elapsed) so far)"
inside "cmake --build $BUILD --target clean >/dev/null && cmake --build $BUILD -- -j$JOBS"
if [ "$FLAVOUR" = cuda ]; then
  grep -q 'FSDP_HAS_NCCL=1' "$CHROOT$BUILD/build.ninja" ||
    die "the CUDA flavour built without the NCCL backend (FSDP_HAS_NCCL off; see cmake/FsdpBackends.cmake)"
  log "LibTorch $(torch_version) CUDA: configured and compiled with FSDP_HAS_NCCL in $(elapsed) (no GPU: no tests)"
  exit 0
fi
# The checks against torchrun and transformers are registered only where CMake found a python3:
# here they must be (FSDP_REQUIRE_PYTHON_CHECKS turns their skips into failures).
python_tests=$(inside "cd $BUILD && ctest -N -R '^python_'" | grep -c 'Test *#' || true)
[ "$python_tests" -ge 4 ] ||
  die "ctest lists $python_tests python_* tests in $BUILD (expected 4: python_hf_logits, python_hf_adamw, python_hf_export, python_spm_tokenizer)"
log "ctest -LE version_neutral ($(elapsed) so far)"
inside "cd $BUILD && ctest --output-on-failure -LE version_neutral"
log "LibTorch $(torch_version): build and tests passed in $(elapsed)"
}
main "$@"
exit
