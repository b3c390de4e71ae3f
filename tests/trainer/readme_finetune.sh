#!/bin/bash
# README.md's "Fine-tune a Hugging Face model", run as written: the sh block between
# <!-- finetune:begin --> and <!-- finetune:end --> (model folder, spm_train, fsdp-tokenize,
# fsdprun ... train_gpt --init-from ... --export-hf), in a temporary folder that looks like the
# repository root (docs, tests, tools, scripts and build/bin linked in). Checks that it exits 0,
# the loss falls, and the exported folder holds config.json and model.safetensors. Then the Python
# block (<!-- finetune-python:... -->: transformers loads the folder and generates) where PYTHON
# imports torch, transformers and sentencepiece (the LibTorch 2.14 half of CI); elsewhere that step
# is skipped with the reason, unless FSDP_REQUIRE_PYTHON_CHECKS=1, where it is a failure.
#
#   tests/trainer/readme_finetune.sh SRC_DIR BIN_DIR [PYTHON]
set -euo pipefail
src=$1 bin=$2 python=${3:-}
fail() { echo "readme_finetune: FAILED: $*"; exit 1; }
command -v spm_train >/dev/null || fail "spm_train is not installed (apt-get install sentencepiece; scripts/setup.sh does)"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/readme_finetune_XXXXXX")
trap 'rm -rf "$tmp"' EXIT
for d in docs tests tools scripts; do ln -s "$src/$d" "$tmp/$d"; done
mkdir "$tmp/build" && ln -s "$bin" "$tmp/build/bin"

# The fenced block between the markers, without its fence lines.
block() { awk -v b="<!-- $1:begin -->" -v e="<!-- $1:end -->" '$0 == b {f = 1; next} $0 == e {f = 0} f' "$src/README.md" |
  sed -e '/^```/d'; }
block finetune >"$tmp/walkthrough.sh"
[ -s "$tmp/walkthrough.sh" ] || fail "README.md has no <!-- finetune:begin --> ... <!-- finetune:end --> block"
block finetune-python >"$tmp/walkthrough.py"

cd "$tmp"
status=0
timeout 300 bash -euo pipefail walkthrough.sh >walkthrough.log 2>&1 || status=$?
cat walkthrough.log
[ "$status" = 0 ] || fail "the README block exited $status"
for f in ft/out/config.json ft/out/model.safetensors ft/out/tokenizer.model; do
  [ -f "$f" ] || fail "the export lacks $f"
done
summary=$(grep -o 'train_gpt: loss [0-9.]* -> [0-9.]*' walkthrough.log | tail -1)
[ -n "$summary" ] || fail "no 'train_gpt: loss A -> B' line in train_gpt's output"
read -r first last < <(echo "$summary" | awk '{print $3, $5}')
awk -v a="$first" -v b="$last" 'BEGIN {exit !(b < a)}' || fail "the loss did not fall ($summary)"
echo "readme_finetune: the walkthrough ran: $summary; ft/out exported"

why=""
if [ -z "$python" ]; then
  why="no python3 found by CMake"
elif ! why=$("$python" -c 'import torch, transformers, sentencepiece' 2>&1 | tail -1); then
  :
else
  why=""
fi
if [ -n "$why" ]; then
  if [ "${FSDP_REQUIRE_PYTHON_CHECKS:-0}" = 1 ]; then
    fail "the Python step cannot run: $why (FSDP_REQUIRE_PYTHON_CHECKS=1: it must run here)"
  fi
  echo "readme_finetune: the Python step (transformers loads ft/out and generates) skipped: $why"
  echo "readme_finetune: 1 passed, 0 failed"
  exit 0
fi
out=$(timeout 300 "$python" walkthrough.py 2>walkthrough_py.log) || { cat walkthrough_py.log; fail "the Python block failed"; }
echo "$out"
case "$out" in
  "The checkpoint"*) ;;
  *) fail "transformers' generation does not start with the prompt: $out" ;;
esac
echo "readme_finetune: transformers loaded ft/out and generated"
echo "readme_finetune: 2 passed, 0 failed"
