#!/usr/bin/env python3
"""Makes the small Hugging Face mixture-of-experts folders tests/models/test_moe_hf.cpp checks our
MixtralForCausalLM and Qwen3MoeForCausalLM (models/moe/) against.

Each folder is a random model saved by transformers' own save_pretrained (the Hub's layout: one
tensor per expert), plus reference.safetensors holding fixed tokens ("tokens", I64 [2, T]),
transformers' logits for them ("logits", F32 [2, T, vocab]) and, with output_router_logits=True and
labels=tokens, its training loss ("loss": shifted cross-entropy + router_aux_loss_coef x the
load-balancing loss) and the load-balancing loss alone ("aux_loss"), from the folder loaded back
with from_pretrained(dtype=torch.float32).

Beside two of them (ADAMW_FIXTURES), <name>.adamw.safetensors: 5 steps of torch.optim.AdamW on
transformers' model, as data parallelism at 4 ranks of 2 sequences each trains it ("tokens", I64
[5, 8, T]: step s, rank r's rows [2r, 2r + 2)), the ranks' losses ("losses", F64 [5, 4]: transformers'
loss with output_router_logits=True on each rank's rows; a step's loss is their mean), the learning
rate of each step ("lr", F64 [5]), the hyperparameters ("hyper", F64: lr, warmup, beta1, beta2,
eps, weight_decay, ranks, rows) and every parameter after step 5 under the Hub's names
("final.<name>", F32). tests/models/test_moe_train_ref.cpp trains our model the same way.

  python3 scripts/make-moe-fixtures.py tests/models/fixtures     # torch 2.x and transformers 5.x
  python3 scripts/make-moe-fixtures.py tests/models/fixtures --adamw-only   # the folders untouched

(scripts/libtorch2-check.sh's chroot has both.) Python is only the other side of the check: the
library never runs it. tests/models/python/check_against_transformers.py's moe check imports
FIXTURES and make() from this file to make the folders afresh with other seeds.
"""
import os
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import hf_fixture_io  # noqa: E402  (scripts/lib: the folder writing shared with make-hf-fixtures.py)

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


def randomise(pname, p):
    # Every parameter random (norm weights and biases too, which transformers starts at 1 and 0),
    # so a name mixed up or a term left out changes the logits. Router weights larger, so that
    # the experts' choice is clear-cut (no near ties for float32 rounding to flip).
    if pname.endswith("norm.weight"):
        p.copy_(1 + 0.2 * torch.randn_like(p))
    elif pname.endswith("gate.weight"):
        p.normal_(0.0, 1.0)
    else:
        p.normal_(0.0, 0.2)


def make(out_dir, name, spec, seed):
    model = hf_fixture_io.random_model(spec, seed, randomise)
    folder = hf_fixture_io.save_folder(model, out_dir, name, spec["shard"])
    loaded = hf_fixture_io.load_float32(folder)
    tokens = hf_fixture_io.fixed_tokens(VOCAB, SEQ, seed + 1)
    with torch.no_grad():
        out = loaded(tokens, labels=tokens, output_router_logits=True)
    hf_fixture_io.save_reference({"tokens": tokens, "logits": out.logits.float().contiguous(),
                                  "loss": out.loss.float().reshape(1), "aux_loss": out.aux_loss.float().reshape(1)},
                                 os.path.join(folder, "reference.safetensors"))
    files = sorted(os.listdir(folder))
    print(f"{name}: {files}, max|logits| {out.logits.abs().max().item():.4f}, loss {out.loss.item():.6f}, "
          f"aux {out.aux_loss.item():.6f}")


