#!/usr/bin/env bash
# Compiles and links the whole project against the CUDA LibTorch of Python's `torch` package
# (the GPU machines' torch: 2.11 built for CUDA 13), on a machine without a GPU: what would break
# on the GPU machine breaks here first. Nothing needs a GPU; the GPU tests are then run once to
# check that they are registered and skip with their reason, and gpu_bench runs every row on the
# CPU (--dry-run-on-cpu).
#
#   scripts/cuda-build-check.sh            # install torch if missing, configure, build, GPU tests (skip)
#   scripts/cuda-build-check.sh --test     # ... and the whole ctest suite on the CPU against it
#
# Settings (environment):
#   FSDP_TORCH_CUDA_DIR   cache folder outside the repository   (default /var/cache/fsdp/torch-cuda)
#                         holding the venv (venv/) and pip's downloads (wheels/); reused by later runs
#   FSDP_TORCH_SPEC       the pip requirement                      (default torch==2.11.0: on PyPI
#                         that wheel is built for CUDA 13.0, like the GPU machines')
#   FSDP_CUDA_BUILD_DIR   build folder                             (default build-cuda, git-ignored)
#   CUDACXX               nvcc                                     (default: PATH, else /usr/local/cuda/bin/nvcc)
#   TORCH_CUDA_ARCH_LIST  GPU architectures (default 9.0, the H200; set, it spares Caffe2 a GPU probe)
# Needs: python3 with venv, network to the Python package registry on the first run (about 2.5 GB
# installed), CUDA's toolkit (nvcc and headers: Caffe2's CMake config looks for them), cmake,
# ninja, and the project's other build dependencies (scripts/setup.sh installs them).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"

RUN_SUITE=0
for arg in "$@"; do
  case "$arg" in
    --test) RUN_SUITE=1 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "cuda-build-check: unknown argument '$arg' (use --test, or nothing)" >&2; exit 2 ;;
  esac
done

CACHE="${FSDP_TORCH_CUDA_DIR:-/var/cache/fsdp/torch-cuda}"
SPEC="${FSDP_TORCH_SPEC:-torch==2.11.0}"
BUILD="${FSDP_CUDA_BUILD_DIR:-build-cuda}"
VENV="$CACHE/venv"
step=""
log() { printf 'cuda-build-check: %s\n' "$*"; }
run() { printf '+ %s\n' "$*"; "$@"; }
trap 'rc=$?; if [ $rc -ne 0 ]; then echo "cuda-build-check: FAILED in step: $step (exit $rc)" >&2; fi' EXIT
t0=$SECONDS

step="find nvcc"
if [ -z "${CUDACXX:-}" ]; then
  CUDACXX="$(command -v nvcc || true)"
  [ -n "$CUDACXX" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || CUDACXX=/usr/local/cuda/bin/nvcc
fi
[ -n "$CUDACXX" ] && [ -x "$CUDACXX" ] || {
  echo "cuda-build-check: no nvcc (CUDA toolkit) found; install CUDA 13's toolkit or set CUDACXX=/path/to/nvcc" >&2
  exit 1
}
export CUDACXX
CUDA_HOME="$(cd "$(dirname "$CUDACXX")/.." && pwd)"
export CUDA_HOME PATH="$CUDA_HOME/bin:$PATH"
log "nvcc: $CUDACXX ($("$CUDACXX" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'))"

step="install $SPEC into $VENV"
case "$CACHE" in
  "$REPO"|"$REPO"/*) echo "cuda-build-check: FSDP_TORCH_CUDA_DIR ($CACHE) must be outside the repository" >&2; exit 1 ;;
esac
mkdir -p "$CACHE"
if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
  [ -x "$VENV/bin/python" ] || run python3 -m venv "$VENV"
  # wheels/ keeps the downloads, so a half-finished install resumes without fetching again.
  run "$VENV/bin/pip" download -q -d "$CACHE/wheels" "$SPEC"
  run "$VENV/bin/pip" install -q --no-index --find-links "$CACHE/wheels" "$SPEC"
fi
read -r TORCH_VERSION TORCH_CUDA PREFIX < <("$VENV/bin/python" -c \
  'import torch; print(torch.__version__, torch.version.cuda, torch.utils.cmake_prefix_path)')
[ "$TORCH_CUDA" != None ] || { echo "cuda-build-check: $SPEC in $VENV is a CPU-only build; pick a CUDA one (FSDP_TORCH_SPEC)" >&2; exit 1; }
log "torch $TORCH_VERSION (CUDA $TORCH_CUDA), CMake prefix $PREFIX"

step="configure ($BUILD)"
# The venv's nvidia/* packages hold cuDNN, NCCL, cuBLAS, ... (torch links them through its RUNPATH);
# as CMake prefixes they let Caffe2's config and our NCCL check find the headers of the same
# versions the torch package was built with.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
NV_PREFIXES="$(find "$SITE/nvidia" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | paste -sd';' -)"
# c10_LIBRARY: TorchConfig looks for libc10 in the system folders before the package's own, so a
# machine with Debian's libtorch would link its libc10.so (1.13) next to the package's libtorch.
# shellcheck disable=SC2086
run cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_PREFIX_PATH=$PREFIX;$NV_PREFIXES" "-DCMAKE_CUDA_COMPILER=$CUDACXX" \
  "-DTORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}" "-Dc10_LIBRARY=$SITE/torch/lib/libc10.so" \
  ${FSDP_CUDA_CMAKE_ARGS:-}

step="build ($BUILD)"
run cmake --build "$BUILD" -- -j"$(nproc)"

step="check that every program links the package's LibTorch only"
for exe in "$BUILD"/bin/*; do
  if ldd "$exe" 2>/dev/null | grep -E 'lib(c10|torch[a-z_]*)\.so' | grep -v "$SITE/torch/lib" | grep -q .; then
    echo "cuda-build-check: $exe links a LibTorch library from outside $SITE/torch/lib:" >&2
    ldd "$exe" | grep -E 'lib(c10|torch[a-z_]*)\.so' >&2
    exit 1
  fi
done

step="check the NCCL and CUDA paths were compiled in"
run "$BUILD/bin/fsdp_build_info"
"$BUILD/bin/fsdp_build_info" | grep -q 'cuda=yes nccl=yes' || {
  echo "cuda-build-check: the build has no NCCL/CUDA path (see the configure output: FSDP_HAS_NCCL/FSDP_HAS_CUDA)" >&2
  exit 1
}

step="GPU tests (no GPU here: each must skip with its reason; test_gpu_two_ranks' CPU control runs)"
run ctest --test-dir "$BUILD" -L gpu --output-on-failure
step="gpu_bench's rows on the CPU (--dry-run-on-cpu: the GPT, the tiny Llama, the offload rows)"
OMP_NUM_THREADS=1 run "$BUILD/bin/gpu_bench" --dry-run-on-cpu --layers 1 --dim 32 --heads 2 --seq 16 --batch 2 \
  --steps 2 --warmup 1 --rounds 1
if [ "$RUN_SUITE" = 1 ]; then
  step="the whole suite on the CPU against torch $TORCH_VERSION"
  run ctest --test-dir "$BUILD" --output-on-failure -j1
fi
step=""
log "done in $(((SECONDS - t0) / 60))m$(((SECONDS - t0) % 60))s: compiled and linked against torch $TORCH_VERSION (CUDA $TORCH_CUDA)"
