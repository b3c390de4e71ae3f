#!/usr/bin/env bash
# One command for a lent GPU machine (one H200, CUDA 13's nvcc, CMake, ninja, Python's torch 2.11
# with its LibTorch and NCCL; no network): build against the torch package's LibTorch, run the GPU
# tests and the GPU benchmark, write a one-screen summary and the logs.
#
#   scripts/gpu-check.sh --prepare DIR        # on a CPU machine with network: fetch the build
#                                             # dependencies the torch package lacks into DIR
#   scripts/gpu-check.sh --run DIR OUTDIR     # on the GPU machine: unpack DIR, configure, build,
#                                             # GPU tests, benchmark; summary.txt + logs in OUTDIR
#
# DIR holds Debian packages (GoogleTest, CLI11, nlohmann-json, zlib headers, gloo headers: about
# 2 MiB) fetched with `apt-get download`, unpacked on the GPU machine with `dpkg -x` into a private
# prefix (never into /). Only the checkout travels to the GPU machine, at most 64 MiB, so DIR must
# be inside the repository, git-ignored (the default .gpu-deps is), and named in the device tool's
# `carry`, e.g. run(command="scripts/gpu-check.sh --run .gpu-deps $OUT", carry=[".gpu-deps"]).
#
# Settings (environment):
#   FSDP_PYTHON          the Python whose torch to build against (default python3)
#   FSDP_GPU_BUILD_DIR   build folder (default build-gpu, git-ignored)
#   FSDP_GPU_DEPS_PREFIX where DIR is unpacked (default /tmp/fsdp-gpu-deps)
#   FSDP_GPU_JOBS        parallel compile jobs (default: the cores)
#   FSDP_GPU_SKIP_BENCH=1  tests only
#   FSDP_GPU_STOP_AFTER  stop after this step: "configure" or "build" (dry runs on a CPU machine)
# Every step prints its command; a failing step is named in the last line and in summary.txt.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO" || exit 1

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; }
die() { printf 'gpu-check: %s\n' "$*" >&2; exit 1; }

# Debian packages the torch package does not bring. The -dev packages' shared-library symlinks
# point to the runtime packages (zlib1g, libgloo0 is not needed: headers only).
DEPS=(libgtest-dev libcli11-dev nlohmann-json3-dev zlib1g-dev zlib1g libgloo-dev)
LIMIT_MIB=60

