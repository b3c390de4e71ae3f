#!/usr/bin/env bash
# Checks that every commit after BASE has a subject of at most 72 characters (details go in the
# body), so that `git log --oneline` stays readable. BASE is the commit where the rule started:
# older subjects are left as they are.
#
#   scripts/check-commits.sh                 # this checkout (CI runs it as the CTest test `commit_subjects`)
#   scripts/check-commits.sh REPO [BASE]     # another repository (tests/checks/ runs it on one)
#
# Skips (exit 77, CTest's SKIP_RETURN_CODE) where there is no history to check: not a git
# checkout (a tarball), git not installed, or BASE not in the history (a shallow clone).
set -euo pipefail
REPO="${1:-$(dirname "$0")/..}"
BASE="${2:-4483e637d0da43d2279226640d0dc98db7fe2b08}"
MAX=72
export LC_ALL=C.UTF-8 # ${#subject} counts characters, not bytes
skip() {
  echo "check-commits: skipped: $*" >&2
  exit 77
}
command -v git >/dev/null || skip "git is not installed"
git -C "$REPO" rev-parse --verify -q HEAD >/dev/null 2>&1 || skip "$REPO is not a git checkout with commits"
git -C "$REPO" cat-file -e "$BASE^{commit}" 2>/dev/null ||
  skip "the base commit $BASE is not in this history (a shallow clone? git fetch --unshallow)"
git -C "$REPO" merge-base --is-ancestor "$BASE" HEAD ||
  skip "HEAD does not descend from the base commit $BASE (a branch older than the rule)"

bad=0 count=0
while IFS= read -r line; do
  hash="${line%% *}"
  subject="${line#* }"
  count=$((count + 1))
  len="${#subject}"
  if ((len > MAX)); then
    echo "check-commits: $hash: subject of $len characters (at most $MAX): ${subject:0:60}..." >&2
    bad=$((bad + 1))
  fi
done < <(git -C "$REPO" log --format='%h %s' "$BASE..HEAD")
if ((bad)); then
  echo "check-commits: FAILED: $bad of $count commits after ${BASE:0:12} have subjects over $MAX characters;" \
    "reword them before they are shared (git rebase -i, 'reword'): a short subject, the details in the body" >&2
  exit 1
fi
echo "check-commits: $count commits after ${BASE:0:12}, every subject at most $MAX characters"
