#!/usr/bin/env bash
# Fuzzes the safetensors header parser with libFuzzer (ASan + UBSan) for a while, then merges
# the inputs that found new coverage into the kept corpus tests/checkpoint/fuzz/corpus/ (which
# test_safetensors replays on every test run). Exits non-zero on a finding, naming the input.
#
#   scripts/fuzz-safetensors.sh          # 60 seconds
#   scripts/fuzz-safetensors.sh 600      # ten minutes
#   FUZZ_DIR=/tmp/f scripts/fuzz-safetensors.sh   # where the binary and crash files go
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
FUZZ_DIR="${FUZZ_DIR:-build/fuzz-safetensors}"
CORPUS=tests/checkpoint/fuzz/corpus

# clang with the fuzzer runtime (Debian 12: clang 14); installed like scripts/setup.sh does.
missing=()
command -v clang++ >/dev/null || missing+=(clang)
ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1 ||
  missing+=(libclang-rt-14-dev)
if ((${#missing[@]})); then
  echo "fuzz: installing ${missing[*]}"
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "fuzz: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The parser compiled straight from its source (not the library: no PCH, no gcc flags), against
# LibTorch's headers for the dtype enum. Rebuilt only when a source is newer than the binary.
# C++17, not the project's C++20: clang 14 with libstdc++ 12 in C++20 mode rejects LibTorch
# 1.13's ATen headers (constexpr std::vector of the incomplete c10::IValue).
TORCH_PREFIX="${TORCH_PREFIX:-/usr}"
mkdir -p "$FUZZ_DIR"
bin="$FUZZ_DIR/fuzz_safetensors"
srcs=(src/checkpoint/safetensors.cpp tests/checkpoint/fuzz/fuzz_safetensors.cpp)
ignorelist=tests/checkpoint/fuzz/coverage_ignorelist.txt
if [ ! -x "$bin" ] || [ -n "$(find "${srcs[@]}" "$ignorelist" include/fsdp/checkpoint/safetensors.h src/checkpoint/safetensors_format.h -newer "$bin")" ]; then
  echo "fuzz: building $bin"
  clang++ -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -fsanitize-coverage-ignorelist="$ignorelist" \
    -Iinclude -Isrc -I"$TORCH_PREFIX/include" -I"$TORCH_PREFIX/include/torch/csrc/api/include" \
    "${srcs[@]}" -o "$bin" -L"$TORCH_PREFIX/lib" -Wl,-rpath,"$TORCH_PREFIX/lib" -ltorch_cpu -lc10 -lz
fi

# Fuzz on a scratch copy so the kept corpus only grows through the minimising merge below.
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/corpus" "$CORPUS"
cp "$CORPUS"/. "$work/corpus/" -r
log="$FUZZ_DIR/fuzz.log"
rc=0
"$bin" "$work/corpus" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=4096 \
  -artifact_prefix="$FUZZ_DIR/" -print_final_stats=1 >"$log" 2>&1 || rc=$?
if ((rc != 0)); then
  artifact="$(grep -o 'Test unit written to [^ ]*' "$log" | tail -1 | sed 's/Test unit written to //')"
  echo "fuzz: FINDING after fuzzing (exit $rc): input ${artifact:-<see log>}, log $log" >&2
  grep -m3 -E 'ERROR|runtime error|terminate|Assertion' "$log" >&2 || true
  exit 1
fi
# Minimising merge of the kept corpus and this run's finds: the smallest set of inputs that
# covers every edge either covered (edge coverage only, without hit counts, keeps it small).
before=$(find "$CORPUS" -type f | wc -l)
mkdir "$work/min"
"$bin" -merge=1 -use_counters=0 "$work/min" "$CORPUS" "$work/corpus" >>"$log" 2>&1
if [ -n "$(ls -A "$work/min")" ]; then
  find "$CORPUS" -type f -delete
  cp "$work/min"/* "$CORPUS"/
fi
after=$(find "$CORPUS" -type f | wc -l)
execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
echo "fuzz: ok, ${seconds}s, ${execs:-?} executions, no findings; corpus $before -> $after files ($CORPUS)"
