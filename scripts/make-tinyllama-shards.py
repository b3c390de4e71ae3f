#!/usr/bin/env python3
"""Writes a random Llama in TinyLlama-1.1B's shape as a Hugging Face folder of bf16 safetensors
shards, for benchmarks/llama_scale_bench.cpp (loading and training a 1.1B model at FSDP 2 ranks).

    python3 scripts/make-tinyllama-shards.py OUT [--max-shard-size 2000000000] [--seed 0]
        [--layers 22 --hidden 2048 --intermediate 5632 --heads 32 --kv-heads 4 --vocab 32000]

OUT gets config.json (transformers 4.x spelling, torch_dtype bfloat16: TinyLlama's own values for
rope_theta 10000, rms_norm_eps 1e-5, max_position_embeddings 2048, untied embeddings),
model-0000k-of-0000n.safetensors of at most --max-shard-size bytes each, in transformers' order
(embeddings, layers, norm, head) and model.safetensors.index.json. Weights are N(0, 0.02) (norms 1),
drawn one tensor at a time from torch.Generator(seed), so at most one fp32 tensor (the 262 MB
embedding) is in memory. The files are written directly (safetensors' layout: 8-byte header length,
the JSON header padded with spaces to 8 bytes, the data), so neither transformers nor the
safetensors package is needed, only torch. It takes ~1 minute and 2.2 GB of disk for the default
shape; keep OUT outside the repository.
"""
import argparse
import json
import os
import struct
import sys

import torch


def tensors(a):
    """(name, shape) in transformers' order; a norm is 1-D."""
    head = a.hidden // a.heads
    yield "model.embed_tokens.weight", (a.vocab, a.hidden)
    for i in range(a.layers):
        p = f"model.layers.{i}."
        yield p + "self_attn.q_proj.weight", (a.heads * head, a.hidden)
        yield p + "self_attn.k_proj.weight", (a.kv_heads * head, a.hidden)
        yield p + "self_attn.v_proj.weight", (a.kv_heads * head, a.hidden)
        yield p + "self_attn.o_proj.weight", (a.hidden, a.heads * head)
        yield p + "mlp.gate_proj.weight", (a.intermediate, a.hidden)
        yield p + "mlp.up_proj.weight", (a.intermediate, a.hidden)
        yield p + "mlp.down_proj.weight", (a.hidden, a.intermediate)
        yield p + "input_layernorm.weight", (a.hidden,)
        yield p + "post_attention_layernorm.weight", (a.hidden,)
    yield "model.norm.weight", (a.hidden,)
    yield "lm_head.weight", (a.vocab, a.hidden)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    for name, default in [("layers", 22), ("hidden", 2048), ("intermediate", 5632), ("heads", 32), ("kv_heads", 4),
                          ("vocab", 32000), ("max_shard_size", 2_000_000_000), ("seed", 0)]:
        ap.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=default)
    a = ap.parse_args()
    if a.hidden % a.heads or a.heads % a.kv_heads:
        sys.exit("make-tinyllama-shards: --hidden must be a multiple of --heads, and --heads of --kv-heads")
    os.makedirs(a.out, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab,
        "hidden_size": a.hidden, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "hidden_act": "silu",
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "initializer_range": 0.02, "pretraining_tp": 1, "use_cache": True, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    # Files: consecutive tensors until the next would pass max_shard_size.
    files, size = [[]], 0
    for name, shape in tensors(a):
        nbytes = 2 * (shape[0] * (shape[1] if len(shape) > 1 else 1))
        if files[-1] and size + nbytes > a.max_shard_size:
            files.append([])
            size = 0
        files[-1].append((name, shape, nbytes))
        size += nbytes
    gen = torch.Generator().manual_seed(a.seed)
    weight_map, total = {}, 0
    for k, entries in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, nbytes in entries:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = fname
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path = os.path.join(a.out, fname)
        with open(path + ".tmp", "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for name, shape, _ in entries:
                if len(shape) == 1:
                    t = torch.ones(shape, dtype=torch.bfloat16)
                else:
                    t = torch.empty(shape).normal_(0.0, 0.02, generator=gen).to(torch.bfloat16)
                f.write(t.view(torch.int16).numpy().tobytes())
        os.replace(path + ".tmp", path)
        total += offset
        print(f"make-tinyllama-shards: {path} ({offset / 1e9:.2f} GB, {len(entries)} tensors)", flush=True)
    with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    params = total // 2
    print(f"make-tinyllama-shards: {a.out}: {params / 1e9:.3f}B parameters in {len(files)} files")


if __name__ == "__main__":
    main()
