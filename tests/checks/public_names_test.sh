#!/usr/bin/env bash
# scripts/public-names.sh --check fails where the API changed without its list, and where a public
# signature takes a detail:: type: run on copies of include/ and the list with each drift added.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
command -v ctags >/dev/null || { echo "public_names_test: ctags (universal-ctags) is not installed" >&2; exit 77; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

copy() {  # a fresh copy of what the check reads
  rm -rf "$work/tree"
  mkdir -p "$work/tree/tests/api" "$work/tree/scripts"
  cp -r "$REPO/include" "$work/tree/"
  cp "$REPO/tests/api/public_names.txt" "$work/tree/tests/api/"
  cp "$REPO/scripts/public-names.sh" "$work/tree/scripts/"
}
expect() {  # expect <fails|passes> <what> <pattern the output must hold>
  local out rc=0
  out="$(FSDP_PUBLIC_NAMES_ROOT="$work/tree" "$work/tree/scripts/public-names.sh" --check 2>&1)" || rc=$?
  if [[ "$1" == fails && $rc -eq 0 ]] || [[ "$1" == passes && $rc -ne 0 ]] || ! grep -q -- "$3" <<<"$out"; then
    echo "public_names_test: expected the check to $1 on $2 (exit $rc), with '$3' in:" >&2
    echo "$out" >&2
    exit 1
  fi
  echo "ok: $1 on $2"
}

copy
expect passes "the tree as it is" "names, as tests/api/public_names.txt lists"

copy  # a new function in a user header
sed -i 's|^namespace fsdp {$|namespace fsdp {\nvoid an_unlisted_function(int x);|' "$work/tree/include/fsdp/sharding/clip_grad.h"
expect fails "a name added to a user header" "+prototype fsdp::an_unlisted_function(int x)"

copy  # a name removed from the list's header (clip_grad_norm_ renamed)
sed -i 's/clip_grad_norm_/clip_gradient_norm_/g' "$work/tree/include/fsdp/sharding/clip_grad.h"
expect fails "a renamed function" "-.*fsdp::clip_grad_norm_"

copy  # a public constructor from internal state
sed -i 's|^  void wait();$|  void wait();\n  explicit UnshardHandle(detail::FSDPState* state, int tag);|' "$work/tree/include/fsdp/sharding/fully_shard.h"
expect fails "a public constructor taking a detail:: type" "take internal (detail::) types"

copy  # a header under detail/ is not the API: a name there changes nothing
sed -i 's|^namespace fsdp::hooks::detail {$|namespace fsdp::hooks::detail {\nvoid plumbing_only(int x);|' "$work/tree/include/fsdp/detail/hooks.h"
expect passes "a name added under fsdp/detail/" "names, as tests/api/public_names.txt lists"
