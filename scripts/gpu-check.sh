#!/usr/bin/env bash
# The GPU check: build on a development machine, run on a GPU machine.
#
#   scripts/gpu-check.sh --prepare DIR             # development machine (CPU, network once)
#   DIR/gpu-check.sh --run DIR OUTDIR [--no-bench] # the GPU machine (Python's torch 2.11 for
#                                                  # CUDA 13; no network needed)
#
# --prepare builds fsdp_build_info, the GPU tests (test_gpu, test_gpu_two_ranks), gpu_bench and train_gpt against
# the CUDA LibTorch
# of the pip torch package the GPU machine has (the venv of scripts/cuda-build-check.sh,
# FSDP_TORCH_CUDA_DIR, default /var/cache/fsdp/torch-cuda; installed there if missing), target by
# target, niced and under the shared build lock (/tmp/fsdp-build.lock), then puts in DIR: the
# stripped binaries (bin/), the shared libraries they need beyond torch's own and the system's
# (lib/; libstdc++ and libgcc_s in lib/fallback/, used only when the machine's are older), this
# script, benchmarks/fsdp2_bench.py, scripts/trace_summary.py and stamp.txt (torch and CUDA
# versions, commit). DIR must be inside the repository and git-ignored (.gpu-deps is); copy it to
# the GPU machine beside the checkout. Its size is printed; over 60 MiB fails.
#
# --run: checks nvidia-smi (one line "no GPU" where there is none), that the machine's torch and
# CUDA are the ones the binaries were built for (refused at once, naming both, when not),
# LD_LIBRARY_PATH from the torch package, that fsdp_build_info says cuda=yes nccl=yes (a build
# without them fails), then runs two ranks on the GPU through Gloo (test_gpu_two_ranks), the GPU
# tests (the ones a crash or hang did not reach run again, up to 3 times), gpu_bench's rows (GPT;
# Llama 1.1B with MFU, activation checkpointing off and on; CPU offload, fused AdamW against
# LibTorch's), PyTorch's FSDP2 on the GPT and, where train_gpt is bundled, a traced step of it
# summarised by trace_summary.py --ops: the copies and kernel launches inside each FSDP phase
# ([Note: one copy kernel per unit]) (--no-bench: tests only). OUTDIR gets at most 3 files:
# summary.txt (every row and the two-rank test's result first; rewritten after every step, so a
# run stopped part-way leaves one), run.log (every step's output, concatenated) and test_gpu.xml.
# The whole run has 6 minutes (FSDP_GPU_CHECK_BUDGET_S, default 345 s from the start): each step
# runs under its own limit or what is left of the budget, whichever is less, and a step with under
# 10 s left is not run (the summary says which).
#
# Settings (environment): FSDP_PYTHON (the GPU machine's Python, default python3),
# FSDP_GPU_CONTINUE_WITHOUT_GPU=1 (a dry run on a CPU machine goes on past "no GPU": versions,
# libraries, build info, and the GPU tests, which skip), FSDP_CUDA_BUILD_DIR (--prepare's build
# folder, default build-cuda), FSDP_GPU_TARGETS (what --prepare builds and bundles, default
# "fsdp_build_info test_gpu test_gpu_two_ranks gpu_bench train_gpt"), FSDP_GPU_CHECK_BUDGET_S
# (--run's whole budget in seconds, default 345).
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
LIMIT_MIB=60
read -r -a TARGETS <<<"${FSDP_GPU_TARGETS:-fsdp_build_info test_gpu test_gpu_two_ranks gpu_bench train_gpt}"
BUDGET_S="${FSDP_GPU_CHECK_BUDGET_S:-345}"
# gpu_bench's rows, in the summary's first lines ("not run" where a step did not print them).
ROWS=(plain fsdp fsdp_keep fsdp_timers llama_plain llama_fsdp llama_plain_ac llama_fsdp_ac llama_offload_fused
  llama_offload_libtorch)

