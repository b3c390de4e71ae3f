#!/usr/bin/env bash
# scripts/check-layers.sh on copies of this tree: the copy as it is passes, and each drift fails
# with its own message: a folder that ARCHITECTURE.md does not name, a debug header without its
# `// layer:` line, an include going up the stack, a benchmark file benchmarks/README.md lacks.
#
#   tests/checks/check_layers_test.sh     # CTest: layers_check_fails_on_unnamed_folder
set -euo pipefail
SRC="$(cd "$(dirname "$0")/../.." && pwd)"
CHECK="$SRC/scripts/check-layers.sh"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/check-layers-test-XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
fail() {
  echo "check_layers_test: FAILED: $*" >&2
  exit 1
}
# A fresh copy of what the check reads, at $TMP/tree.
copy_tree() {
  rm -rf "$TMP/tree"
  mkdir -p "$TMP/tree"
  cp "$SRC/ARCHITECTURE.md" "$TMP/tree/"
  cp -r "$SRC/include" "$SRC/src" "$SRC/tools" "$SRC/models" "$SRC/data" "$SRC/benchmarks" "$TMP/tree/"
}
# Runs the check on the copy; expects exit status $1 and, when failing, a line matching $2.
expect() {
  local want="$1" pattern="${2:-}" rc=0
  "$CHECK" "$TMP/tree" >"$TMP/out" 2>&1 || rc=$?
  ((rc == want)) || fail "expected exit $want, got $rc: $(cat "$TMP/out")"
  [[ -z "$pattern" ]] || grep -q -- "$pattern" "$TMP/out" || fail "no line matching '$pattern': $(cat "$TMP/out")"
}

copy_tree
expect 0 # the tree as it is: the other cases fail because of what they change alone

for folder in src/zz_unnamed tools/zz_unnamed models/zz_unnamed data/zz_unnamed benchmarks/zz_unnamed; do
  copy_tree
  mkdir -p "$TMP/tree/$folder"
  expect 1 "$folder/ is not named in ARCHITECTURE.md"
done

copy_tree # a layer folder named in ARCHITECTURE.md but not in the script's table
mkdir -p "$TMP/tree/include/fsdp/zz_layer"
# shellcheck disable=SC2016 # the backquotes are Markdown's
echo '| `include/fsdp/zz_layer/` | a test |' >>"$TMP/tree/ARCHITECTURE.md"
expect 1 "include/fsdp/zz_layer/: not a layer"

copy_tree # a debug header that does not declare its layer
printf '#pragma once\n// a counter\n' >"$TMP/tree/include/fsdp/debug/zz_counter.h"
expect 1 "zz_counter.h: no '// layer: <name>' line"

copy_tree # a debug header of the comm layer included from the lower memory layer
printf '// layer: comm\n#pragma once\n' >"$TMP/tree/include/fsdp/debug/zz_counter.h"
printf '#include "fsdp/debug/zz_counter.h"\n' >>"$TMP/tree/src/memory/malloc_tuning.cpp"
expect 1 'src/memory/malloc_tuning.cpp (memory, level 0) includes "fsdp/debug/zz_counter.h" (comm, level 1)'

copy_tree # a sharding file reaching FSDP1's API above it
printf '#include "fsdp/fsdp1/fsdp1.h"\n' >>"$TMP/tree/src/sharding/fully_shard.cpp"
expect 1 "an include going up the stack"

copy_tree # a benchmark program without its README row
echo 'int main() {}' >"$TMP/tree/benchmarks/zz_bench.cpp"
expect 1 "benchmarks/zz_bench.cpp is not named in benchmarks/README.md"
echo "check_layers_test: the tree passes; unnamed folders, undeclared debug layers, upward includes and unlisted benchmarks fail"