# ---- 5 AdamW steps: <name>.adamw.safetensors beside the folder ----------------------------------
# transformers' model trained in one process by torch.optim.AdamW on a global batch of RANKS x ROWS
# sequences, as data parallelism at RANKS ranks trains it: rank r holds rows [r ROWS, (r+1) ROWS);
# its loss is transformers' (labels = its rows, output_router_logits=True: cross-entropy +
# router_aux_loss_coef x the load-balancing loss over its own tokens) and the gradient the ranks'
# mean, so one step's loss is the mean of the ranks' losses.
ADAMW_FIXTURES = ("mixtral_untied_sharded", "qwen3_moe_sparse_step")
ADAMW = dict(steps=5, ranks=4, rows=2, lr=3e-3, warmup=2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def adamw_lr(step, a=ADAMW):
    """The schedule: linear warmup over `warmup` steps (lr x (step + 1) / warmup), then constant."""
    return a["lr"] * min(1.0, (step + 1) / a["warmup"])


def adamw_train(folder, batches, dtype, a=ADAMW):
    """(losses [steps, ranks], final parameters in the Hub's layout) of 5 AdamW steps."""
    # torch's grouped_mm (transformers' default for the experts) has no float64: eager there.
    extra = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra).train()
    opt = torch.optim.AdamW(model.parameters(), lr=a["lr"], betas=(a["beta1"], a["beta2"]), eps=a["eps"],
                            weight_decay=a["weight_decay"], foreach=False)
    losses = torch.zeros(a["steps"], a["ranks"], dtype=torch.float64)
    for step in range(a["steps"]):
        for group in opt.param_groups:
            group["lr"] = adamw_lr(step, a)
        opt.zero_grad()
        for r in range(a["ranks"]):
            rows = batches[step, r * a["rows"]:(r + 1) * a["rows"]]
            out = model(rows, labels=rows, output_router_logits=True)
            (out.loss / a["ranks"]).backward()
            losses[step, r] = out.loss.item()
        opt.step()
    # transformers 5.x fuses each layer's experts in memory; its save_pretrained writes one tensor
    # per expert under the Hub's names, the names our model has.
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        final = {}
        for f in sorted(os.listdir(tmp)):
            if f.endswith(".safetensors"):
                final.update(load_file(os.path.join(tmp, f)))
    return losses, final


def make_adamw_reference(out_dir, name, seed, a=ADAMW):
    folder = os.path.join(out_dir, name)
    batches = torch.randint(0, VOCAB, (a["steps"], a["ranks"] * a["rows"], SEQ),
                            generator=torch.Generator().manual_seed(seed))
    losses, final = adamw_train(folder, batches, torch.float32, a)
    # The same in float64 (the router's softmax stays float32 in transformers): how far float32
    # itself fixes each final parameter, printed only.
    _, exact = adamw_train(folder, batches, torch.float64, a)
    start = load_file_folder(folder)
    out = {"tokens": batches, "losses": losses,
           "lr": torch.tensor([adamw_lr(s, a) for s in range(a["steps"])], dtype=torch.float64),
           "hyper": torch.tensor([a["lr"], a["warmup"], a["beta1"], a["beta2"], a["eps"], a["weight_decay"],
                                  a["ranks"], a["rows"]], dtype=torch.float64)}
    out.update({"final." + k: v.float().contiguous() for k, v in final.items()})
    hf_fixture_io.save_reference(out, os.path.join(out_dir, name + ".adamw.safetensors"))
    per_tensor = {k: ((final[k].double() - exact[k].double()).abs().max() / exact[k].double().abs().max()).item()
                  for k in final}
    worst = max(per_tensor, key=per_tensor.get)
    moved = max(((final[k].double() - start[k].double()).abs().max() / start[k].double().abs().max()).item()
                for k in final)
    print(f"{name}.adamw: losses (mean over {a['ranks']} ranks) {[f'{v:.7f}' for v in losses.mean(1).tolist()]}; "
          f"float32 vs float64: worst {per_tensor[worst]:.3g} of the tensor's max at {worst}; moved up to {moved:.3g} "
          f"of a tensor's max; {len(final)} tensors")


def load_file_folder(folder):
    tensors = {}
    for f in sorted(os.listdir(folder)):
        if f.startswith("model") and f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, f)))
    return tensors


def main():
    # --adamw-only: the AdamW references from the folders as they are (which it leaves untouched).
    adamw_only = "--adamw-only" in sys.argv[1:]
    out_dir = hf_fixture_io.out_dir_arg(__file__, [a for a in sys.argv[1:] if a != "--adamw-only"])
    if not adamw_only:
        hf_fixture_io.make_all(FIXTURES, make, 3000, out_dir)
    for i, name in enumerate(ADAMW_FIXTURES):
        make_adamw_reference(out_dir, name, seed=3500 + 10 * i)


if __name__ == "__main__":
    main()
