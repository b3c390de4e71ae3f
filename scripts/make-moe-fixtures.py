#!/usr/bin/env python3
"""Makes the small Hugging Face mixture-of-experts folders tests/models/test_moe_hf.cpp checks our
MixtralForCausalLM and Qwen3MoeForCausalLM (models/moe/) against.

Each folder is a random model saved by transformers' own save_pretrained (the Hub's layout: one
tensor per expert), plus reference.safetensors holding fixed tokens ("tokens", I64 [2, T]),
transformers' logits for them ("logits", F32 [2, T, vocab]) and, with output_router_logits=True and
labels=tokens, its training loss ("loss": shifted cross-entropy + router_aux_loss_coef x the
load-balancing loss) and the load-balancing loss alone ("aux_loss"), from the folder loaded back
with from_pretrained(dtype=torch.float32).

  python3 scripts/make-moe-fixtures.py tests/models/fixtures     # torch 2.x and transformers 5.x

(scripts/libtorch2-check.sh's chroot has both.) Python is only the other side of the check: the
library never runs it. tests/models/python/check_against_transformers.py's moe check imports
FIXTURES and make() from this file to make the folders afresh with other seeds.
"""
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

VOCAB = 256
SEQ = 12
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, rms_norm_eps=1e-5, router_aux_loss_coef=0.05)

FIXTURES = {
    # Mixtral, 4 experts top 2, tied embeddings, one file.
    "mixtral_tied": dict(cls=MixtralConfig, args=dict(SMALL, intermediate_size=48, num_local_experts=4,
                                                      num_experts_per_tok=2, tie_word_embeddings=True,
                                                      rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 1e6}),
                         shard=None),
    # Mixtral, 8 experts top 2, untied, split into several files.
    "mixtral_untied_sharded": dict(cls=MixtralConfig, args=dict(SMALL, intermediate_size=40, num_local_experts=8,
                                                                num_experts_per_tok=2, tie_word_embeddings=False),
                                   shard="60KB"),
    # Qwen3-MoE, 8 experts top 2, no renormalisation (norm_topk_prob false), head_dim 16 (q_proj
    # wider than hidden), q/k norms, untied.
    "qwen3_moe_untied": dict(cls=Qwen3MoeConfig, args=dict(SMALL, intermediate_size=64, moe_intermediate_size=24,
                                                           num_experts=8, num_experts_per_tok=2, head_dim=16,
                                                           norm_topk_prob=False, tie_word_embeddings=False),
                             shard=None),
    # Qwen3-MoE with dense layers: 4 layers, mlp_only_layers [0] and decoder_sparse_step 2 make
    # layers 0 and 2 dense, 1 and 3 sparse; renormalised top 2 of 4, tied, attention biases.
    "qwen3_moe_sparse_step": dict(cls=Qwen3MoeConfig, args=dict(SMALL, num_hidden_layers=4, intermediate_size=56,
                                                                moe_intermediate_size=24, num_experts=4,
                                                                num_experts_per_tok=2, norm_topk_prob=True,
                                                                mlp_only_layers=[0], decoder_sparse_step=2,
                                                                attention_bias=True, tie_word_embeddings=True),
                                  shard=None),
}


def make(out_dir, name, spec, seed):
    torch.manual_seed(seed)
    config = spec["cls"](**spec["args"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    # Every parameter random (norm weights and biases too, which transformers starts at 1 and 0),
    # so a name mixed up or a term left out changes the logits. Router weights larger, so that
    # the experts' choice is clear-cut (no near ties for float32 rounding to flip).
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif pname.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.2)
    folder = os.path.join(out_dir, name)
    shutil.rmtree(folder, ignore_errors=True)
    kwargs = {"max_shard_size": spec["shard"]} if spec["shard"] else {}
    model.save_pretrained(folder, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        out = loaded(tokens, labels=tokens, output_router_logits=True)
    save_file({"tokens": tokens, "logits": out.logits.float().contiguous(), "loss": out.loss.float().reshape(1),
               "aux_loss": out.aux_loss.float().reshape(1)},
              os.path.join(folder, "reference.safetensors"),
              metadata={"transformers": transformers.__version__, "torch": torch.__version__})
    files = sorted(os.listdir(folder))
    print(f"{name}: {files}, max|logits| {out.logits.abs().max().item():.4f}, loss {out.loss.item():.6f}, "
          f"aux {out.aux_loss.item():.6f}")


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "models",
                                                                 "fixtures")
    os.makedirs(out_dir, exist_ok=True)
    for i, (name, spec) in enumerate(FIXTURES.items()):
        make(out_dir, name, spec, seed=3000 + 10 * i)


if __name__ == "__main__":
    main()