prepare() {
  local dir="$1"
  mkdir -p "$dir" || die "cannot create $dir"
  dir="$(cd "$dir" && pwd)"
  case "$dir/" in
    "$REPO"/*) ;;
    *) echo "gpu-check: note: $dir is outside the repository; only the checkout travels to the GPU machine" >&2 ;;
  esac
  if git -C "$REPO" rev-parse --git-dir >/dev/null 2>&1 && ! git -C "$REPO" check-ignore -q "$dir"; then
    echo "gpu-check: note: $dir is not git-ignored; it would travel (and count) with every device call, not only those that carry it" >&2
  fi
  command -v apt-get >/dev/null || die "--prepare needs apt-get (a Debian or Ubuntu machine with network)"
  echo "+ (cd $dir && apt-get download ${DEPS[*]})"
  (cd "$dir" && apt-get download "${DEPS[@]}") || die "apt-get download failed (run apt-get update first?)"
  local size
  size=$(du -sm "$dir" | cut -f1)
  ls -l "$dir"/*.deb
  [ "$size" -le "$LIMIT_MIB" ] || die "$dir holds $size MiB, over the $LIMIT_MIB MiB budget"
  echo "gpu-check: $dir ready ($size MiB). On the GPU machine: scripts/gpu-check.sh --run ${1} OUTDIR (carry ${1})"
}

# ---- --run ---------------------------------------------------------------------------------
STEP_NO=0
FAILED=()
SUMMARY=()
OUT=""
t0=$SECONDS
# step NAME LOG -- command...: prints the command, runs it with its output in OUT/LOG (and on
# screen), records the outcome. Returns the command's status.
step() {
  local name="$1" log="$2"
  shift 3
  STEP_NO=$((STEP_NO + 1))
  printf '\n== step %d: %s\n+ %s\n' "$STEP_NO" "$name" "$*"
  local s=$SECONDS rc
  "$@" 2>&1 | tee "$OUT/$log"
  rc=${PIPESTATUS[0]}
  local line
  line=$(printf '%-2d %-34s %-4s %4ds  %s' "$STEP_NO" "$name" "$([ "$rc" -eq 0 ] && echo ok || echo FAIL)" $((SECONDS - s)) "$log")
  SUMMARY+=("$line")
  if [ "$rc" -ne 0 ]; then
    FAILED+=("step $STEP_NO ($name): $*")
    printf 'gpu-check: step %d (%s) failed with exit %d: %s\n' "$STEP_NO" "$name" "$rc" "$*" >&2
  fi
  return "$rc"
}

write_summary() {
  {
    echo "gpu-check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - t0)) s in all)"
    echo "machine: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1) | $(nproc) cores"
    echo "torch: ${TORCH_VERSION:-?} (CUDA ${TORCH_CUDA:-?}) at ${TORCH_PREFIX:-?}"
    echo
    echo "#  step                               ok?  time  log"
    printf '%s\n' "${SUMMARY[@]}"
    if [ -f "$OUT/test_gpu.log" ]; then
      echo
      echo "GPU tests:"
      grep -E '^\[ +(OK|FAILED|SKIPPED) +\]|^\[  PASSED  \]|^\[  FAILED  \]|tests? ran' "$OUT/test_gpu.log" | grep -v ' listed below' | head -20
    fi
    if [ -f "$OUT/bench.log" ]; then
      echo
      echo "GPU benchmark:"
      grep -E '^(row|config|target|compute-stream)' "$OUT/bench.log" | head -12
    fi
    [ -f "$OUT/fsdp2.log" ] && grep -E '^row' "$OUT/fsdp2.log" | head -3
    echo
    if ((${#FAILED[@]})); then
      echo "FAILED:"
      printf '  %s\n' "${FAILED[@]}"
    else
      echo "all steps passed"
    fi
  } >"$OUT/summary.txt"
  echo
  cat "$OUT/summary.txt"
}

# dpkg -x every package of DIR into PREFIX; absolute symlinks (e.g. libz.so -> /lib/...) are
# pointed into PREFIX, so nothing resolves to the machine's own files.
unpack_debs() {
  local dir="$1" prefix="$2" d l
  rm -rf "$prefix" && mkdir -p "$prefix" || return 1
  for d in "$dir"/*.deb; do
    [ -f "$d" ] || { echo "no .deb files in $dir"; return 1; }
    if command -v dpkg >/dev/null; then
      echo "dpkg -x $d $prefix"
      dpkg -x "$d" "$prefix" || return 1
    else  # no dpkg: a .deb is an ar archive around data.tar.xz
      echo "ar p $d data.tar.xz | tar -xJ -C $prefix"
      ar p "$d" data.tar.xz | tar -xJ -C "$prefix" || return 1
    fi
  done
  find "$prefix" -type l -lname '/*' | while read -r l; do ln -sfn "$prefix$(readlink "$l")" "$l"; done
}

run_check() {
  local dir="$1"
  OUT="$2"
  mkdir -p "$OUT" || die "cannot create $OUT"
  OUT="$(cd "$OUT" && pwd)"
  [ -d "$dir" ] || die "no dependency folder '$dir': run scripts/gpu-check.sh --prepare $dir on a CPU machine, and carry it"
  dir="$(cd "$dir" && pwd)"
  local py="${FSDP_PYTHON:-python3}"
  local build="${FSDP_GPU_BUILD_DIR:-build-gpu}"
  local prefix="${FSDP_GPU_DEPS_PREFIX:-/tmp/fsdp-gpu-deps}"
  local jobs="${FSDP_GPU_JOBS:-$(nproc)}"

  step "find torch" torch.log -- "$py" -c \
    'import torch, sysconfig; print(torch.__version__, torch.version.cuda, torch.utils.cmake_prefix_path, sysconfig.get_paths()["purelib"])' ||
    { write_summary; exit 1; }
  # The line with the versions (warnings, e.g. about NumPy, may come before it).
  read -r TORCH_VERSION TORCH_CUDA TORCH_PREFIX SITE < <(grep -E '^[0-9]+\.[0-9]+' "$OUT/torch.log" | tail -n 1)
  [ "$TORCH_CUDA" != None ] || { FAILED+=("step 1 (find torch): torch $TORCH_VERSION is a CPU build"); write_summary; exit 1; }

  step "unpack build dependencies" unpack.log -- unpack_debs "$dir" "$prefix" || { write_summary; exit 1; }

  local cudacxx="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
  local nv_prefixes
  nv_prefixes="$(find "$SITE/nvidia" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | paste -sd';' -)"
  # The unpacked prefix: CMake configs (GTest, CLI11, nlohmann_json), zlib, and gloo's headers
  # (c10d's ProcessGroupGloo.hpp includes them; the torch package does not ship them).
  step "configure" configure.log -- cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    "-DCMAKE_PREFIX_PATH=$TORCH_PREFIX;$nv_prefixes;$prefix/usr" "-DCMAKE_CUDA_COMPILER=$cudacxx" \
    "-DTORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}" "-DCMAKE_CXX_FLAGS=-isystem $prefix/usr/include" \
    "-Dc10_LIBRARY=$SITE/torch/lib/libc10.so" \
    -DFSDP_USE_CCACHE=OFF || { write_summary; exit 1; }

  if [ "${FSDP_GPU_STOP_AFTER:-}" = configure ]; then write_summary; echo "gpu-check: stopped after configure (FSDP_GPU_STOP_AFTER)"; return 0; fi
  step "build" build.log -- cmake --build "$build" --target fsdp_build_info test_gpu train_gpt gpu_bench -- -j"$jobs" ||
    { write_summary; exit 1; }

  if [ "${FSDP_GPU_STOP_AFTER:-}" = build ]; then write_summary; echo "gpu-check: stopped after build (FSDP_GPU_STOP_AFTER)"; return 0; fi
  step "build info" build_info.log -- "$build/bin/fsdp_build_info"

  step "GPU tests" test_gpu.log -- timeout 150 "$build/bin/test_gpu" "--gtest_output=xml:$OUT/test_gpu.xml"

  if [ "${FSDP_GPU_SKIP_BENCH:-0}" != 1 ]; then
    step "GPU benchmark (LibTorch, fully_shard)" bench.log -- timeout 100 "$build/bin/gpu_bench"
    step "GPU benchmark (PyTorch FSDP2)" fsdp2.log -- timeout 80 "$py" benchmarks/fsdp2_gpu_bench.py
  fi
  write_summary
  if ((${#FAILED[@]})); then
    echo "gpu-check: FAILED: ${FAILED[0]}" >&2
    exit 1
  fi
}

case "${1:-}" in
  --prepare) [ $# -eq 2 ] || { usage; exit 2; }; prepare "$2" ;;
  --run) [ $# -eq 3 ] || { usage; exit 2; }; run_check "$2" "$3" ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
