#!/usr/bin/env python3
"""PyTorch's own FSDP2 on the GPT of benchmarks/gpu_bench.cpp (same model, batch, dtypes), one GPU.

    python3 benchmarks/fsdp2_gpu_bench.py [--layers 12] [--dim 1024] [--heads 16] [--seq 1024]
                                          [--batch 8] [--steps 20] [--warmup 5]

Prints one line like gpu_bench's rows: "row fsdp2 tokens_per_s=... step_ms=... peak_gib=...".
A world of one on NCCL (a FileStore rendezvous in a temporary folder: no launcher, no network).
Needs only the machine's torch (fully_shard from torch.distributed.fsdp, PyTorch >= 2.6).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
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


class GPT(nn.Module):
    def __init__(self, vocab, seq, layers, dim, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser()
    for name, default in [("layers", 12), ("dim", 1024), ("heads", 16), ("seq", 1024), ("batch", 8), ("steps", 20),
                          ("warmup", 5)]:
        ap.add_argument("--" + name, type=int, default=default)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("fsdp2_gpu_bench: no GPU visible; nothing to measure", file=sys.stderr)
        return 2
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.cuda.set_device(0)
    store_dir = tempfile.mkdtemp(prefix="fsdp2-bench-")
    dist.init_process_group("nccl", store=dist.FileStore(os.path.join(store_dir, "store"), 1), rank=0, world_size=1)
    torch.manual_seed(1)
    model = GPT(256, a.seq, a.layers, a.dim, a.heads).cuda()
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


if __name__ == "__main__":
    sys.exit(main())
