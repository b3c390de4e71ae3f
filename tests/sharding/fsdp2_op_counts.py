#!/usr/bin/env python3
"""The ATen operators PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard) issues per phase and
unit of a steady training step at world size 2 (Gloo, CPU), on the model test_op_counts trains with
ours: an input Linear, 4 blocks (x + fc2(relu(fc1(x)))) and an output Linear, each block a unit,
the root the rest. Counted with torch.profiler over the measured steps: an operator (aten::, and
FSDP2's own fsdp:: and c10d:: ones; not record_function's profiler:: op) counts
for the phase of the outermost FSDP2 phase scope around it (FSDP::pre_forward, post_forward,
pre_backward, root_pre_forward, root_post_backward_callback -> final_callback, and post_backward:
the FSDP::post_backward_* scopes and the RegisterPostBackwardFunction node) when no other operator
encloses it inside FSDP's scopes, and for the unit of the innermost scope that names one
("FSDP::all_gather (layers.1)" inside layers.0's prefetch counts for layers.1; unnamed: root).

Prints a table and, last, one line "FSDP2_JSON {phase: {unit: {op: per-step count}}}".
Exits 77 when this python has no torch.distributed.fsdp.fully_shard (CTest's skip code).

  python3 tests/sharding/fsdp2_op_counts.py [--steps 3] [--warmup 2] [--timeout 120]
"""
import argparse
import json
import os
import sys
import tempfile

DIM, HIDDEN, LAYERS, BATCH = 16, 64, 4, 4
PHASES = {
    "FSDP::pre_forward": "pre_forward",
    "FSDP::post_forward": "post_forward",
    "FSDP::pre_backward": "pre_backward",
    "FSDP::root_pre_forward": "root_pre_forward",
    "FSDP::root_post_backward_callback": "final_callback",
}
FUNCTION, USER_SCOPE = 0, 7


def scope_phase(name):
    base = name.split(" (")[0]
    if base in PHASES:
        return PHASES[base]
    if base.startswith("FSDP::post_backward") or base == "RegisterPostBackwardFunctionBackward":
        return "post_backward"
    return None


def scope_unit(name):
    if name.endswith(")") and " (" in name:
        return name[name.index(" (") + 2 : -1]
    if name.startswith("FSDP::") and " for " in name:
        return name.split(" for ", 1)[1] or "root"
    return None


def is_operator(evt):
    """A dispatcher operator (aten::, FSDP2's own fsdp:: ops, c10d::), not record_function's own."""
    name = evt.name
    return (evt.scope == FUNCTION and "::" in name and not name.startswith("profiler::")
            and not name.startswith("autograd::") and not name.startswith("FSDP::"))


def attribute(evt):
    """(phase, unit) of an operator FSDP2 issued itself, or None."""
    unit, phase, inside_fsdp = None, None, False
    p = evt.cpu_parent
    while p is not None:
        name = p.name
        is_fsdp = name.startswith("FSDP::") or name == "RegisterPostBackwardFunctionBackward"
        if is_fsdp:
            inside_fsdp = True
            unit = unit or scope_unit(name)
            phase = scope_phase(name) or phase
        elif not inside_fsdp and not name.startswith("autograd::engine::evaluate_function"):
            if p.scope != USER_SCOPE and not name.startswith("profiler::"):
                return None  # nested in another operator or in a module's autograd node
        p = p.cpu_parent
    if phase is None:
        return None
    return phase, unit or "root"


def build_model(torch):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

        def forward(self, x):
            return x + self.fc2(torch.relu(self.fc1(x)))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(DIM, DIM)
            self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
            self.out = nn.Linear(DIM, DIM)

        def forward(self, x):
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            return self.out(h)

    return Net()


def rank_main(rank, world, init_file, steps, warmup, queue):
    import torch
    import torch.distributed as dist
    from datetime import timedelta
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = build_model(torch)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(rank))

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    for _ in range(warmup):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    counts = {}
    for evt in prof.events():
        if not is_operator(evt):
            continue
        where = attribute(evt)
        if where is None:
            continue
        ops = counts.setdefault(where[0], {}).setdefault(where[1], {})
        ops[evt.name] = ops.get(evt.name, 0) + 1
    per_step = {ph: {u: {op: n / steps for op, n in ops.items()} for u, ops in units.items()}
                for ph, units in counts.items()}
    if rank == 0:
        queue.put(per_step)
    dist.barrier()
    dist.destroy_process_group()


def print_table(counts):
    print(f"{'phase':<18}{'unit':<12}{'ops':>6}  operators (per step)")
    for phase in sorted(counts):
        for unit in sorted(counts[phase]):
            ops = counts[phase][unit]
            listed = " ".join(f"{op}x{n:g}" for op, n in sorted(ops.items()))
            print(f"{phase:<18}{unit:<12}{sum(ops.values()):>6g}  {listed}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120)
    args = ap.parse_args()
    try:
        import torch
        import torch.multiprocessing as mp
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        print(f"SKIP: no torch with torch.distributed.fsdp.fully_shard here ({e})")
        return 77
    os.environ.setdefault("USE_LIBUV", "0")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=rank_main, args=(r, 2, init_file, args.steps, args.warmup, queue))
                 for r in range(2)]
        for p in procs:
            p.start()
        try:
            counts = queue.get(timeout=args.timeout)
        except Exception:
            counts = None
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        if counts is None or any(p.exitcode != 0 for p in procs):
            print(f"fsdp2_op_counts: the ranks failed or took over {args.timeout} s "
                  f"(exit codes {[p.exitcode for p in procs]})")
            return 1
    print(f"torch {torch.__version__}, FSDP2 at world size 2 (gloo, CPU), {args.steps} steps after {args.warmup}")
    print_table(counts)
    print("FSDP2_JSON " + json.dumps(counts, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
