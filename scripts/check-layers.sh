#!/usr/bin/env bash
# Keeps ARCHITECTURE.md true. Three checks, each failing with the file or folder to fix:
#
# 1. Layering: every #include of a library header from include/fsdp/ or src/ goes down the stack
#    or sideways, never up. One folder per layer (the same name under include/fsdp/ and src/):
#
#   level 0  compat memory hooks profiler  LibTorch differences, FSDP's buffers, module hooks,
#                                          profiler traces
#            optim                         fused CPU optimizers (fsdp::optim)
#   level 1  comm                          process groups and collectives
#   level 2  dist                          the runtime: launchers, world group, CPU tuning
#   level 3  mesh                          DeviceMesh
#   level 4  tensor_parallel
#   level 5  expert_parallel               MoE token dispatch and combine (fsdp::ep)
#   level 6  sharding                      fully_shard, replicate
#   level 7  activation                    activation checkpointing
#   level 8  checkpoint                    sharded checkpoints, state dicts
#   level 9  fsdp1                         FSDP1's API: a facade over sharding and checkpoint's
#                                          state dicts, so above both
#   top      fsdp/fsdp.h, fsdp/debug.h     the umbrellas (may include anything)
#
#    A header of the diagnostics tier (include/fsdp/debug/) belongs to the layer that implements
#    it, which it declares in a line `// layer: <name>` at its top (before `#pragma once`);
#    template plumbing (include/fsdp/detail/<layer>[_*].h) to the layer its name starts with.
#    A new folder must be added to LEVEL below: the check fails on a file in a folder it does not
#    know, and on a LEVEL entry without a folder, so the table cannot fall behind.
# 2. Folders: every folder directly under src/, include/fsdp/, tools/, models/, data/ and
#    benchmarks/ (e.g. src/sharding, tools/fsdprun, models/llama) is named by its path in
#    ARCHITECTURE.md's text.
# 3. Benchmarks: every file directly in benchmarks/ is named in benchmarks/README.md.
#
#   scripts/check-layers.sh          # the repository (CI runs it as the CTest test `layers`)
#   scripts/check-layers.sh DIR      # a copy of the tree at DIR (tests/checks/ runs it on one)
set -euo pipefail
root="${1:-$(dirname "$0")/..}"
cd "$root" || exit 1
if [[ ! -f ARCHITECTURE.md || ! -d include/fsdp || ! -d src ]]; then
  echo "check-layers: $root is not the repository's root (no ARCHITECTURE.md, include/fsdp/ or src/)" >&2
  exit 1
fi

declare -A LEVEL=([compat]=0 [memory]=0 [hooks]=0 [profiler]=0 [comm]=1 [dist]=2 [mesh]=3 [tensor_parallel]=4
  [expert_parallel]=5 [sharding]=6 [activation]=7 [checkpoint]=8 [fsdp1]=9 [detail]=0 [optim]=0)
# Folders of include/fsdp/ that are tiers, not layers: their headers take a layer each (above).
TIERS=(debug detail)
bad=0
fail() {
  echo "check-layers: $*" >&2
  bad=1
}

# include/fsdp/debug/<name>.h -> the layer it declares in its `// layer: <name>` line.
declare -A DEBUG_LAYER=()
read_debug_layers() {
  local f name l
  for f in include/fsdp/debug/*.h; do
    [[ -f "$f" ]] || continue
    name="${f#include/fsdp/debug/}"
    name="${name%.h}"
    l="$(head -n 5 "$f" | sed -n 's|^// layer: *\([A-Za-z0-9_]*\).*|\1|p' | head -n 1)"
    if [[ -z "$l" ]]; then
      fail "$f: no '// layer: <name>' line at its top; add one naming the layer that implements it"
    elif [[ -z "${LEVEL[$l]+x}" ]]; then
      fail "$f: '// layer: $l' is not a layer of scripts/check-layers.sh (${!LEVEL[*]})"
    fi
    DEBUG_LAYER[$name]="${l:-none}"
  done
}

# The layer of a library file (a path under include/fsdp/ or src/, or an include path "fsdp/..."
# or a private "layer/..." path), printed as a name; "top" for the umbrellas.
layer_of() {
  local p="${1#include/}"
  p="${p#src/}"
  p="${p#fsdp/}"
  case "$p" in
    fsdp.h | debug.h) echo top ;;
    debug/*)
      local name="${p#debug/}"
      name="${name%.h}"
      echo "${DEBUG_LAYER[$name]:-unknown-debug:$name}"
      ;;
    detail/*)
      # template plumbing of a layer: detail/<layer>_*.h or detail/<layer>.h
      local name="${p#detail/}" l
      name="${name%.h}"
      for l in "${!LEVEL[@]}"; do
        [[ "$name" == "$l" || "$name" == "$l"_* ]] && {
          echo "$l"
          return
        }
      done
      echo "unknown-detail:$name"
      ;;
    */*) echo "${p%%/*}" ;;
    *) echo "unknown:$p" ;;
  esac
}

