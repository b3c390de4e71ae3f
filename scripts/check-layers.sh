#!/usr/bin/env bash
# Checks the library's layering (ARCHITECTURE.md): every #include of a library header from
# include/fsdp/ or src/ goes down the stack or sideways, never up.
#
#   level 0  compat  memory  hooks      LibTorch differences, FSDP's buffers, module hooks
#   level 1  comm                       process groups and collectives
#   level 2  dist                       the runtime: launchers, world group, CPU tuning
#   level 3  mesh                       DeviceMesh
#   level 4  tensor_parallel
#   level 5  sharding                   fully_shard, replicate, FSDP1's API
#   level 6  activation                 activation checkpointing
#   level 7  checkpoint                 sharded checkpoints, state dicts
#   level 8  fsdp1                      FSDP1's API (sharding/fsdp1*): a facade over sharding and
#                                       checkpoint's state dicts, so above both
#   top      fsdp/fsdp.h, fsdp/debug.h  the umbrellas (may include anything)
# The diagnostics tier (include/fsdp/debug/) belongs to the layer that implements each header
# (table below). A new folder or debug header must be added here: the check fails on one it does
# not know, so the table cannot fall behind.
#
#   scripts/check-layers.sh      # CI runs it as the CTest test `layers`
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A LEVEL=([compat]=0 [memory]=0 [hooks]=0 [profiler]=0 [comm]=1 [dist]=2 [mesh]=3 [tensor_parallel]=4
  [sharding]=5 [activation]=6 [checkpoint]=7 [fsdp1]=8 [detail]=0)
# include/fsdp/debug/<name>.h -> the layer that implements it.
declare -A DEBUG_LAYER=([buffer_pool]=memory [malloc_tuning]=memory [profiler]=profiler [comm_stats]=comm
  [desync]=comm [flight_recorder]=comm [cpu_tuning]=dist [phase_timers]=sharding [gpu_stats]=sharding
  [cpu_collectives]=sharding [fault_injection]=checkpoint)

# The layer of a library file (a path under include/fsdp/ or src/, or an include path "fsdp/..."
# or a private "layer/..." path), printed as a name; "top" for the umbrellas.
layer_of() {
  local p="${1#include/}"
  p="${p#src/}"
  p="${p#fsdp/}"
  case "$p" in
    fsdp.h | debug.h) echo top ;;
    sharding/fsdp1*) echo fsdp1 ;;
    debug/*)
      local name="${p#debug/}"
      name="${name%.h}"
      echo "${DEBUG_LAYER[$name]:-unknown-debug:$name}"
      ;;
    detail/*)
      # template plumbing of a layer: detail/<layer>_*.h or detail/<layer>.h
      local name="${p#detail/}"
      name="${name%.h}"
      local l
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

bad=0
while IFS= read -r file; do
  from="$(layer_of "$file")"
  from_level="$(level "$from")"
  if [[ "$from_level" == -1 ]]; then
    echo "check-layers: $file: its folder is not a known layer ($from); add it to scripts/check-layers.sh" >&2
    bad=1
    continue
  fi
  while IFS= read -r inc; do
    # Library headers only: "fsdp/..." (public) or "<layer>/..." (a private header by its layer's path).
    case "$inc" in
      fsdp/*) ;;
      */*) [[ -n "${LEVEL[${inc%%/*}]+x}" ]] || continue ;;
      *) continue ;;  # same folder
    esac
    to="$(layer_of "$inc")"
    to_level="$(level "$to")"
    if [[ "$to_level" == -1 ]]; then
      echo "check-layers: $file includes \"$inc\": not a known layer ($to); add it to scripts/check-layers.sh" >&2
      bad=1
    elif ((to_level > from_level)); then
      echo "check-layers: $file ($from, level $from_level) includes \"$inc\" ($to, level $to_level): an include going up the stack" >&2
      bad=1
    fi
  done < <(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$file")
  if grep -q '^[[:space:]]*#[[:space:]]*include[[:space:]]*"\.\./' "$file"; then
    echo "check-layers: $file reaches a header with \"../\"; include it by its layer's path (src/ is an include directory of the library)" >&2
    bad=1
  fi
done < <(find include/fsdp src -type f \( -name '*.h' -o -name '*.cpp' \) | sort)
if ((bad)); then
  echo "check-layers: FAILED (layers: ARCHITECTURE.md)" >&2
  exit 1
fi
echo "check-layers: every include of include/fsdp/ and src/ goes down the stack"
