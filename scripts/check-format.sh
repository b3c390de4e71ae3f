#!/usr/bin/env bash
# Checks that every C++ file git tracks is formatted as .clang-format says, with the one pinned
# clang-format: Debian 12's (version 14). Another version formats some constructs differently, so
# it skips (exit 77, CTest's SKIP_RETURN_CODE) rather than fail on a style it does not share.
#
#   scripts/check-format.sh          # check (CI runs it as the CTest test `format`)
#   scripts/check-format.sh --fix    # format the files in place
set -euo pipefail
cd "$(dirname "$0")/.."
FORMAT="${CLANG_FORMAT:-clang-format}"
if ! command -v "$FORMAT" >/dev/null; then
  echo "check-format: $FORMAT not found; install Debian 12's clang-format (scripts/setup.sh does)" >&2
  exit 77
fi
version="$("$FORMAT" --version)"
if [[ "$version" != *" version 14."* ]]; then
  echo "check-format: skipped: $version is not the pinned clang-format 14 (Debian 12)" >&2
  exit 77
fi
if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  echo "check-format: skipped: not a git checkout (the file list is git's)" >&2
  exit 77
fi
mapfile -t files < <(git ls-files -- '*.h' '*.hpp' '*.cpp' '*.cc' '*.cu' '*.cuh')
if [[ "${1:-}" == "--fix" ]]; then
  "$FORMAT" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  [ -f "$f" ] || continue
  if ! "$FORMAT" --dry-run -Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if ((${#bad[@]})); then
  echo "check-format: ${#bad[@]} file(s) differ from .clang-format: ${bad[*]}" >&2
  echo "check-format: fix with scripts/check-format.sh --fix (or git clang-format on your change)" >&2
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
