#!/usr/bin/env python3
"""PyTorch's own FSDP2 (and DDP) on the models of our benchmarks: the other side of each comparison.

    python3 benchmarks/fsdp2_bench.py cpu --role single|fsdp2|ddp --result FILE [--nproc 2] [--layers 4]
        [--dim 256] [--heads 4] [--seq 128] [--batch 8] [--steps 10] [--warmup 2] [--threads T] [--bind]
    python3 benchmarks/fsdp2_bench.py gpu [--layers 12] [--dim 1024] [--heads 16] [--seq 1024] [--batch 8]
        [--steps 20] [--warmup 5]
    python3 benchmarks/fsdp2_bench.py llama --role single|fsdp2 --result FILE [--nproc 2] [--layers 12]
        [--hidden 768] [--heads 12] [--kv-heads 4] [--ffn 2048] [--vocab 32000] [--seq 256]
        [--batch 2 (per rank)] [--steps 4] [--warmup 1] [--threads T] [--wrap layers|split]
    python3 benchmarks/fsdp2_bench.py moe --role single|fsdp2 --result FILE [--nproc 2] [--layers 8]
        [--hidden 1024] [--heads 16] [--kv-heads 8] [--vocab 32000] [--experts 16] [--top-k 2]
        [--moe-ffn 2048] [--seq 256] [--batch 1] [--steps 3] [--warmup 1] [--threads T] [--experts-impl I]

cpu (for scripts/fsdp2-cpu-compare.sh): bench's GPT (benchmarks/bench.cpp) on CPU, Gloo. --role
single: one process, the per-rank share of the batch (batch / nproc), no process group (the limit,
as bench's "single" row). --role fsdp2: nproc processes (this script starts them; a FileStore
rendezvous in a temporary folder: no launcher, no network port), fully_shard on every block then the
root, global batch --batch. --role ddp: the same ranks with DistributedDataParallel (PyTorch's
defaults: 25 MiB buckets, gradients copied into the buckets) instead, the row to set beside our
replicate (bench's replicate row). Appends one line to --result in bench's format:
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

gpu (for scripts/gpu-check.sh): the GPT of benchmarks/gpu_bench.cpp (same model, batch, dtypes:
bf16 parameters, fp32 reduce) on one GPU. Prints one line like gpu_bench's rows: "row fsdp2
tokens_per_s=... step_ms=... peak_gib=...". A world of one on NCCL (a FileStore rendezvous in a
temporary folder: no launcher, no network). Needs only the machine's torch (PyTorch >= 2.6).

llama (for scripts/llama-fsdp2-compare.sh): transformers' LlamaForCausalLM on CPU, Gloo: the other
side of benchmarks/llama_scale_bench.cpp --role train. --role single: one process, one rank's
batch, no process group (the limit). --role fsdp2: nproc processes started by this script,
fully_shard on every decoder layer then the root (--wrap split: the embedding and [norm, lm_head]
as units of their own, the latter kept unsharded from forward to backward, as torchtitan does;
llama_scale_bench's --wrap). The model: LlamaConfig of the given shape (rms_norm_eps 1e-5,
rope_theta 10000, untied embeddings, no biases), attn_implementation "sdpa" (LibTorch's fused
attention, as ours), float32. The loop is llama_scale_bench's: --batch sequences of --seq + 1
random tokens per rank and step (generator 1234 + rank), then (timed) zero_grad, forward (logits),
cross-entropy, backward, AdamW(lr 1e-3) step, loss.item(). Appends one line to --result:
"median_step_s S first_loss L params P world N forward_s F backward_s B optimizer_s O" (the last
three: medians of the step's parts, zero_grad in forward_s).

moe (for scripts/moe-fsdp2-compare.sh): transformers' MixtralForCausalLM on CPU, Gloo: the other
side of llama_scale_bench --role train --model moe. The same shape (--moe-ffn: each expert's
width; rope_theta 10000 and rms_norm_eps 1e-5 as ours, untied, no sliding window, sdpa), fully_shard
on every decoder layer then the root (--role fsdp2), the loss transformers' with
output_router_logits=True: the shifted cross-entropy plus router_aux_loss_coef (0.001) x aux_loss.
The experts are transformers' packed ones (gate_up_proj [E, 2F, H], down_proj [E, H, F]) run by
its default experts implementation unless --experts-impl names one (printed). llama's loop; rank 0
prints each step, every rank prints "rank R: median_step_s S peak_rss_bytes B" and the result
line gains "peak_rss_bytes B" (rank 0's VmHWM).

cpu, llama and moe start this script again with `--role rank` once per rank (RANK set per process).
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


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


# ---- cpu: bench's GPT on CPU (FSDP2, DDP) ----------------------------------------------------------


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


class BenchBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = Attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-5)
        self.mlp = MLP(dim)

    def forward(self, x):
        y = x + self.attn(self.ln_1(x))
        return y + self.mlp(self.ln_2(y))


class BenchGPT(nn.Module):
    def __init__(self, vocab, seq, layers, dim, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.h = nn.ModuleList(BenchBlock(dim, heads) for _ in range(layers))
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


def train_cpu(a, rank, world, sharded, ddp=False):
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = BenchGPT(256, a.seq, a.layers, a.dim, a.heads)
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


def add_cpu_args(ap):
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


def main_cpu(a):
    if a.batch % a.nproc:
        sys.exit("fsdp2_bench cpu: --batch must be a multiple of --nproc")
    if a.threads <= 0:
        a.threads = max(1, (os.cpu_count() or 1) // a.nproc)
    if a.role == "single":
        train_cpu(a, 0, 1, sharded=False)
        return 0
    if a.role == "rank":
        rank = int(os.environ["RANK"])
        if a.bind:
            cpus = sorted(os.sched_getaffinity(0))
            k = max(1, len(cpus) // a.nproc)
            mine = cpus[rank * k:rank * k + k] if len(cpus) >= a.nproc else [cpus[rank % len(cpus)]]
            os.sched_setaffinity(0, mine)
        dist.init_process_group("gloo", store=dist.FileStore(a.store, a.nproc), rank=rank, world_size=a.nproc)
        train_cpu(a, rank, a.nproc, sharded=a.mode == "fsdp2", ddp=a.mode == "ddp")
        dist.destroy_process_group()
        return 0
    # fsdp2 / ddp: start nproc ranks of this script and wait for them all (a failed rank fails the run).
    with tempfile.TemporaryDirectory(prefix="fsdp2-cpu-bench-") as tmp:
        args = [sys.executable, os.path.abspath(__file__), "cpu", "--role", "rank", "--mode", a.role, "--store",
                os.path.join(tmp, "store")]
        for name in ("nproc", "layers", "dim", "heads", "seq", "batch", "steps", "warmup", "threads", "bucket-mb"):
            args += ["--" + name, str(getattr(a, name.replace("-", "_")))]
        args += ["--result", a.result] + (["--bind"] if a.bind else [])
        run_ranks(args, a.nproc, a.threads, "fsdp2_bench cpu")
    return 0


# ---- gpu: gpu_bench's GPT on one GPU -------------------------------------------------------------


class GpuBlock(nn.Module):
    # models/gpt.cpp's Block: pre-norm fused causal attention + MLP.
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.attn_proj = nn.Linear(dim, dim)
        self.ln_2 = nn.LayerNorm(dim)
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.mlp_proj = nn.Linear(4 * dim, dim)

    def attn(self, x):
        # The same attention as models/gpt.cpp's Block on a 2.x LibTorch (GPTConfig::fused_attention,
        # on by default): F.scaled_dot_product_attention with is_causal=True, the fused op (on an
        # H200 in bf16, FlashAttention's kernel), which is what fsdp::compat::fused_causal_attention
        # calls (at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true)).
        B, T, C = x.shape
        hd = C // self.heads
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, hd).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        return self.attn_proj(y.transpose(1, 2).contiguous().view(B, T, C))

    def forward(self, x):
        y = x + self.attn(self.ln_1(x))
        return y + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(y)), approximate="tanh"))


class GpuGPT(nn.Module):
    def __init__(self, vocab, seq, layers, dim, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GpuBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def add_gpu_args(ap):
    for name, default in [("layers", 12), ("dim", 1024), ("heads", 16), ("seq", 1024), ("batch", 8), ("steps", 20),
                          ("warmup", 5)]:
        ap.add_argument("--" + name, type=int, default=default)


def main_gpu(a):
    if not torch.cuda.is_available():
        print("fsdp2_bench gpu: no GPU visible; nothing to measure", file=sys.stderr)
        return 2
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.cuda.set_device(0)
    store_dir = tempfile.mkdtemp(prefix="fsdp2-bench-")
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(store_dir, "store"), 1), rank=0, world_size=1)
    torch.manual_seed(1)
    model = GpuGPT(256, a.seq, a.layers, a.dim, a.heads).cuda()
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in model.blocks:
        fully_shard(b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for s in range(a.warmup + a.steps):
        g = torch.Generator().manual_seed(100 + s)
        data = torch.randint(256, (a.batch, a.seq + 1), generator=g).cuda()
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, 256), data[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        value = loss.item()
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
    step = statistics.median(times)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"row fsdp2  tokens_per_s={a.batch * a.seq / step:.0f} step_ms={step * 1e3:.1f} peak_gib={peak:.2f} "
          f"last_loss={value:.4f} torch={torch.__version__}", flush=True)
    dist.destroy_process_group()
    return 0


# ---- llama: transformers' LlamaForCausalLM on CPU ------------------------------------------------


def train_llama(a, rank, world, sharded):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                         num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                         max_position_embeddings=max(a.seq, 2048), rms_norm_eps=1e-5, tie_word_embeddings=False,
                         use_cache=False)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).float()
    params = sum(p.numel() for p in model.parameters())
    if sharded:
        from torch.distributed.fsdp import fully_shard
        if a.wrap == "split":
            fully_shard(model.model.embed_tokens)
        for layer in model.model.layers:
            fully_shard(layer)
        if a.wrap == "split":
            # Last in forward, first in backward: kept unsharded in between (torchtitan's choice).
            fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
        fully_shard(model)

    def loss_of(data):
        logits = model(input_ids=data[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, a.vocab), data[:, 1:].reshape(-1))

    train_loop(a, rank, world, model, loss_of, params)


def train_loop(a, rank, world, model, loss_of, params, peak_rss=False):
    """llama_scale_bench's loop: --batch sequences of --seq + 1 random tokens per rank and step
    (generator 1234 + rank), then (timed) zero_grad, forward and loss (loss_of), backward, AdamW step,
    loss.item(); rank 0 appends the result line (with peak_rss: also peak_rss_bytes, and every rank
    prints its own)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)
    times, first_loss = [], None
    parts = {"forward_s": [], "backward_s": [], "optimizer_s": []}  # as llama_scale_bench's breakdown
    for s in range(a.warmup + a.steps):
        data = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = loss_of(data)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        value = loss.item()
        if first_loss is None:
            first_loss = value
        if s >= a.warmup:
            times.append(time.perf_counter() - t0)
            for key, t in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[key].append(t)
        if rank == 0 and peak_rss:
            print(f"step {s}{' (warm-up)' if s < a.warmup else ''}: loss {value:.4f}, {t3 - t0:.2f} s", flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # VmHWM, as ours
    line = (f"median_step_s {statistics.median(times)} first_loss {first_loss} params {params} world {world} "
            + " ".join(f"{k} {statistics.median(v)}" for k, v in parts.items()))
    if peak_rss:
        line += f" peak_rss_bytes {peak}"
        print(f"rank {rank}: median_step_s {statistics.median(times):.3f} peak_rss_bytes {peak} "
              f"peak_rss_gib {peak / 2**30:.3f}", flush=True)
    if rank == 0:
        with open(a.result, "a") as out:
            out.write(line + "\n")


LLAMA_NAMES = [("nproc", 2), ("layers", 12), ("hidden", 768), ("heads", 12), ("kv_heads", 4), ("ffn", 2048),
         ("vocab", 32000), ("seq", 256), ("batch", 2), ("steps", 4), ("warmup", 1), ("threads", 0)]


def add_llama_args(ap):
    for name, default in LLAMA_NAMES:
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    ap.add_argument("--role", choices=["single", "fsdp2", "rank"], required=True)
    ap.add_argument("--wrap", choices=["layers", "split"], default="layers")
    ap.add_argument("--result", required=True)
    ap.add_argument("--store", default="")


def run_roles(a, bench, names, train, extra_args):
    """The roles of the shape benchmarks (llama, moe): `single` trains in this process, `rank` is one
    rank of a gloo group (launched by `fsdp2`), `fsdp2` launches a.nproc ranks of this script with
    the shape options `names` and `extra_args`."""
    if a.threads <= 0:
        a.threads = max(1, (os.cpu_count() or 1) // a.nproc)
    if a.role == "single":
        train(a, 0, 1, sharded=False)
        return 0
    if a.role == "rank":
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", store=dist.FileStore(a.store, a.nproc), rank=rank, world_size=a.nproc)
        train(a, rank, a.nproc, sharded=True)
        dist.destroy_process_group()
        return 0
    with tempfile.TemporaryDirectory(prefix=bench + "-fsdp2-bench-") as tmp:
        args = [sys.executable, os.path.abspath(__file__), bench, "--role", "rank", "--store", os.path.join(tmp, "store"),
                "--result", a.result] + extra_args
        for name, _ in names:
            args += ["--" + name.replace("_", "-"), str(getattr(a, name))]
        run_ranks(args, a.nproc, a.threads, "fsdp2_bench " + bench)
    return 0


def main_llama(a):
    return run_roles(a, "llama", LLAMA_NAMES, train_llama, ["--wrap", a.wrap])


# ---- moe: transformers' MixtralForCausalLM on CPU ------------------------------------------------


def train_moe(a, rank, world, sharded):
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.moe_ffn,
                           num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                           max_position_embeddings=max(a.seq, 2048), rms_norm_eps=1e-5, tie_word_embeddings=False,
                           num_local_experts=a.experts, num_experts_per_tok=a.top_k, output_router_logits=True,
                           router_aux_loss_coef=0.001, sliding_window=None, use_cache=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    config._attn_implementation = "sdpa"
    kwargs = {"experts_implementation": a.experts_impl} if a.experts_impl else {}
    model = MixtralForCausalLM._from_config(config, **kwargs).float()
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"fsdp2_bench moe: Mixtral {a.layers} layers, hidden {a.hidden}, {a.experts} experts top {a.top_k} of "
              f"width {a.moe_ffn}: {params / 1e6:.1f}M params; experts implementation "
              f"{model.config._experts_implementation}; torch {torch.__version__}; "
              f"{'FSDP2 %d ranks' % world if sharded else 'one process'}", flush=True)
    if sharded:
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)

    def loss_of(data):
        # The shifted cross-entropy plus router_aux_loss_coef x the load-balancing loss, as ours and as
        # transformers adds it with labels and output_router_logits=True.
        out = model(input_ids=data[:, :-1], use_cache=False, output_router_logits=True)
        lm = F.cross_entropy(out.logits.reshape(-1, a.vocab), data[:, 1:].reshape(-1))
        return lm + config.router_aux_loss_coef * out.aux_loss

    train_loop(a, rank, world, model, loss_of, params, peak_rss=True)


