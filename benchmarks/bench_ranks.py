"""Starts a Python benchmark's ranks and waits for them: shared by fsdp2_cpu_bench.py and
llama_fsdp2_bench.py, which start themselves again with `--role rank` (RANK set per process)."""
import os
import subprocess
import sys
import time


def run_ranks(args, nproc, threads, name, timeout_s=3600):
    """Runs `args` as ranks 0..nproc-1 with OMP_NUM_THREADS=threads; exits naming `name` when a rank
    fails or the ranks are not done within timeout_s (then all are killed)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), USE_LIBUV="0")
    procs = [subprocess.Popen(args, env=dict(env, RANK=str(r))) for r in range(nproc)]
    deadline = time.monotonic() + timeout_s
    rcs = []
    for p in procs:
        try:
            rcs.append(p.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            sys.exit(f"{name}: a rank did not finish within {timeout_s} s; all killed")
    if any(rcs):
        sys.exit(f"{name}: ranks exited with {rcs}")
