#!/usr/bin/env python3
"""Text files or JSON lines -> llm.c token shards with a Hugging Face tokenizer.json, for
train_gpt --data tokens:'PREFIX_*.bin'. The Python side of fsdp-tokenize for tokenizers that
libsentencepiece cannot read (GPT-2, Llama 3, Qwen2: byte-level BPE); optional: nothing else in the
project needs Python.

  python3 scripts/prepare-hf-tokenizer.py --tokenizer gpt2/tokenizer.json --out data/web_train web.jsonl
  build/bin/train_gpt --data 'tokens:data/web_*.bin' --tokenizer gpt2/tokenizer.json ...   # decodes samples

Needs the `tokenizers` package (pip install tokenizers; Debian: python3-tokenizers). The shards are
fsdp-tokenize's format byte for byte: llm.c's 256 x int32 header (uint16 tokens, magic 20240520
version 1, when the vocabulary has at most 65536 ids; else uint32, magic 20240801 version 7),
header[3] the vocabulary size (added tokens included), PREFIX_000000.bin, PREFIX_000001.bin, ...
of --shard-tokens tokens each, written under temporary names and renamed in at the end. Documents
are read as fsdp-tokenize reads them (runs of lines between blank lines in text files; the --field
string of each line of .jsonl/.json/.ndjson files) and each is encoded alone with the tokenizer's
own special tokens (its post-processor: Llama 3's <|begin_of_text|>); a tokenizer that adds none
(GPT-2) gets <|endoftext|> before each document, as llm.c's GPT-2 data has it.

Bad input: one line on stderr, exit 2, nothing written.
"""
import argparse
import array
import json
import os
import struct
import sys
import time

GPT2_MAGIC, GPT2_VERSION = 20240520, 1
LLAMA3_MAGIC, LLAMA3_VERSION = 20240801, 7
HEADER_INTS = 256
JSON_EXTS = (".jsonl", ".json", ".ndjson")


class InputError(Exception):
    pass


