#!/usr/bin/env bash
# bench under alternating settings of one environment variable: PAIRS rounds, each running bench
# once per setting in turn, then the median and min-max of every figure per setting. Issue 31's
# figures are each "the median of at least 7 alternating pairs, with its min-max"; this makes them
# from one command that docs/benchmarks.md can quote.
#
#   scripts/bench_pairs.sh [--pairs 7] [--build build] VAR=A,B[,...] -- BENCH_ARGS...
#
#   # FSDP against its transport floor, ranks bound to cores or not (the 3.3M GPT):
#   scripts/bench_pairs.sh --pairs 7 FSDP_CPU_BIND=cores,none -- \
#       --rows single,fsdp --rounds 3 --steps 10 --warmup 2 --malloc default --cpu-split on
#
# Figures taken from each run's output, per distributed row NAME (FSDP, replicate, ...):
#   NAME/limit          "ratio NAME / limit = R"
#   NAME/(limit*floor)  "NAME / (limit x floor) = R", and NAME:floor, the floor it was taken against
#   and with --cpu-split on, per row KEY and rank R of the CPU split: KEY.rR:ours, KEY.rR:copies
#   (ms per step) and KEY.rR:faults (minor faults per step).
# Each run prints one line (the setting, then key=value); the summary prints each figure's median
# and min-max per setting, settings side by side. A run that fails stops the script with its
# output's last lines. Timings: use a quiet machine (the load average is printed per run).
set -euo pipefail
PAIRS=7 BUILD=build SETTING=
usage() {
  echo "usage: scripts/bench_pairs.sh [--pairs N] [--build DIR] VAR=A,B[,...] -- BENCH_ARGS..." >&2
  exit 2
}
while (($#)); do
  case "$1" in
    --pairs) PAIRS="$2"; shift 2 ;;
    --build) BUILD="$2"; shift 2 ;;
    --) shift; break ;;
    *=*) SETTING="$1"; shift ;;
    *) usage ;;
  esac
done
[ -n "$SETTING" ] || usage
[[ "$PAIRS" =~ ^[1-9][0-9]*$ ]] || { echo "bench_pairs: --pairs takes a whole number of pairs, got '$PAIRS'" >&2; exit 2; }
BENCH="$BUILD/bin/bench"
[ -x "$BENCH" ] || { echo "bench_pairs: $BENCH is not built (cmake --build $BUILD --target bench)" >&2; exit 2; }
VAR="${SETTING%%=*}"
IFS=, read -r -a VALUES <<<"${SETTING#*=}"
((${#VALUES[@]} >= 1)) || usage
RUNS="$(mktemp)"
trap 'rm -f "$RUNS"' EXIT

# The figures of one run's output, as "key=value" words.
figures() {
  awk '
    /^ratio .* \/ limit = / {
      line = $0; sub(/^ratio /, "", line); name = line; sub(/ \/ limit = .*/, "", name)
      value = line; sub(/.* \/ limit = /, "", value); sub(/[;, ].*/, "", value)
      printf " %s/limit=%s", name, value
    }
    /can go below \(limit \+ it\) \/ limit = / {
      floor = $0; sub(/.*can go below \(limit \+ it\) \/ limit = /, "", floor); sub(/ .*/, "", floor)
    }
    / \/ \(limit x floor\) = / {
      name = $0; sub(/ \/ \(limit x floor\) = .*/, "", name)
      value = $0; sub(/.* \/ \(limit x floor\) = /, "", value); sub(/ .*/, "", value)
      printf " %s/(limit*floor)=%s %s:floor=%s", name, value, name, floor
    }
    /^\| [a-z0-9_-]+ \| [0-9]+ \| [0-9.]+ ms \|/ {  # a row of the CPU split
      n = split($0, f, "|")
      for (i = 1; i <= n; ++i) { gsub(/^ +| +$/, "", f[i]); sub(/ ms$/, "", f[i]) }
      if (f[8] + 0 == 0) next  # a row without FSDP work (the one-process limit)
      key = f[2] ".r" f[3]
      printf " %s:ours=%s %s:copies=%s %s:faults=%s", key, f[8], key, f[9], key, f[13]
    }
  '
}

for ((i = 1; i <= PAIRS; ++i)); do
  for v in "${VALUES[@]}"; do
    load="$(cut -d' ' -f1 /proc/loadavg)"
    if ! out="$(env "$VAR=$v" "$BENCH" "$@" 2>&1)"; then
      echo "bench_pairs: bench failed with $VAR=$v:" >&2
      echo "$out" | tail -20 >&2
      exit 1
    fi
    line="$(date +%H:%M:%S) pair $i $VAR=$v load=$load$(echo "$out" | figures)"
    echo "$line"
    echo "$line" >>"$RUNS"
  done
done

echo
echo "$PAIRS pairs; median (min-max) of each figure per setting:"
awk -v var="$VAR" -v values="${VALUES[*]}" '
  function median(list,    a, n, i, j, t) {
    n = split(list, a, " ")
    for (i = 1; i <= n; ++i) for (j = i + 1; j <= n; ++j) if (a[j] + 0 < a[i] + 0) { t = a[i]; a[i] = a[j]; a[j] = t }
    lo = a[1]; hi = a[n]
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  {
    setting = $4; sub(/^[^=]*=/, "", setting)
    for (i = 6; i <= NF; ++i) {
      k = $i; sub(/=.*/, "", k); v = $i; sub(/^[^=]*=/, "", v)
      if (!(k in seen)) { seen[k] = 1; keys[++nkeys] = k }
      data[k, setting] = data[k, setting] " " v
    }
  }
  END {
    nv = split(values, vs, " ")
    printf "| figure |"; for (j = 1; j <= nv; ++j) printf " %s=%s |", var, vs[j]; printf "\n"
    printf "|---|"; for (j = 1; j <= nv; ++j) printf "---|"; printf "\n"
    for (i = 1; i <= nkeys; ++i) {
      printf "| %s |", keys[i]
      for (j = 1; j <= nv; ++j) {
        if ((keys[i], vs[j]) in data) { m = median(data[keys[i], vs[j]]); printf " %.4g (%.4g-%.4g) |", m, lo, hi }
        else printf " - |"
      }
      printf "\n"
    }
  }
' "$RUNS"
