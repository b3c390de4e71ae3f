#!/usr/bin/env python3
"""scripts/prepare-hf-tokenizer.py against the `tokenizers` package and fsdp-tokenize, run by CTest.

  check_prepare_hf_tokenizer.py --script scripts/prepare-hf-tokenizer.py --fsdp-tokenize BIN

Two tokenizers made here (nothing downloaded): a GPT-2-style byte-level BPE trained on a small
corpus (no post-processor: <|endoftext|> precedes each document) and a Llama-3-style one with more
than 65536 ids (uint32 shards) whose post-processor adds <|begin_of_text|>. The script's shards
equal shards written here from tokenizers' own ids, byte for byte (llm.c's header, the vocabulary in
header[3]); their header matches fsdp-tokenize's layout; decoding each document's ids gives its
text back; every bad input is one line, exit 2, and nothing written.

Exit 77 (CTest's SKIP_RETURN_CODE) when tokenizers does not import, unless
FSDP_REQUIRE_PYTHON_CHECKS=1 (the LibTorch 2.14 half of CI), where that is a failure.
"""
import argparse
import os
import struct
import subprocess
import sys
import tempfile

SKIP = 77


def skip(why):
    if os.environ.get("FSDP_REQUIRE_PYTHON_CHECKS") == "1":
        print(f"FAILED: {why} (FSDP_REQUIRE_PYTHON_CHECKS=1: these checks must run here)")
        sys.exit(1)
    print(f"SKIPPED: {why}")
    sys.exit(SKIP)


try:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
except ImportError as e:
    skip(f"{e} (needs python3 with tokenizers: Debian's python3-tokenizers, as in scripts/libtorch2-check.sh's chroot)")

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what)
    if not ok:
        failures.append(what)


PARAGRAPHS = ["The first paragraph.\nIts second line.", "Second: caf\u00e9 \u20ac 42", "  indented third\n\tand a tab"]
RECORDS = ["a JSON document", 'with "quotes"', "\u00fcber alles"]


def write_corpus(d):
    with open(os.path.join(d, "a.txt"), "w", encoding="utf-8") as f:
        f.write("\n" + PARAGRAPHS[0] + "\n\n\n" + PARAGRAPHS[1] + "\n\n" + PARAGRAPHS[2] + "\n")
    import json
    with open(os.path.join(d, "b.jsonl"), "w", encoding="utf-8") as f:
        for r in RECORDS:
            f.write(json.dumps({"id": 1, "text": r}) + "\n\n")