def documents(path, field):
    """(text, where) for each document of `path`, as fsdp-tokenize splits it (lines end at b"\\n")."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline ending the last line opens no line
    def text_of(raw, where):
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{where}: not UTF-8 ({e.reason} at byte {e.start}; tokenizers encode text)")
    if path.endswith(JSON_EXTS):
        for n, line in enumerate(lines, 1):
            if not line.strip(b" \t\r"):
                continue
            where = f"{path}:{n}"
            try:
                record = json.loads(text_of(line, where))
            except json.JSONDecodeError as e:
                raise InputError(f"{where}: not JSON ({e.msg} at column {e.colno})")
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise InputError(f'{where}: no string field "{field}" (give --field NAME)')
            yield record[field], where
    else:
        doc = []
        for line in lines:
            if line:
                doc.append(line)
            elif doc:
                yield text_of(b"\n".join(doc), path), path
                doc = []
        if doc:
            yield text_of(b"\n".join(doc), path), path


def shard_name(prefix, i):
    return f"{prefix}_{i:06d}.bin"


class ShardWriter:
    """Shards of exactly shard_tokens tokens (the last one the rest) under temporary names."""

    def __init__(self, prefix, vocab, shard_tokens):
        self.prefix, self.vocab, self.shard_tokens = prefix, vocab, shard_tokens
        self.u32 = vocab > 65536
        self.buf, self.temps, self.total = [], [], 0

    def append(self, ids):
        i = 0
        while i < len(ids):
            take = min(len(ids) - i, self.shard_tokens - len(self.buf))
            self.buf.extend(ids[i:i + take])
            self.total += take
            i += take
            if len(self.buf) == self.shard_tokens:
                self.flush()

    def flush(self):
        tmp = shard_name(self.prefix, len(self.temps)) + ".tmp"
        self.temps.append(tmp)
        header = [0] * HEADER_INTS
        header[0], header[1] = (LLAMA3_MAGIC, LLAMA3_VERSION) if self.u32 else (GPT2_MAGIC, GPT2_VERSION)
        header[2], header[3] = len(self.buf), self.vocab
        with open(tmp, "wb") as f:
            f.write(struct.pack(f"<{HEADER_INTS}i", *header))
            tokens = array.array("I" if self.u32 else "H", self.buf)
            if sys.byteorder == "big":
                tokens.byteswap()  # little-endian, as llm.c writes
            f.write(tokens.tobytes())
        self.buf = []

    def commit(self):
        if self.buf:
            self.flush()
        names = []
        for i, tmp in enumerate(self.temps):
            names.append(shard_name(self.prefix, i))
            os.replace(tmp, names[-1])
        self.temps = []
        return names

    def discard(self):
        for tmp in self.temps:
            try:
                os.remove(tmp)
            except OSError:
                pass


def load_tokenizer(path):
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise InputError(f"the tokenizers package does not import ({e}): pip install tokenizers "
                         "(Debian: apt-get install python3-tokenizers)")
    if not os.path.isfile(path):
        raise InputError(f"cannot read tokenizer '{path}': no such file (give a Hugging Face tokenizer.json)")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # tokenizers raises plain Exception on a bad file
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"tokenizer '{path}' is not a Hugging Face tokenizer.json ({first})")


def run(args):
    if not 1 <= args.shard_tokens <= 2**31 - 1:
        raise InputError("--shard-tokens must be in [1, 2^31 - 1] (llm.c's int32 count)")
    for path in args.files:
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise InputError(f"cannot read input '{path}': not a readable regular file")
    folder = os.path.dirname(args.out)
    if folder and not os.path.isdir(folder):
        raise InputError(f"--out {args.out}: folder {folder} does not exist (create it first)")
    if os.path.exists(shard_name(args.out, 0)):
        raise InputError(f"{shard_name(args.out, 0)} exists: remove the earlier shards ({args.out}_*.bin) "
                         "or give another --out (a stale shard would join the glob)")
    tok = load_tokenizer(args.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    probe = tok.encode("a", add_special_tokens=True)
    adds_specials = any(probe.special_tokens_mask)
    eot = tok.token_to_id("<|endoftext|>")
    prefix_ids = [] if adds_specials or eot is None else [eot]
    writer = ShardWriter(args.out, vocab, args.shard_tokens)
    t0, n_docs, n_bytes = time.time(), 0, 0
    try:
        for path in args.files:
            n_bytes += os.path.getsize(path)
            batch = list(documents(path, args.field))
            for enc in tok.encode_batch([text for text, _ in batch], add_special_tokens=True):
                writer.append(prefix_ids + enc.ids)
            n_docs += len(batch)
        if writer.total == 0:
            raise InputError("no documents in the input: nothing to write")
        names = writer.commit()
    finally:
        writer.discard()
    secs = max(time.time() - t0, 1e-9)
    last = f" .. {names[-1]}" if len(names) > 1 else ""
    print(f"prepare-hf-tokenizer: {len(args.files)} file{'s' if len(args.files) != 1 else ''}, {n_docs} documents, "
          f"{writer.total} tokens -> {len(names)} shard{'s' if len(names) != 1 else ''} {names[0]}{last} "
          f"({'uint32' if writer.u32 else 'uint16'}, vocabulary {vocab}) in {secs:.2f} s "
          f"({n_bytes / 1e6 / secs:.1f} MB/s of text)")


class Parser(argparse.ArgumentParser):
    def error(self, message):
        print(f"prepare-hf-tokenizer: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main():
    p = Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="A Hugging Face tokenizer.json")
    p.add_argument("--field", default="text", help="The JSON field holding each document's text")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="Tokens per shard (the last one the rest)")
    p.add_argument("--out", required=True, help="Output prefix: PREFIX_000000.bin, PREFIX_000001.bin, ...")
    p.add_argument("files", nargs="+", help="Text or JSON-lines files")
    args = p.parse_args()
    try:
        run(args)
    except InputError as e:
        print(f"prepare-hf-tokenizer: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
