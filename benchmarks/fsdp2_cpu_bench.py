#!/usr/bin/env python3
"""PyTorch's own FSDP2 on CPU (Gloo), on the GPT of benchmarks/bench.cpp, for scripts/fsdp2-cpu-compare.sh.

    python3 benchmarks/fsdp2_cpu_bench.py --role single|fsdp2|ddp [--nproc 2] [--layers 4] [--dim 256]
        [--heads 4] [--seq 128] [--batch 8] [--steps 10] [--warmup 2] [--threads T] --result FILE

--role single: one process, the per-rank share of the batch (batch / nproc), no process group (the
limit, as bench's "single" row). --role fsdp2: nproc processes (this script starts them; a FileStore
rendezvous in a temporary folder: no launcher, no network port), fully_shard on every block then
the root, global batch --batch. --role ddp: the same ranks with DistributedDataParallel (PyTorch's
defaults: 25 MiB buckets, gradients copied into the buckets) instead, the row to set beside our
replicate (bench --mode replicate). Appends one line to --result in bench's format:
"median_step_s S first_loss L params P world N faults_per_step F" (F: rank 0's minor page faults per
measured step, as bench's faults_per_step).

The model is bench's GPT (models/gpt.cpp) layer for layer: token + position embeddings, pre-LN
blocks (LayerNorm eps 1e-5, attention as one c_attn Linear(d, 3d) then c_proj Linear(d, d),
causal scaled_dot_product_attention, MLP Linear(d, 4d) / GELU(tanh) / Linear(4d, d)), final
LayerNorm, lm_head Linear(d, 256) without bias, untied; the same parameter count (printed and
checked by the compare script). Initialised by the same scheme as GPTImpl::reset_parameters
(weights and embeddings N(0, 0.02), biases 0, LayerNorm 1/0), though not the same values (ours
draws from per-parameter streams). The loop is bench's: a fresh randint batch, then (timed)
zero_grad, forward, cross-entropy, backward, AdamW(lr 1e-3, LibTorch's defaults) step, loss.item().
"""
import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

from bench_ranks import run_ranks
import torch
import torch.nn as nn
import torch.nn.functional as F


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = MLP(dim)

    def forward(self, x):
        y = x + self.attn(self.ln_1(x))
        return y + self.mlp(self.ln_2(y))


class GPT(nn.Module):
    def __init__(self, vocab, seq, layers, dim, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.h = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        for m in self.modules():  # GPTImpl::reset_parameters' scheme
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx):
        pos = torch.arange(idx.size(1))
        x = self.wte(idx) + self.wpe(pos)
        for b in self.h:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def train(a, rank, world, sharded, ddp=False):
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(256, a.seq, a.layers, a.dim, a.heads)
    params = sum(p.numel() for p in model.parameters())
    if sharded:
        from torch.distributed.fsdp import fully_shard
        for b in model.h:
            fully_shard(b)
        fully_shard(model)
    if ddp:
        model = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)
    local_batch = a.batch // a.nproc
    times, first_loss, faults0 = [], None, 0
    for s in range(a.warmup + a.steps):
        if s == a.warmup:  # as bench: from the first measured step on
            faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        data = torch.randint(256, (local_batch, a.seq + 1), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.view(-1, 256), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        value = loss.item()
        if first_loss is None:
            first_loss = value
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(a.result, "a") as out:
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0) / a.steps
            out.write(f"median_step_s {statistics.median(times)} first_loss {first_loss} params {params} world {world} "
                      f"faults_per_step {faults}\n")


def main():
    ap = argparse.ArgumentParser()
    for name, default in [("nproc", 2), ("layers", 4), ("dim", 256), ("heads", 4), ("seq", 128), ("batch", 8),
                          ("steps", 10), ("warmup", 2), ("threads", 0), ("bucket-mb", 25)]:
        ap.add_argument("--" + name, type=int, default=default)
    ap.add_argument("--role", choices=["single", "fsdp2", "ddp", "rank"], required=True)
    ap.add_argument("--mode", choices=["fsdp2", "ddp"], default="fsdp2")  # what a "rank" runs
    ap.add_argument("--result", required=True)
    ap.add_argument("--store", default="")
    # Each rank on its own block of the CPUs (as FSDP_CPU_BIND=cores binds ours; Python cannot ask
    # for the short slice our Gloo threads get), set before the group starts its threads.
    ap.add_argument("--bind", action="store_true")
    a = ap.parse_args()
    if a.batch % a.nproc:
        sys.exit("fsdp2_cpu_bench: --batch must be a multiple of --nproc")
    if a.threads <= 0:
        a.threads = max(1, (os.cpu_count() or 1) // a.nproc)
    if a.role == "single":
        train(a, 0, 1, sharded=False)
        return 0
    if a.role == "rank":
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        if a.bind:
            cpus = sorted(os.sched_getaffinity(0))
            k = max(1, len(cpus) // a.nproc)
            mine = cpus[rank * k:rank * k + k] if len(cpus) >= a.nproc else [cpus[rank % len(cpus)]]
            os.sched_setaffinity(0, mine)
        dist.init_process_group("gloo", store=dist.FileStore(a.store, a.nproc), rank=rank, world_size=a.nproc)
        train(a, rank, a.nproc, sharded=a.mode == "fsdp2", ddp=a.mode == "ddp")
        dist.destroy_process_group()
        return 0
    # fsdp2 / ddp: start nproc ranks of this script and wait for them all (a failed rank fails the run).
    with tempfile.TemporaryDirectory(prefix="fsdp2-cpu-bench-") as tmp:
        args = [sys.executable, os.path.abspath(__file__), "--role", "rank", "--mode", a.role, "--store",
                os.path.join(tmp, "store")]
        for name in ("nproc", "layers", "dim", "heads", "seq", "batch", "steps", "warmup", "threads", "bucket-mb"):
            args += ["--" + name, str(getattr(a, name.replace("-", "_")))]
        args += ["--result", a.result] + (["--bind"] if a.bind else [])
        run_ranks(args, a.nproc, a.threads, "fsdp2_cpu_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
