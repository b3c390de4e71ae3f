#!/usr/bin/env bash
# Lists the names the user's include, fsdp/fsdp.h, declares: every header it reaches through
# `#include "fsdp/..."` (fsdp/detail/ and fsdp/compat/ excepted: template plumbing and LibTorch
# differences, not the API), each name namespace-qualified with its signature, public members of
# classes included. PyTorch's public-bindings test does this for __all__: a change of the API shows
# as a diff of tests/api/public_names.txt in review.
#
#   scripts/public-names.sh                       # print the list
#   scripts/public-names.sh --check               # the CTest test `public_names`: compare with the list
#   scripts/public-names.sh > tests/api/public_names.txt   # accept a change of the API
#
# Also fails (with --check) when a public signature takes or returns a detail:: type: a user's
# handle must not be built from internal state. Needs universal-ctags (scripts/setup.sh installs it).
set -euo pipefail
ROOT="${FSDP_PUBLIC_NAMES_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}"
cd "$ROOT"
LIST=tests/api/public_names.txt
command -v ctags >/dev/null || { echo "public-names: ctags (universal-ctags) is not installed: apt-get install universal-ctags" >&2; exit 2; }

# The headers fsdp.h reaches, breadth first over the quoted fsdp/ includes.
headers() {
  local -A seen=()
  local queue=(fsdp/fsdp.h) h inc
  while ((${#queue[@]})); do
    h="${queue[0]}"
    queue=("${queue[@]:1}")
    [[ -n "${seen[$h]:-}" ]] && continue
    seen[$h]=1
    [[ -f "include/$h" ]] || { echo "public-names: include/$h (included by the API) is missing" >&2; exit 2; }
    case "$h" in fsdp/detail/* | fsdp/compat/*) continue ;; esac
    echo "include/$h"
    while read -r inc; do queue+=("$inc"); done < <(sed -n 's/^#include "\(fsdp\/[^"]*\)".*/\1/p' "include/$h")
  done
}

names() {
  # kind|scope kind|scope|name|access|signature; namespace-scope declarations and public members.
  headers | xargs ctags -x --language-force=C++ --c++-kinds=+p --fields=+aS \
    --_xformat='%K|%{scopeKind}|%{scope}|%N|%{access}|%{signature}' |
    awk -F'|' '
      $1 == "namespace" || $1 == "parameter" || $1 == "local" { next }
      $3 ~ /(^|::)(detail|compat)(::|$)/ || $3 ~ /__anon/ || $4 ~ /^__anon/ { next }
      $5 == "private" || $5 == "protected" { hidden[$3 "::" $4] = 1; next }
      $2 == "" && $1 != "macro" { next }
      { sig = ($6 == "-" ? "" : $6); scope = ($3 == "-" || $3 == "" ? "" : $3 "::"); line[++n] = $1 " " scope $4 sig; in_scope[n] = $3 }
      END {  # members of a private or protected nested class are not the API either
        for (i = 1; i <= n; ++i) {
          keep = 1
          for (h in hidden) if (in_scope[i] == h || index(in_scope[i], h "::") == 1) keep = 0
          if (keep) print line[i]
        }
      }
    ' | sed 's/  */ /g' | LC_ALL=C sort -u
}

if [[ "${1:-}" != "--check" ]]; then
  names
  exit 0
fi
current="$(names)"
status=0
if leaks="$(grep -E '\(.*detail::' <<<"$current")"; then
  echo "public-names: public signatures that take internal (detail::) types; make them private:" >&2
  echo "$leaks" >&2
  status=1
fi
if ! diff -u "$LIST" - <<<"$current" >&2; then
  echo "public-names: the names fsdp/fsdp.h declares differ from $LIST (diff above: - listed, + declared)." >&2
  echo "If the change of the public API is meant, accept it: scripts/public-names.sh > $LIST" >&2
  status=1
fi
((status == 0)) && echo "public-names: $(wc -l <<<"$current") names, as $LIST lists"
exit $status