usage() { awk 'NR > 1 && /^#/ {sub(/^# ?/, ""); print; next} NR > 1 {exit}' "$SELF"; }  # the header above
die() { printf 'gpu-check: %s\n' "$*" >&2; exit 1; }

# ---- --prepare -----------------------------------------------------------------------------
prepare() {
  local dir="$1"
  local repo
  repo="$(cd "$(dirname "$SELF")/.." && pwd)"
  [ -f "$repo/CMakeLists.txt" ] || die "--prepare runs from the repository's scripts/ (not from a prepared DIR)"
  cd "$repo" || exit 1
  mkdir -p "$dir" || die "cannot create $dir"
  dir="$(cd "$dir" && pwd)"
  case "$dir/" in
    "$repo"/*) ;;
    *) echo "gpu-check: note: $dir is outside the repository; copy it to the GPU machine beside the checkout" >&2 ;;
  esac
  if git rev-parse --git-dir >/dev/null 2>&1 && ! git check-ignore -q "$dir"; then
    die "$dir is not git-ignored; it would show in git status and could be committed: use .gpu-deps"
  fi
  local cache="${FSDP_TORCH_CUDA_DIR:-/var/cache/fsdp/torch-cuda}" spec="${FSDP_TORCH_SPEC:-torch==2.11.0}"
  local build="${FSDP_CUDA_BUILD_DIR:-build-cuda}" venv
  venv="$cache/venv"
  local t0=$SECONDS
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "+ install $spec into $venv (about 2.5 GB, once)"
    mkdir -p "$cache" || die "cannot create $cache"
    [ -x "$venv/bin/python" ] || python3 -m venv "$venv" || die "python3 -m venv $venv failed"
    "$venv/bin/pip" download -q -d "$cache/wheels" "$spec" || die "pip download $spec failed"
    "$venv/bin/pip" install -q --no-index --find-links "$cache/wheels" "$spec" || die "pip install $spec failed"
  fi
  local torch_version torch_cuda torch_prefix site
  read -r torch_version torch_cuda torch_prefix site < <("$venv/bin/python" -c \
    'import torch, sysconfig; print(torch.__version__, torch.version.cuda, torch.utils.cmake_prefix_path, sysconfig.get_paths()["purelib"])' 2>/dev/null | tail -n 1)
  [ -n "${torch_cuda:-}" ] && [ "$torch_cuda" != None ] || die "$spec in $venv is not a CUDA build of torch"
  echo "gpu-check: torch $torch_version (CUDA $torch_cuda) from $venv"
  local cudacxx="${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
  [ -x "$cudacxx" ] || die "no nvcc (CUDA toolkit): install CUDA $torch_cuda's toolkit or set CUDACXX"
  local nv_prefixes
  nv_prefixes="$(find "$site/nvidia" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | paste -sd';' -)"
  if [ ! -f "$build/build.ninja" ]; then
    # The same configuration as scripts/cuda-build-check.sh (it shares the build folder).
    echo "+ cmake -S . -B $build (CUDA LibTorch of torch $torch_version)"
    CUDA_HOME="$(cd "$(dirname "$cudacxx")/.." && pwd)" nice -n 10 cmake -S . -B "$build" -G Ninja \
      -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_prefix;$nv_prefixes" \
      "-DCMAKE_CUDA_COMPILER=$cudacxx" "-DTORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}" \
      "-Dc10_LIBRARY=$site/torch/lib/libc10.so" || die "configure failed"
  fi
  local t o objs log=/tmp/gpu-check-build.$$.log
  for t in "${TARGETS[@]}"; do
    # Niced, under the shared build lock (/tmp/fsdp-build.lock) taken per target, so other builds
    # on this machine interleave between targets. FSDP_GPU_LOCK_EACH=object takes it per object
    # file instead (politer on a busy machine, slower when others hold it long).
    if [ "${FSDP_GPU_LOCK_EACH:-target}" = object ]; then
      objs="$(ninja -C "$build" -t inputs "$t" 2>/dev/null | grep -E '\.(o|gch)$' | sort -u)"
      for o in $(echo "$objs" | grep '\.gch$') $(echo "$objs" | grep '\.o$'); do
        ninja -C "$build" -n "$o" 2>/dev/null | grep -q 'no work to do' && continue
        flock /tmp/fsdp-build.lock nice -n 10 ninja -C "$build" -j2 "$o" >"$log" 2>&1 ||
          { tail -40 "$log"; die "building $o (for $t) failed"; }
      done
    fi
    if ninja -C "$build" -n "$t" 2>/dev/null | grep -q 'no work to do'; then
      echo "+ $t is up to date"
      continue
    fi
    echo "+ flock /tmp/fsdp-build.lock nice -n 10 cmake --build $build --target $t -- -j2"
    flock /tmp/fsdp-build.lock nice -n 10 cmake --build "$build" --target "$t" -- -j2 >"$log" 2>&1 ||
      { tail -40 "$log"; die "building $t failed"; }
  done
  rm -f "$log"
  "$build/bin/fsdp_build_info" | grep -q 'cuda=yes nccl=yes' ||
    die "$build/bin/fsdp_build_info does not say cuda=yes nccl=yes: the configure found no CUDA/NCCL"

  rm -rf "${dir:?}/bin" "${dir:?}/lib"
  mkdir -p "$dir/bin" "$dir/lib/fallback" || die "cannot write $dir"
  for t in "${TARGETS[@]}"; do
    strip -o "$dir/bin/$t" "$build/bin/$t" || die "strip $t failed"
  done
  # Libraries beyond torch's own (torch/lib, the nvidia/* packages: the GPU machine's torch package
  # has them) and the base system's (C library, loader, the driver's libcuda).
  local lib
  while read -r lib; do
    case "$lib" in
      "$site"/*) ;;
      */libc.so.* | */libm.so.* | */libdl.so.* | */libpthread.so.* | */librt.so.* | */libutil.so.* | */ld-linux*) ;;
      */libcuda.so.* | */libnvidia*) ;;
      */libstdc++.so.* | */libgcc_s.so.*) cp -L "$lib" "$dir/lib/fallback/" ;;
      *) cp -L "$lib" "$dir/lib/" ;;
    esac
  done < <(for t in "${TARGETS[@]}"; do ldd "$build/bin/$t"; done | awk '$2 == "=>" && $3 ~ /^\// {print $3}' | sort -u)
  # The C++ runtime can also come in only through torch's libraries; keep the build machine's.
  for lib in libstdc++.so.6 libgcc_s.so.1; do
    [ -f "$dir/lib/fallback/$lib" ] || cp -L "$(g++ -print-file-name="$lib")" "$dir/lib/fallback/" 2>/dev/null || true
  done
  cp "$SELF" "$dir/gpu-check.sh" && chmod +x "$dir/gpu-check.sh"
  cp benchmarks/fsdp2_bench.py scripts/trace_summary.py "$dir/"
  {
    echo "torch=$torch_version"
    echo "cuda=$torch_cuda"
    echo "commit=$(git rev-parse --short HEAD 2>/dev/null || echo ?)$(git diff --quiet HEAD 2>/dev/null || echo +changes)"
    echo "built=$(date -u '+%Y-%m-%d %H:%M UTC') on $(uname -n)"
    echo "targets=${TARGETS[*]}"
  } >"$dir/stamp.txt"
  (cd "$dir" && find bin lib -type f -printf '%10s  %p\n' | sort -k2)
  local size_kib size_mib
  size_kib=$(du -sk "$dir" | cut -f1)
  size_mib=$(((size_kib + 1023) / 1024))
  cat "$dir/stamp.txt"
  [ "$size_mib" -le "$LIMIT_MIB" ] || die "$dir holds $size_mib MiB, over the $LIMIT_MIB MiB budget"
  echo "gpu-check: $dir ready: $size_mib MiB (limit $LIMIT_MIB), prepared in $((SECONDS - t0)) s. On the GPU machine:"
  echo "  ${dir#"$repo"/}/gpu-check.sh --run ${dir#"$repo"/} OUTDIR"
}

