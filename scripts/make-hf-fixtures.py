#!/usr/bin/env python3
"""Makes the small Hugging Face model folders tests/models/test_llama_hf.cpp checks our Llama against.

Each folder is a random model saved by transformers' own save_pretrained, plus reference.safetensors
holding fixed tokens ("tokens", I64 [2, T]) and transformers' logits for them ("logits", F32
[2, T, vocab]), from the folder loaded back with from_pretrained(dtype=torch.float32): the numbers
a loader must reproduce.

  python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install torch transformers safetensors
  /tmp/hfenv/bin/python scripts/make-hf-fixtures.py tests/models/fixtures

Python is only the other side of the check: the library never runs it. The LibTorch 2.14 half of
CI also makes these folders afresh at test time (other seeds, with Debian sid's transformers):
tests/models/python/check_against_transformers.py imports FIXTURES and make() from this file.
"""
import json
import os
import sys

import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import hf_fixture_io  # noqa: E402  (scripts/lib: the folder writing shared with make-moe-fixtures.py)

VOCAB = 256
SEQ = 12
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so that the tiny head_dim's frequencies fall in all three bands of the scaling.
    "original_max_position_embeddings": 16,
}
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)

FIXTURES = {
    # Tied embeddings, llama3 rope scaling, weights saved in bf16 (5.x spelling: rope_parameters, dtype).
    "llama_tied_bf16": dict(cls=LlamaConfig, args=dict(SMALL, tie_word_embeddings=True,
                                                       rope_parameters=dict(LLAMA3_ROPE, rope_theta=10000.0)),
                            dtype=torch.bfloat16, shard=None, spelling="5.x"),
    # Untied, explicit head_dim (q_proj wider than hidden), biases everywhere, split into several
    # files, config rewritten in 4.x spelling (rope_theta/rope_scaling at the top, torch_dtype).
    "llama_untied_sharded": dict(cls=LlamaConfig, args=dict(SMALL, tie_word_embeddings=False, head_dim=16,
                                                            attention_bias=True, mlp_bias=True,
                                                            rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0)),
                                 dtype=torch.float32, shard="40KB", spelling="4.x"),
    # Qwen2: q/k/v biases, no o_proj bias, untied.
    "qwen2": dict(cls=Qwen2Config, args=dict(SMALL, tie_word_embeddings=False,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
                  dtype=torch.float32, shard=None, spelling="5.x"),
    # Mistral without a sliding window, tied.
    "mistral": dict(cls=MistralConfig, args=dict(SMALL, tie_word_embeddings=True, sliding_window=None),
                    dtype=torch.float32, shard=None, spelling="5.x"),
}


def to_4x_spelling(path):
    """config.json as transformers 4.x wrote it: rope_theta and rope_scaling at the top, torch_dtype."""
    with open(path) as f:
        config = json.load(f)
    rope = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = rope.pop("rope_theta", 10000.0)
    config["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def randomise(pname, p):
    # Every parameter random (norm weights and biases too, which transformers starts at 1 and 0),
    # so a name mixed up or a term left out changes the logits.
    if pname.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
    else:
        p.normal_(0.0, 0.2)


def make(out_dir, name, spec, seed):
    model = hf_fixture_io.random_model(spec, seed, randomise)
    folder = hf_fixture_io.save_folder(model.to(spec["dtype"]), out_dir, name, spec["shard"])
    if spec["spelling"] == "4.x":
        to_4x_spelling(os.path.join(folder, "config.json"))
    # The reference: the folder as saved (bf16 weights included), read back in float32.
    loaded = hf_fixture_io.load_float32(folder)
    tokens = hf_fixture_io.fixed_tokens(VOCAB, SEQ, seed + 1)
    with torch.no_grad():
        logits = loaded(tokens).logits.float().contiguous()
    hf_fixture_io.save_reference({"tokens": tokens, "logits": logits}, os.path.join(folder, "reference.safetensors"))
    files = sorted(os.listdir(folder))
    print(f"{name}: {files}, max|logits| {logits.abs().max().item():.4f}")


def main():
    hf_fixture_io.make_all(FIXTURES, make, 1000, hf_fixture_io.out_dir_arg(__file__))


if __name__ == "__main__":
    main()