def gpt2_style(path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([f"The quick brown fox {i} jumps over the lazy dog." for i in range(200)] + PARAGRAPHS,
                            trainer)
    tok.save(path)
    return tok


def llama3_style(path):
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    for i in range(70000 - len(vocab)):
        vocab[f"\u0100unused{i}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(path)
    return tok


def shard_bytes(tokens, vocab):
    u32 = vocab > 65536
    header = [0] * 256
    header[0:4] = [20240801, 7, len(tokens), vocab] if u32 else [20240520, 1, len(tokens), vocab]
    return struct.pack("<256i", *header) + struct.pack(f"<{len(tokens)}{'I' if u32 else 'H'}", *tokens)


def read(path):
    with open(path, "rb") as f:
        return f.read()


def run(argv):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--script", required=True)
    ap.add_argument("--fsdp-tokenize", required=True)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prepare_hf_") as d:
        write_corpus(d)
        files = [os.path.join(d, "a.txt"), os.path.join(d, "b.jsonl")]
        texts = PARAGRAPHS + RECORDS
        for name, make, per_shard in [("gpt2", gpt2_style, 25), ("llama3", llama3_style, 40)]:
            tj = os.path.join(d, name + ".json")
            tok = make(tj)
            vocab = tok.get_vocab_size(with_added_tokens=True)
            docs = []
            for t in texts:
                ids = tok.encode(t, add_special_tokens=True).ids
                docs.append(ids if name == "llama3" else [tok.token_to_id("<|endoftext|>")] + ids)
            check(tok.decode(docs[0], skip_special_tokens=True) == texts[0], f"{name}: ids decode to the text")
            if name == "llama3":
                check(docs[0][0] == tok.token_to_id("<|begin_of_text|>"), "llama3: <|begin_of_text|> opens documents")
            flat = [i for doc in docs for i in doc]
            want = [shard_bytes(flat[i:i + per_shard], vocab) for i in range(0, len(flat), per_shard)]
            prefix = os.path.join(d, name)
            r = run([sys.executable, a.script, "--tokenizer", tj, "--shard-tokens", str(per_shard), "--out", prefix]
                    + files)
            check(r.returncode == 0, f"{name}: the script runs ({r.stdout.strip()} {r.stderr.strip()})")
            got = sorted(f for f in os.listdir(d) if f.startswith(name + "_"))
            check(len(got) == len(want), f"{name}: {len(want)} shards ({len(got)} written)")
            for i, w in enumerate(want):
                p = f"{prefix}_{i:06d}.bin"
                check(os.path.exists(p) and read(p) == w, f"{name}: {os.path.basename(p)} equals the reference")
        # The header as fsdp-tokenize lays it out (bytes: vocabulary 257, uint16).
        r = run([a.fsdp_tokenize, "--out", os.path.join(d, "ft"), files[0]])
        check(r.returncode == 0, "fsdp-tokenize runs")
        ours, theirs = read(os.path.join(d, "gpt2_000000.bin")), read(os.path.join(d, "ft_000000.bin"))
        h1, h2 = struct.unpack("<256i", ours[:1024]), struct.unpack("<256i", theirs[:1024])
        check(h1[:2] == h2[:2] and h1[4:] == h2[4:] and len(theirs) == 1024 + 2 * h2[2] and
              len(ours) == 1024 + 2 * h1[2], "the header and payload layout of fsdp-tokenize's uint16 shards")

        # Bad input: one line, exit 2, nothing written.
        def write(name, text, mode="w"):
            p = os.path.join(d, name)
            with open(p, mode) as f:
                f.write(text)
            return p
        bad = [
            ([os.path.join(d, "missing.txt")], "cannot read input"),
            ([write("bad.jsonl", '{"text": "fine"}\n{"text": unquoted}\n')], "bad.jsonl:2: not JSON"),
            ([write("nofield.jsonl", '{"body": "x"}\n')], 'nofield.jsonl:1: no string field "text" (give --field NAME)'),
            ([write("empty.txt", "\n\n")], "no documents in the input"),
            ([write("latin1.txt", b"caf\xe9\n", "wb")], "latin1.txt: not UTF-8"),
            (["--shard-tokens", "0", files[0]], "--shard-tokens must be in"),
            (["--tokenizer", files[0], files[0]], "is not a Hugging Face tokenizer.json"),
            (["--tokenizer", os.path.join(d, "none.json"), files[0]], "cannot read tokenizer"),
        ]
        for extra, message in bad:
            argv = [sys.executable, a.script, "--out", os.path.join(d, "x")]
            if "--tokenizer" not in extra:
                argv += ["--tokenizer", os.path.join(d, "gpt2.json")]
            r = run(argv + extra)
            written = [f for f in os.listdir(d) if f.startswith("x_")]
            check(r.returncode == 2 and message in r.stderr and r.stderr.count("\n") == 1 and not written,
                  f"bad input '{message}': one line, exit 2, nothing written (got {r.returncode}: {r.stderr!r}, "
                  f"written {written})")
        r = run([sys.executable, a.script, "--tokenizer", os.path.join(d, "gpt2.json"), "--out",
                 os.path.join(d, "gpt2"), files[0]])
        check(r.returncode == 2 and "gpt2_000000.bin exists" in r.stderr, "earlier shards under --out are refused")
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
