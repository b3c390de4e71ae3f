"""The folder-writing half shared by scripts/make-hf-fixtures.py and scripts/make-moe-fixtures.py:
a random model of a config class, saved by transformers' own save_pretrained, its fixed tokens and
reference.safetensors with the versions that made it, and the command line that makes every folder
of a FIXTURES table. Each script keeps what differs (its table, how it randomises the parameters and
what the reference holds); the bytes written are the ones each script wrote on its own.
"""
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM


def random_model(spec, seed, init):
    """spec["cls"](**spec["args"]) built by transformers in float32 (eval mode), seeded with `seed`,
    then init(name, parameter) called on every named parameter under no_grad."""
    torch.manual_seed(seed)
    config = spec["cls"](**spec["args"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            init(pname, p)
    return model


def save_folder(model, out_dir, name, shard):
    """<out_dir>/<name> made afresh by save_pretrained (split at `shard`, e.g. "60KB", or one file)."""
    folder = os.path.join(out_dir, name)
    shutil.rmtree(folder, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def load_float32(folder):
    """The folder as transformers reads it back, in float32, eval mode."""
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def fixed_tokens(vocab, seq, seed, rows=2):
    """The reference's tokens: I64 [rows, seq], uniform in [0, vocab), from their own generator."""
    return torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


def save_reference(tensors, path):
    """safetensors with the transformers and torch versions that made it in the metadata."""
    save_file(tensors, path, metadata={"transformers": transformers.__version__, "torch": torch.__version__})


def out_dir_arg(script, args=None):
    """The scripts' one argument: the folder to write into (default the committed
    tests/models/fixtures beside `script`), created."""
    args = sys.argv[1:] if args is None else args
    out_dir = args[0] if args else os.path.join(os.path.dirname(script), "..", "tests", "models", "fixtures")
    os.makedirs(out_dir, exist_ok=True)
    return out_dir


def make_all(fixtures, make, first_seed, out_dir):
    """Every folder of `fixtures` into out_dir, folder i seeded first_seed + 10 i."""
    for i, (name, spec) in enumerate(fixtures.items()):
        make(out_dir, name, spec, seed=first_seed + 10 * i)