MOE_NAMES = [("nproc", 2), ("layers", 8), ("hidden", 1024), ("heads", 16), ("kv_heads", 8), ("vocab", 32000),
             ("experts", 16), ("top_k", 2), ("moe_ffn", 2048), ("seq", 256), ("batch", 1), ("steps", 3),
             ("warmup", 1), ("threads", 0)]


def add_moe_args(ap):
    for name, default in MOE_NAMES:
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    ap.add_argument("--role", choices=["single", "fsdp2", "rank"], required=True)
    ap.add_argument("--experts-impl", dest="experts_impl", default="",
                    help="transformers' experts_implementation (eager, grouped_mm, ...; default: its own choice)")
    ap.add_argument("--result", required=True)
    ap.add_argument("--store", default="")


def main_moe(a):
    return run_roles(a, "moe", MOE_NAMES, train_moe, ["--experts-impl", a.experts_impl] if a.experts_impl else [])


def main():
    ap = argparse.ArgumentParser(prog="fsdp2_bench.py", description="PyTorch's FSDP2 on our benchmarks' models.")
    sub = ap.add_subparsers(dest="bench", required=True, metavar="cpu|gpu|llama|moe")
    for name, add, run, what in [("cpu", add_cpu_args, main_cpu, "bench's GPT on CPU (FSDP2, DDP)"),
                                 ("gpu", add_gpu_args, main_gpu, "gpu_bench's GPT on one GPU"),
                                 ("llama", add_llama_args, main_llama, "transformers' Llama on CPU"),
                                 ("moe", add_moe_args, main_moe, "transformers' Mixtral on CPU")]:
        p = sub.add_parser(name, help=what)
        add(p)
        p.set_defaults(run=run)
    a = ap.parse_args()
    return a.run(a)


if __name__ == "__main__":
    sys.exit(main())
