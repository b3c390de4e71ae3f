#!/usr/bin/env bash
# Lists every C++ function over 80 lines outside tests/ (longest first) and exits 1 if there is
# one; exits 0 when there is none, 77 (a skip) when Universal Ctags is missing.
#
#   scripts/check-function-length.sh           # this repository
#   scripts/check-function-length.sh ROOT      # another checkout
set -euo pipefail
root="${1:-$(dirname "$0")/..}"
cd "$root"
max=80

if ! ctags --version 2>/dev/null | grep -q 'Universal Ctags'; then
  echo "check-function-length: skipped: Universal Ctags not found (apt-get install universal-ctags)"
  exit 77
fi

long="$(git ls-files '*.cpp' '*.h' | grep -v '^tests/' |
  xargs ctags -x --language-force=C++ --fields=+ne --_xformat='%K %{end} %n %F %N' 2>/dev/null |
  awk -v max="$max" '$1 == "function" && $2 != "-" { len = $2 - $3 + 1; if (len > max) print len, $4 ":" $3, $5 }' |
  sort -rn)" || true

if [ -n "$long" ]; then
  echo "$long"
  echo "check-function-length: $(echo "$long" | wc -l) function(s) over $max lines outside tests/;" \
    "split each into named steps"
  exit 1
fi
echo "check-function-length: ok, no function over $max lines outside tests/"
