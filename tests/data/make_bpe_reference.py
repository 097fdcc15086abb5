#!/usr/bin/env python3
"""Reference token ids for the llama-bpe (Llama 3) and qwen2 pre-tokenizers.

An implementation independent of kvserve's C++ one: the pre-tokenizer is the
model's own regex (as in its tokenizer.json / llama.cpp's llama-vocab.cpp)
run by Python's `regex` module, and the merges are the textbook GPT-2 BPE
loop over the GGUF's tokenizer.ggml.merges (read with the `gguf` package).
Before writing anything it checks itself against llama.cpp's own test
vectors for the same vocabularies (models/ggml-vocab-<name>.gguf.inp/.out,
produced with Hugging Face's tokenizers), and stops on any difference.

Inputs: the vocabulary-only GGUFs llama.cpp ships in its source (found in
the llama-cpp-python 0.3.36 sdist on PyPI under vendor/llama.cpp/models/;
deploy/setup.sh --models all puts them in models/). Outputs, committed:
tests/data/tokenizer_reference_<name>.jsonl, one line per string of
make_tokenizer_reference.TEXTS (the strings today's tokenizer tests use)
and of llama.cpp's .inp file: {"text", "ids"} (no BOS, no special-token
parsing).

Usage (from the repository root):
  pip install gguf regex
  python3 tests/data/make_bpe_reference.py --vocab-dir models
"""

import argparse
import json
import os
import sys

import gguf
import regex

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from make_tokenizer_reference import TEXTS  # noqa: E402

PATTERNS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
# Llama 3's tokenizer.json sets "ignore_merges": a word that is a token as
# a whole is that token, whether or not the merges reach it.
IGNORE_MERGES = {"llama-bpe": True, "qwen2": False}


def byte_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def field_strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


class Bpe:
    def __init__(self, path, name):
        r = gguf.GGUFReader(path)
        self.tokens = field_strings(r, "tokenizer.ggml.tokens")
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        merges = field_strings(r, "tokenizer.ggml.merges")
        self.ranks = {tuple(m.split(" ", 1)): i for i, m in enumerate(merges)}
        self.pattern = regex.compile(PATTERNS[name])
        self.ignore_merges = IGNORE_MERGES[name]
        self.b2u = byte_to_unicode()

    def word(self, w):
        chars = "".join(self.b2u[b] for b in w.encode("utf-8"))
        if self.ignore_merges and chars in self.ids:
            return [self.ids[chars]]
        parts = list(chars)
        while len(parts) > 1:
            best = min(range(len(parts) - 1),
                       key=lambda i: (self.ranks.get((parts[i], parts[i + 1]), 1 << 60), i))
            if (parts[best], parts[best + 1]) not in self.ranks:
                break
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        return [self.ids[p] for p in parts]

    def encode(self, text):
        out = []
        for w in self.pattern.findall(text):
            out.extend(self.word(w))
        return out


def read_llama_cpp_vectors(vocab_path):
    with open(vocab_path + ".inp", encoding="utf-8") as f:
        texts = f.read().split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    with open(vocab_path + ".out", encoding="utf-8") as f:
        ids = [[int(x) for x in line.split()] for line in f.read().split("\n")]
    return list(zip(texts, ids[:len(texts)]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab-dir", default=os.path.join(HERE, "..", "..", "models"))
    args = ap.parse_args()
    for name in ("llama-bpe", "qwen2"):
        path = os.path.join(args.vocab_dir, f"ggml-vocab-{name}.gguf")
        bpe = Bpe(path, name)
        vectors = read_llama_cpp_vectors(path)
        for text, want in vectors:
            got = bpe.encode(text)
            if got != want:
                sys.exit(f"{name}: reference disagrees with llama.cpp's vector {text!r}: {got} != {want}")
        texts = list(dict.fromkeys(TEXTS + [t for t, _ in vectors]))
        out = os.path.join(HERE, f"tokenizer_reference_{name}.jsonl")
        with open(out, "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"text": text, "ids": bpe.encode(text)}, ensure_ascii=True) + "\n")
        print(f"{name}: {len(vectors)} llama.cpp vectors agree; wrote {len(texts)} strings to {out}")


if __name__ == "__main__":
    main()
