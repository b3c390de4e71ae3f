#!/usr/bin/env python3
"""Where a step's time goes, read from Chrome traces (train_gpt --profile-steps, fsdp/debug/profiler.h).

For one step ("ProfilerStep#N") of each trace given, sums the durations of FSDP's ranges by phase
(the unit's name dropped: "fsdp::copy_out (blocks.0)" counts as fsdp::copy_out) and prints a
Markdown table, ms per rank (the mean over the traces, with min-max). Ranges nest (an all-gather
wait inside a pre-forward all-gather): each row is inclusive of what runs inside it.

  scripts/trace_summary.py --step 3 runs/prof/trace_rank0.json runs/prof/trace_rank1.json

--ops adds, for the first trace, what runs inside each phase on its thread: the CUDA kernel
launches (cudaLaunchKernel* runtime calls, nested ones included; Kineto traces of a GPU run), the
copies issued (aten::copy_, aten::cat, aten::split_with_sizes_copy, aten::_foreach_copy_,
aten::_chunk_cat) and the most frequent operators, both counting only operators at the top level
(not those called inside another, as tests/support/op_counts.h counts): how many copy ops a
unit's copy-in and copy-out make
([Note: one copy kernel per unit], src/sharding/collectives.cpp).
"""
import argparse
import json
import re
import sys


def load_step(path, step):
    """The trace's complete events inside step `step`, and the step's own range."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    name = f"ProfilerStep#{step}"
    steps = [e for e in events if e["name"] == name]
    if not steps:
        sys.exit(f"trace_summary: {path} has no {name} range; pick a step inside --profile-steps")
    s = steps[0]
    begin, end = float(s["ts"]), float(s["ts"]) + float(s["dur"])
    return s, [e for e in events if begin <= float(e["ts"]) <= end]


def step_sums(s, inside):
    sums, calls = {}, {}
    for e in inside:
        if not e["name"].startswith("fsdp::"):
            continue
        phase = re.sub(r" \(.*\)$", "", e["name"])
        if phase == "fsdp::tp_collective":
            phase = e["name"]
        sums[phase] = sums.get(phase, 0.0) + float(e["dur"]) / 1000.0
        calls[phase] = calls.get(phase, 0) + 1
    return float(s["dur"]) / 1000.0, sums, calls


COPY_OPS = ("aten::copy_", "aten::cat", "aten::split_with_sizes_copy", "aten::_foreach_copy_", "aten::_chunk_cat")


def mark_top_level(events):
    """Sets e["top"] on one thread's events: True where no other of them encloses it (an operator
    FSDP issued itself, not one called inside another: CUDA's split_with_sizes_copy and _chunk_cat
    copy their metadata to the device with a nested aten::copy_, which is not a copy of FSDP's)."""
    open_ends = []
    for e in sorted(events, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0)))):
        begin, end = float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))
        while open_ends and open_ends[-1] <= begin:
            open_ends.pop()
        e["top"] = not open_ends
        open_ends.append(end)


def step_ops(inside):
    """Per phase: calls, kernel launches (nested ones included), and the operators issued at the top
    level inside it, by name (copies among them)."""
    ranges = [e for e in inside if e["name"].startswith("fsdp::")]
    by_thread = {}
    for e in inside:
        if not e["name"].startswith(("fsdp::", "ProfilerStep#")):
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for events in by_thread.values():
        mark_top_level(events)
    out = {}
    for r in ranges:
        phase = re.sub(r" \(.*\)$", "", r["name"])
        row = out.setdefault(phase, {"calls": 0, "launches": 0, "ops": {}})
        row["calls"] += 1
        r0, r1 = float(r["ts"]), float(r["ts"]) + float(r["dur"])
        for e in by_thread.get((r.get("pid"), r.get("tid")), []):
            if r0 <= float(e["ts"]) and float(e["ts"]) + float(e.get("dur", 0)) <= r1:
                if e["name"].startswith("cudaLaunchKernel"):
                    row["launches"] += 1
                if e["top"]:
                    row["ops"][e["name"]] = row["ops"].get(e["name"], 0) + 1
    return out


def print_ops(path, step, inside):
    rows = step_ops(inside)
    print()
    print(f"| range (step {step}, {path}) | calls | kernel launches | copies issued | most frequent operators |")
    print("|---|---|---|---|---|")
    for phase, row in sorted(rows.items(), key=lambda kv: -kv[1]["launches"] - sum(kv[1]["ops"].values())):
        copies = ", ".join(f"{n} {row['ops'][n]}" for n in COPY_OPS if n in row["ops"]) or "-"
        top = sorted(row["ops"].items(), key=lambda kv: -kv[1])[:4]
        print(f"| {phase} | {row['calls']} | {row['launches']} | {copies} | {', '.join(f'{n} {c}' for n, c in top) or '-'} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step", type=int, required=True, help="the step (ProfilerStep#N) to read")
    ap.add_argument("--ops", action="store_true", help="also the operators and kernel launches inside each phase")
    ap.add_argument("traces", nargs="+", help="trace_rank<r>.json files")
    a = ap.parse_args()
    loaded = [load_step(p, a.step) for p in a.traces]
    per_rank = [step_sums(s, inside) for s, inside in loaded]
    phases = sorted({k for _, s, _ in per_rank for k in s}, key=lambda k: -sum(s.get(k, 0) for _, s, _ in per_rank))
    steps = [d for d, _, _ in per_rank]
    print(f"| range (step {a.step}, {len(per_rank)} ranks) | calls / rank | ms / rank (mean) | min-max | % of step |")
    print("|---|---|---|---|---|")
    mean_step = sum(steps) / len(steps)
    print(f"| whole step (ProfilerStep#{a.step}) | 1 | {mean_step:.2f} | {min(steps):.2f}-{max(steps):.2f} | 100 |")
    for k in phases:
        ms = [s.get(k, 0.0) for _, s, _ in per_rank]
        n = max(c.get(k, 0) for _, _, c in per_rank)
        mean = sum(ms) / len(ms)
        print(f"| {k} | {n} | {mean:.2f} | {min(ms):.2f}-{max(ms):.2f} | {100 * mean / mean_step:.1f} |")
    if a.ops:
        print_ops(a.traces[0], a.step, loaded[0][1])


if __name__ == "__main__":
    main()
