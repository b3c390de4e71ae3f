#!/usr/bin/env python3
"""PyTorch's own FSDP2 on transformers' LlamaForCausalLM (CPU, Gloo): the other side of
benchmarks/llama_scale_bench.cpp --role train, for benchmarks/llama-fsdp2-compare.sh.

    python3 benchmarks/llama_fsdp2_bench.py --role single|fsdp2 [--nproc 2] [--layers 12] [--hidden 768]
        [--heads 12] [--kv-heads 4] [--ffn 2048] [--vocab 32000] [--seq 256] [--batch 2 (per rank)]
        [--steps 4] [--warmup 1] [--threads T] [--wrap layers|split] --result FILE

--role single: one process, one rank's batch, no process group (the limit). --role fsdp2: nproc
processes started by this script (FileStore rendezvous in a temporary folder), fully_shard on every
decoder layer then the root (--wrap split: the embedding and [norm, lm_head] as units of their own,
the latter kept unsharded from forward to backward, as torchtitan does; llama_scale_bench's --wrap). The model: LlamaConfig of the given shape
(rms_norm_eps 1e-5, rope_theta 10000, untied embeddings, no biases), attn_implementation "sdpa"
(LibTorch's fused attention, as ours), float32. The loop is llama_scale_bench's: --batch sequences
of --seq + 1 random tokens per rank and step (generator 1234 + rank), then (timed) zero_grad,
forward (logits), cross-entropy, backward, AdamW(lr 1e-3) step, loss.item(). Appends one line to
--result: "median_step_s S first_loss L params P world N forward_s F backward_s B optimizer_s O" (the
last three: medians of the step's parts, zero_grad in forward_s).
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

from bench_ranks import run_ranks
import torch
import torch.nn.functional as F


def train(a, rank, world, sharded):
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1234 + rank)
    times, first_loss = [], None
    parts = {"forward_s": [], "backward_s": [], "optimizer_s": []}  # as llama_scale_bench's breakdown
    for s in range(a.warmup + a.steps):
        data = torch.randint(a.vocab, (a.batch, a.seq + 1), generator=gen)
        t0 = time.perf_counter()
        opt.zero_grad()
        logits = model(input_ids=data[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, a.vocab), data[:, 1:].reshape(-1))
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
    if rank == 0:
        with open(a.result, "a") as out:
            out.write(f"median_step_s {statistics.median(times)} first_loss {first_loss} params {params} world {world} "
                      + " ".join(f"{k} {statistics.median(v)}" for k, v in parts.items()) + "\n")


NAMES = [("nproc", 2), ("layers", 12), ("hidden", 768), ("heads", 12), ("kv_heads", 4), ("ffn", 2048),
         ("vocab", 32000), ("seq", 256), ("batch", 2), ("steps", 4), ("warmup", 1), ("threads", 0)]


def main():
    ap = argparse.ArgumentParser()
    for name, default in NAMES:
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    ap.add_argument("--role", choices=["single", "fsdp2", "rank"], required=True)
    ap.add_argument("--wrap", choices=["layers", "split"], default="layers")
    ap.add_argument("--result", required=True)
    ap.add_argument("--store", default="")
    a = ap.parse_args()
    if a.threads <= 0:
        a.threads = max(1, (os.cpu_count() or 1) // a.nproc)
    if a.role == "single":
        train(a, 0, 1, sharded=False)
        return 0
    if a.role == "rank":
        import torch.distributed as dist
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", store=dist.FileStore(a.store, a.nproc), rank=rank, world_size=a.nproc)
        train(a, rank, a.nproc, sharded=True)
        dist.destroy_process_group()
        return 0
    with tempfile.TemporaryDirectory(prefix="llama-fsdp2-bench-") as tmp:
        args = [sys.executable, os.path.abspath(__file__), "--role", "rank", "--store", os.path.join(tmp, "store"),
                "--result", a.result, "--wrap", a.wrap]
        for name, _ in NAMES:
            args += ["--" + name.replace("_", "-"), str(getattr(a, name))]
        run_ranks(args, a.nproc, a.threads, "llama_fsdp2_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