# ---- --run ---------------------------------------------------------------------------------
OUT=""
BENCH=1
TWO_RANKS=""
NOT_RUN=0
STEP_NO=0
FAILED=()
SUMMARY=()
NOTES=()
t0=$SECONDS

# The rows first: every gpu_bench row (or "not run"), its target lines, the two-rank test's result.
summary_rows() {
  local log="$OUT/run.log" r
  echo "rows:"
  if [ "$BENCH" = 1 ] && [ "${GPU_LINE:-none}" != none ]; then
    for r in "${ROWS[@]}"; do
      grep -m1 -E "^row $r " "$log" 2>/dev/null || echo "row $r not run"
    done
    grep -E '^(target|offload fused vs) ' "$log" 2>/dev/null
    grep -m1 -E '^mfu basis: ' "$log" 2>/dev/null
  else
    echo "(no benchmark rows: $([ "$BENCH" = 1 ] && echo "no GPU" || echo "--no-bench"))"
  fi
  echo "two ranks on one GPU through Gloo (test_gpu_two_ranks, vs one process within 1e-5): ${TWO_RANKS:-not run}"
}

write_summary() {
  {
    echo "gpu-check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), $((SECONDS - t0)) s in all, budget $BUDGET_S s)"
    echo "machine: ${GPU_LINE:-?} | $(nproc) cores | torch ${TORCH_VERSION:-?} (CUDA ${TORCH_CUDA:-?})"
    summary_rows
    echo "built: $(tr '\n' ' ' <"$DIR/stamp.txt" 2>/dev/null)"
    ((${#NOTES[@]})) && printf 'note: %s\n' "${NOTES[@]}"
    echo
    echo "#  step                               ok?  time"
    ((${#SUMMARY[@]})) && printf '%s\n' "${SUMMARY[@]}"
    if [ -f "$OUT/run.log" ]; then
      if grep -q '^\[==========\]' "$OUT/run.log"; then
        echo
        echo "GPU tests:"
        # One line per test (those with their time), then the totals.
        grep -E '^\[ +(OK|FAILED|SKIPPED) +\] .*\([0-9]+ ms\)$|^\[  PASSED  \]|^\[  FAILED  \] [0-9]+ test' "$OUT/run.log" | head -50
      fi
      if grep -qE '^(config |bound |llama layers=|offload llama )' "$OUT/run.log"; then
        echo
        echo "GPU benchmark (the other lines):"
        grep -E '^(config |bound |llama layers=|offload llama )' "$OUT/run.log" | awk '!seen[$0]++' | head -8
      fi
    fi
    echo
    if ((${#FAILED[@]})); then
      echo "FAILED:"
      printf '  %s\n' "${FAILED[@]}"
    elif ((NOT_RUN)); then
      echo "all steps that ran passed; $NOT_RUN not run (the budget was spent)"
    else
      echo "all steps so far passed"
    fi
  } >"$OUT/summary.txt"
}

# step NAME LIMIT_S -- command...: runs it under `timeout` (LIMIT_S, or what is left of the run's
# budget when less), its output appended to run.log (and on screen), records the outcome, rewrites
# the summary. Returns the command's status; 125 where under 10 s of the budget were left (not run).
step() {
  local name="$1" limit="$2"
  shift 3
  STEP_NO=$((STEP_NO + 1))
  local left=$((BUDGET_S - (SECONDS - t0)))
  if ((left < 10)); then
    SUMMARY+=("$(printf '%-2d %-34s %-4s %4ds' "$STEP_NO" "$name" SKIP 0)")
    NOTES+=("step $STEP_NO ($name) not run: the run's $BUDGET_S s were spent")
    NOT_RUN=$((NOT_RUN + 1))
    write_summary
    return 125
  fi
  ((limit > left)) && limit=$left
  printf '\n== step %d: %s (limit %d s)\n+ %s\n' "$STEP_NO" "$name" "$limit" "$*" | tee -a "$OUT/run.log"
  local s=$SECONDS rc
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$OUT/run.log"
  rc=${PIPESTATUS[0]}
  local verdict=ok
  [ "$rc" -eq 0 ] || verdict=FAIL
  [ "$rc" -eq 124 ] && verdict=TIME
  SUMMARY+=("$(printf '%-2d %-34s %-4s %4ds' "$STEP_NO" "$name" "$verdict" $((SECONDS - s)))")
  if [ "$rc" -ne 0 ]; then
    FAILED+=("step $STEP_NO ($name): exit $rc$([ "$rc" -eq 124 ] && echo ", over its $limit s"): $*")
    printf 'gpu-check: step %d (%s) failed with exit %d\n' "$STEP_NO" "$name" "$rc" >&2
  fi
  write_summary
  return "$rc"
}

# A check that stops the run: one line on stderr and in the summary.
stop() {
  FAILED+=("$1")
  echo "gpu-check: $1" | tee -a "$OUT/run.log" >&2
  write_summary
  exit "${2:-1}"
}

run_check() {
  DIR="$1"
  OUT="$2"
  BENCH=1
  [ "${3:-}" = --no-bench ] && BENCH=0
  mkdir -p "$OUT" || die "cannot create $OUT"
  OUT="$(cd "$OUT" && pwd)"
  rm -f "$OUT/summary.txt" "$OUT/run.log" "$OUT/test_gpu.xml"
  [ -f "$DIR/stamp.txt" ] || die "'$DIR' is not a prepared folder (no stamp.txt): run scripts/gpu-check.sh --prepare $DIR on the development machine, and copy it here"
  DIR="$(cd "$DIR" && pwd)"
  local want_torch want_cuda
  want_torch="$(sed -n 's/^torch=//p' "$DIR/stamp.txt")"
  want_cuda="$(sed -n 's/^cuda=//p' "$DIR/stamp.txt")"

  # 1. A GPU: nvidia-smi sees one.
  local smi
  if ! smi="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1)" || [ -z "$smi" ]; then
    GPU_LINE="none"
    if [ "${FSDP_GPU_CONTINUE_WITHOUT_GPU:-0}" != 1 ]; then
      stop "no GPU: nvidia-smi $(command -v nvidia-smi >/dev/null && echo "found none ($(echo "$smi" | head -1))" || echo "is not installed")" 2
    fi
    NOTES+=("no GPU; going on (FSDP_GPU_CONTINUE_WITHOUT_GPU=1): the GPU tests skip, no benchmark")
  else
    GPU_LINE="$(echo "$smi" | head -1)"
  fi
  echo "gpu-check: GPU: $GPU_LINE" | tee -a "$OUT/run.log"

  # 2. The machine's torch and CUDA are the binaries' (refused at once otherwise).
  local py="${FSDP_PYTHON:-python3}" found
  found="$("$py" -c 'import torch, os; print(torch.__version__, torch.version.cuda, os.path.dirname(torch.__file__))' 2>&1 | tail -n 1)"
  read -r TORCH_VERSION TORCH_CUDA TORCH_DIR <<<"$found"
  [ -n "${TORCH_DIR:-}" ] && [ -d "$TORCH_DIR/lib" ] || stop "no usable torch in $py: $found"
  # The release and the CUDA version must match (a local tag alone, "+cu130", may differ).
  if [ "${TORCH_VERSION%%+*}" != "${want_torch%%+*}" ] || [ "$TORCH_CUDA" != "$want_cuda" ]; then
    stop "refused: this machine has torch $TORCH_VERSION (CUDA $TORCH_CUDA), the binaries were built for torch $want_torch (CUDA $want_cuda); prepare again against torch==${TORCH_VERSION%%+*} (FSDP_TORCH_SPEC)"
  fi
  echo "gpu-check: torch $TORCH_VERSION (CUDA $TORCH_CUDA) at $TORCH_DIR, as built" | tee -a "$OUT/run.log"

  # 3. The libraries: torch's, its nvidia/* packages', the bundled ones; the bundled C++ runtime
  # only when the machine's is too old for the binaries.
  local site nv
  site="$(dirname "$TORCH_DIR")"
  nv="$(find "$site/nvidia" -mindepth 2 -maxdepth 2 -type d -name lib 2>/dev/null | paste -sd: -)"
  export LD_LIBRARY_PATH="$TORCH_DIR/lib${nv:+:$nv}:$DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  if ldd "$DIR/bin/test_gpu" 2>&1 | grep -qE 'not found|GLIBCXX|CXXABI'; then
    export LD_LIBRARY_PATH="$DIR/lib/fallback:$LD_LIBRARY_PATH"
    NOTES+=("the machine's C++ runtime is older than the build's: the bundled one is used")
  fi
  local missing
  missing="$(for t in "$DIR"/bin/*; do ldd "$t" 2>&1; done | grep -E 'not found|version .* not found' | sort -u)"
  [ -z "$missing" ] || stop "the binaries miss libraries here: $(echo "$missing" | tr -s ' \t\n' ' ')"
  # Rank workers and their outputs stay under OUTDIR's run.log; scratch under /tmp.
  export FSDP_FLIGHT_RECORDER_DIR="${FSDP_FLIGHT_RECORDER_DIR:-/tmp/gpu-check-fr}"

  # 4. The build has CUDA and NCCL (a build without them must fail here, not skip its tests).
  step "build info (cuda=yes nccl=yes)" 10 -- "$DIR/bin/fsdp_build_info" || stop "fsdp_build_info did not run"
  grep -q 'cuda=yes nccl=yes' "$OUT/run.log" || stop "fsdp_build_info does not say cuda=yes nccl=yes: this build has no CUDA/NCCL path"

  # 5. Two ranks on the GPU through Gloo (its result goes to the summary's first lines), the GPU
  # tests, then the benchmarks. A test that crashes or hangs the binary ends that
  # invocation: the tests after it run again in a new one (up to 3 reruns, 170 s in all), so one
  # crash hides nothing else. The crashed test is named in the summary; test_main prints its stack.
  if [ -x "$DIR/bin/test_gpu_two_ranks" ]; then
    local two_from=$(($(wc -c <"$OUT/run.log") + 1)) two_rc
    step "two ranks on one GPU (Gloo)" 60 -- "$DIR/bin/test_gpu_two_ranks"
    two_rc=$?
    TWO_RANKS="$(tail -c +"$two_from" "$OUT/run.log" | awk -v rc="$two_rc" '
      /^\[ +OK +\] GpuTwoRanks\..* ms\)$/ {ok++} /^\[ +SKIPPED +\] GpuTwoRanks\..* ms\)$/ {skip++}
      /^\[ +FAILED +\] GpuTwoRanks\..* ms\)$/ {bad++}
      END {
        v = (rc == 0 && bad == 0) ? "passed" : (rc == 125 ? "not run (no time left)" : (rc == 124 ? "TIMED OUT" : "FAILED (exit " rc ")"))
        printf "%s: %d ok, %d failed, %d skipped", v, ok, bad, skip }')"
    write_summary
  fi
  local remaining crashed finished from left rc pass=0 budget=130 t_tests=$SECONDS
  remaining="$("$DIR/bin/test_gpu" --gtest_list_tests 2>/dev/null |
    awk '/^[^ ]/ {suite=$1} /^  [^ ]/ {print suite $1}')"
  while [ -n "$remaining" ]; do
    from=$(($(wc -c <"$OUT/run.log") + 1))
    left=$((budget - (SECONDS - t_tests)))
    ((left >= 20)) || { NOTES+=("no time left to run: $(echo "$remaining" | paste -sd' ' -)"); break; }
    if ((pass == 0)); then
      step "GPU tests" $((left < 110 ? left : 110)) -- "$DIR/bin/test_gpu" "--gtest_output=xml:$OUT/test_gpu.xml" \
        "--gtest_filter=$(echo "$remaining" | paste -sd: -)"
    else
      step "GPU tests (rerun $pass, after a crash)" "$left" -- "$DIR/bin/test_gpu" \
        "--gtest_filter=$(echo "$remaining" | paste -sd: -)"
    fi
    rc=$?
    # 0: all passed; 1: gtest's own failures (reported); 125: not run (no time left). Otherwise it
    # crashed or hung.
    { [ "$rc" -eq 0 ] || [ "$rc" -eq 1 ] || [ "$rc" -eq 125 ]; } && break
    pass=$((pass + 1))
    crashed="$(tail -c +"$from" "$OUT/run.log" | awk '/^\[ RUN      \] / {t=$4} /^\[ +(OK|FAILED|SKIPPED) +\] / {if ($NF ~ /\)$/) t=""} END {print t}')"
    [ -n "$crashed" ] && NOTES+=("$crashed ended the test binary (exit $rc: a crash or the limit)")
    finished="$(tail -c +"$from" "$OUT/run.log" | sed -nE 's/^\[ +(OK|FAILED|SKIPPED) +\] ([^ ]+) \([0-9]+ ms\)$/\2/p')"
    remaining="$(printf '%s\n' "$remaining" | grep -vxF -f <(printf '%s\n' "$crashed" $finished) || true)"
    ((pass <= 3)) || { NOTES+=("gave up after 3 reruns: $(echo "$remaining" | paste -sd' ' -)"); break; }
    write_summary
  done
  if [ "$BENCH" = 1 ] && [ "$GPU_LINE" != none ]; then
    # The rows by group, each in a process of its own (a group that fails leaves the others').
    step "gpu_bench: GPT rows" 45 -- "$DIR/bin/gpu_bench" --rows gpt --steps 10 --warmup 3 --rounds 1
    step "gpu_bench: Llama 1.1B rows (MFU)" 100 -- "$DIR/bin/gpu_bench" --rows llama --steps 6 --warmup 2 --rounds 1
    step "gpu_bench: CPU offload rows" 60 -- "$DIR/bin/gpu_bench" --rows offload --steps 3 --warmup 1 --rounds 1
    step "GPU benchmark (PyTorch FSDP2)" 35 -- "$py" "$DIR/fsdp2_bench.py" gpu --steps 10 --warmup 3
  fi
  if [ "$BENCH" = 1 ] && [ "$GPU_LINE" != none ] && [ -x "$DIR/bin/train_gpt" ]; then
    # One traced step of gpu_bench's model: what each FSDP phase issues ([Note: one copy kernel per unit]).
    local prof
    prof="$(mktemp -d)"
    step "train_gpt, one traced step" 60 -- "$DIR/bin/train_gpt" --device cuda --data synthetic --layers 12 --dim 1024 \
      --heads 16 --seq-len 1024 --batch-size 8 --mixed-precision bf16 --steps 4 --profile-steps 3:3 \
      --profile-dir "$prof" --checkpoint-every 0 --eval-every 0 --metrics "$prof/metrics.jsonl" \
      --checkpoint-dir "$prof/checkpoints" &&
      step "copies and kernels per phase" 30 -- "$py" "$DIR/trace_summary.py" --step 3 --ops "$prof/trace_rank0.json"
    rm -rf "$prof"
  fi
  write_summary
  echo
  cat "$OUT/summary.txt"
  ((${#FAILED[@]} == 0)) || exit 1
}

case "${1:-}" in
  --prepare) [ $# -eq 2 ] || { usage >&2; exit 2; }; prepare "$2" ;;
  --run)
    { [ $# -eq 3 ] || { [ $# -eq 4 ] && [ "$4" = --no-bench ]; }; } || { usage >&2; exit 2; }
    run_check "$2" "$3" "${4:-}" ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
