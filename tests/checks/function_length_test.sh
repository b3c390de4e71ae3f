#!/usr/bin/env bash
# scripts/check-function-length.sh on a repository made here: it passes on a function of 80 lines,
# fails naming one of 81 outside tests/ (and the file and line where it starts), and lets one of 81
# under tests/ pass; a file git does not track is not read.
#
#   tests/checks/function_length_test.sh     # CTest: function_length_check_fails_on_long_function
set -euo pipefail
CHECK="$(cd "$(dirname "$0")/../.." && pwd)/scripts/check-function-length.sh"
command -v git >/dev/null || {
  echo "function_length_test: skipped: git is not installed" >&2
  exit 77
}
if ! ctags --version 2>/dev/null | grep -q 'Universal Ctags'; then
  echo "function_length_test: skipped: Universal Ctags not found" >&2
  exit 77
fi
TMP="$(mktemp -d "${TMPDIR:-/tmp}/function-length-test-XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
export HOME="$TMP" GIT_CONFIG_NOSYSTEM=1
repo="$TMP/repo"
git init -q "$repo"
mkdir -p "$repo/src" "$repo/tests"
fail() {
  echo "function_length_test: FAILED: $*" >&2
  exit 1
}
run() { # leaves the check's exit status in rc and its output in $TMP/out
  rc=0
  "$CHECK" "$repo" >"$TMP/out" 2>&1 || rc=$?
}
# function NAME LINES: a C++ function of LINES lines in all (signature and closing brace included).
function_of() {
  echo "int $1() {"
  echo "  int x = 0;"
  for ((i = 0; i < $2 - 4; ++i)); do echo "  x += $i;"; done
  echo "  return x;"
  echo "}"
}

{ echo "// a file"; function_of fits 80; } >"$repo/src/fits.cpp"
function_of long_test 81 >"$repo/tests/long_test.cpp"
function_of untracked 120 >"$repo/src/untracked.cpp"
git -C "$repo" add src/fits.cpp tests/long_test.cpp
run
((rc == 0)) || fail "80 lines, and 81 under tests/, should pass (exit $rc): $(cat "$TMP/out")"

{ echo "// another"; echo; function_of too_long 81; } >"$repo/src/long.cpp"
git -C "$repo" add src/long.cpp
run
((rc == 1)) || fail "a function of 81 lines should fail (exit $rc): $(cat "$TMP/out")"
grep -q "^81 src/long.cpp:3 too_long$" "$TMP/out" || fail "too_long is not named with its place: $(cat "$TMP/out")"
if grep -q "untracked\|fits\|long_test" "$TMP/out"; then fail "named a function it should not: $(cat "$TMP/out")"; fi
echo "function_length_test: ok"
