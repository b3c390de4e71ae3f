#!/usr/bin/env bash
# Installs what the project needs (Debian packages only) and builds it into ./build.
# Idempotent: installs only what is missing, then an incremental build (seconds when nothing
# changed). Fine as root; uses sudo otherwise.
#
#   scripts/setup.sh                 # deps + configure + build everything (what the tests need)
#   scripts/setup.sh fsdprun train_gpt   # build deps + configure + only these targets (and the library)
#   BUILD_DIR=out scripts/setup.sh   # another build folder
#   CMAKE_ARGS="-DCMAKE_PREFIX_PATH=/opt/libtorch" scripts/setup.sh   # another LibTorch
set -euo pipefail
cd "$(dirname "$0")/.."

# What building any target needs (the main job's first loss waits only for these).
PACKAGES=(
  libtorch-dev          # LibTorch (1.13 on Debian 12) with c10d headers
  libgloo-dev           # c10d's Gloo headers include gloo's
  libopenblas0-pthread  # otherwise Debian's libtorch runs on the reference BLAS (~12x slower)
  cmake ninja-build g++ ccache
  libgtest-dev          # GoogleTest (CMake configures the tests' targets too)
  nlohmann-json3-dev    # safetensors header JSON (library, private); train_gpt's metrics file
  zlib1g-dev            # crc32 of checkpoint files
  libcli11-dev          # train_gpt's command line (CLI11)
  libsentencepiece-dev  # the data library's SentencePiece tokenizers
  fortunes              # train_gpt's default corpus: /usr/share/games/fortunes/cookie (245 KB of English)
)
# What the tests and tools need besides: installed when everything is built (no targets given).
TEST_PACKAGES=(
  gnuplot-nox           # tools/plot: metrics -> PNG
  clang-format          # the pinned formatter (14): the CTest test `format`
  universal-ctags       # the CTest test `public_names`: the names the user's include declares
  sentencepiece         # spm_train/spm_encode: the tokenizer tests' other side
  openmpi-bin           # mpirun: tests/launcher/test_real_launchers starts train_gpt with Open MPI (docs/launching.md)
  slurmd slurmctld slurm-client munge  # srun/sbatch: scripts/slurm-local.sh, a one-machine cluster for test_real_launchers
)
if [ $# -eq 0 ]; then PACKAGES+=("${TEST_PACKAGES[@]}"); fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "setup: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

BUILD_DIR="${BUILD_DIR:-build}"
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  # shellcheck disable=SC2086
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${CMAKE_ARGS:-} >/dev/null
fi
# Targets named on the command line: only those (and what they link), so that the main job starts
# before the ~50 test programs are compiled; none: everything.
targets=()
for t in "$@"; do
  case "$t" in
    -h | --help) awk 'NR > 1 && /^#/ { print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    -*) echo "setup: unknown option '$t'; give CMake target names (e.g. fsdprun train_gpt) or nothing for all" >&2; exit 2 ;;
    *) targets+=(--target "$t") ;;
  esac
done
# Two cores, heavy headers: more parallel jobs only thrash memory.
cmake --build "$BUILD_DIR" "${targets[@]}" -- -j"$(nproc)"
