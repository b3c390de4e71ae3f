#!/usr/bin/env bash
# scripts/check-commits.sh on a repository made here: it passes on short subjects after the base
# (a long one before it is allowed), fails naming a long one, and skips (77) where there is no
# history to check.
#
#   tests/checks/check_commits_test.sh     # CTest: commit_subjects_check_fails_on_long_subject
set -euo pipefail
CHECK="$(cd "$(dirname "$0")/../.." && pwd)/scripts/check-commits.sh"
command -v git >/dev/null || {
  echo "check_commits_test: skipped: git is not installed" >&2
  exit 77
}
TMP="$(mktemp -d "${TMPDIR:-/tmp}/check-commits-test-XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
# A git of its own: no user configuration (signing, hooks) reaches the commits made here.
export HOME="$TMP" GIT_CONFIG_NOSYSTEM=1 GIT_AUTHOR_NAME=t GIT_AUTHOR_EMAIL=t@example.com \
  GIT_COMMITTER_NAME=t GIT_COMMITTER_EMAIL=t@example.com
repo="$TMP/repo"
git init -q "$repo"
commit() { git -C "$repo" commit -q --allow-empty -m "$1"; }
fail() {
  echo "check_commits_test: FAILED: $*" >&2
  exit 1
}
run() { # run CHECK ARGS..., leaving its exit status in rc and its output in $TMP/out
  rc=0
  "$CHECK" "$@" >"$TMP/out" 2>&1 || rc=$?
}

long="$(printf 'x%.0s' {1..73})" # 73 characters
commit "before the rule: $long"
base="$(git -C "$repo" rev-parse HEAD)"
commit "short subject"
commit "$(printf 'y%.0s' {1..72})" # exactly the limit
commit "é$(printf 'z%.0s' {1..71})" # 72 characters, 73 bytes
run "$repo" "$base"
((rc == 0)) || fail "short subjects after the base should pass (exit $rc): $(cat "$TMP/out")"
grep -q "3 commits after" "$TMP/out" || fail "expected 3 commits counted: $(cat "$TMP/out")"

commit "a subject that goes on: $long"
bad="$(git -C "$repo" rev-parse --short HEAD)"
commit "short again"
run "$repo" "$base"
((rc == 1)) || fail "a subject of 97 characters should fail (exit $rc): $(cat "$TMP/out")"
grep -q "$bad: subject of 97 characters" "$TMP/out" || fail "the long commit $bad is not named: $(cat "$TMP/out")"
grep -q "1 of 5 commits" "$TMP/out" || fail "expected '1 of 5 commits': $(cat "$TMP/out")"

GIT_CEILING_DIRECTORIES="$(dirname "$TMP")" run "$TMP" "$base" # not a git checkout
((rc == 77)) || fail "a folder without git history should skip with 77 (exit $rc)"
run "$repo" 0123456789abcdef0123456789abcdef01234567 # the base absent (a shallow clone)
((rc == 77)) || fail "an absent base should skip with 77 (exit $rc)"
grep -q "not in this history" "$TMP/out" || fail "the skip should say why: $(cat "$TMP/out")"
echo "check_commits_test: passes on short subjects, fails naming a long one, skips without history"
