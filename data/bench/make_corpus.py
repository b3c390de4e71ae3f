#!/usr/bin/env python3
"""A deterministic English-like corpus for the tokenizer benchmarks (docs/benchmarks.md, "Data"):
sentences of words drawn with a fixed seed from the repository's docs/*.md, one paragraph per line,
paragraphs separated by blank lines (fsdp-tokenize's documents).

  python3 data/bench/make_corpus.py MEGABYTES > corpus.txt
"""
import glob
import os
import random
import re
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
text = " ".join(open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(root, "docs", "*.md"))))
words = re.findall(r"[A-Za-z][a-z']+", text)
rng = random.Random(0)
target = int(sys.argv[1]) * 1_000_000 if len(sys.argv) > 1 else 8_000_000
size = 0
out = []
while size < target:
    para = " ".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))).capitalize() + "."
                    for _ in range(rng.randint(1, 6)))
    out.append(para + "\n\n")
    size += len(para) + 2
sys.stdout.write("".join(out))