level() {
  local l="$1"
  [[ "$l" == top ]] && {
    echo 99
    return
  }
  [[ -n "${LEVEL[$l]+x}" ]] && echo "${LEVEL[$l]}" || echo "-1"
}

# Check 1 for one file: its includes go down the stack.
check_file_includes() {
  local file="$1" from from_level inc to to_level
  from="$(layer_of "$file")"
  [[ "$from" == none ]] && return # a debug header without its layer line: reported once above
  from_level="$(level "$from")"
  if [[ "$from_level" == -1 ]]; then
    fail "$file: its folder is not a known layer ($from); add it to scripts/check-layers.sh"
    return
  fi
  while IFS= read -r inc; do
    # Library headers only: "fsdp/..." (public) or "<layer>/..." (a private header by its layer's path).
    case "$inc" in
      fsdp/*) ;;
      */*) [[ -n "${LEVEL[${inc%%/*}]+x}" ]] || continue ;;
      *) continue ;; # same folder
    esac
    to="$(layer_of "$inc")"
    [[ "$to" == none ]] && continue
    to_level="$(level "$to")"
    if [[ "$to_level" == -1 ]]; then
      fail "$file includes \"$inc\": not a known layer ($to); add it to scripts/check-layers.sh"
    elif ((to_level > from_level)); then
      fail "$file ($from, level $from_level) includes \"$inc\" ($to, level $to_level): an include going up the stack"
    fi
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$file")
  if grep -q '^[[:space:]]*#[[:space:]]*include[[:space:]]*"\.\./' "$file"; then
    fail "$file reaches a header with \"../\"; include it by its layer's path (src/ is an include directory of the library)"
  fi
}

# Check 1, the table itself: each layer is a folder, and each folder is a layer or a tier.
check_level_table() {
  local l d tier
  for l in "${!LEVEL[@]}"; do
    [[ -d "src/$l" || -d "include/fsdp/$l" ]] ||
      fail "layer '$l' has no folder src/$l or include/fsdp/$l; remove it from LEVEL in scripts/check-layers.sh"
  done
  for d in src/*/ include/fsdp/*/; do
    d="${d%/}"
    l="${d##*/}"
    for tier in "${TIERS[@]}"; do [[ "$d" == "include/fsdp/$tier" ]] && continue 2; done
    [[ -n "${LEVEL[$l]+x}" ]] || fail "$d/: not a layer; add '$l' to LEVEL in scripts/check-layers.sh and to ARCHITECTURE.md"
  done
}

# Check 2: every folder directly under the roots is named by its path in ARCHITECTURE.md.
check_folders_named() {
  local top d name re
  for top in src include/fsdp tools models data benchmarks; do
    [[ -d "$top" ]] || continue
    while IFS= read -r d; do
      name="${d##*/}"
      [[ "$name" == .* || "$name" == __pycache__ ]] && continue
      # The path, not a longer one that starts with it: "tools/fsdp" is not "tools/fsdp_ckpt".
      re="(^|[^A-Za-z0-9_./-])${d}([^A-Za-z0-9_.-]|\\.[^A-Za-z0-9_-]|\\.?\$)"
      grep -Eq "$re" ARCHITECTURE.md ||
        fail "$d/ is not named in ARCHITECTURE.md; add a line saying what it holds (its path, '$d/')"
    done < <(find "$top" -mindepth 1 -maxdepth 1 -type d | sort)
  done
}

# Check 3: every file in benchmarks/ is in benchmarks/README.md's table.
check_benchmarks_readme() {
  local f name
  [[ -d benchmarks ]] || return 0
  if [[ ! -f benchmarks/README.md ]]; then
    fail "benchmarks/README.md is missing; it lists every program in benchmarks/"
    return
  fi
  while IFS= read -r f; do
    name="${f##*/}"
    [[ "$name" == README.md || "$name" == .* ]] && continue
    grep -qF "$name" benchmarks/README.md ||
      fail "$f is not named in benchmarks/README.md; add its row (program, the question it answers, how to run it)"
  done < <(find benchmarks -mindepth 1 -maxdepth 1 -type f | sort)
}

read_debug_layers
check_level_table
while IFS= read -r file; do
  check_file_includes "$file"
done < <(find include/fsdp src -type f \( -name '*.h' -o -name '*.cpp' \) | sort)
check_folders_named
check_benchmarks_readme
if ((bad)); then
  echo "check-layers: FAILED (ARCHITECTURE.md and scripts/check-layers.sh say what the layers and folders are)" >&2
  exit 1
fi
echo "check-layers: every include of include/fsdp/ and src/ goes down the stack; every folder is in ARCHITECTURE.md"
