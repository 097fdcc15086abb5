#!/usr/bin/env python3
"""Compares two teacher-forced logit dumps (n_tokens x n_vocab float32, as
`family_fixture logits` writes them) over a token id file: top-1 agreement,
max/mean absolute difference and each side's perplexity of the next token.
Plain Python (no numpy). Used for docs/model-families.md, "Against llama.cpp".

  compare_logits.py A.f32 B.f32 N_VOCAB IDS_FILE [FIRST_POS LAST_POS+1]
"""
import array
import math
import sys


def load(path):
    a = array.array("f")
    with open(path, "rb") as f:
        a.frombytes(f.read())
    return a


def main():
    a, b, vocab = load(sys.argv[1]), load(sys.argv[2]), int(sys.argv[3])
    with open(sys.argv[4]) as f:
        ids = [int(x) for x in f.read().split()]
    if len(a) != len(b) or len(a) % vocab:
        sys.exit("the dumps differ in size or are not n x N_VOCAB")
    lo = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    hi = int(sys.argv[6]) if len(sys.argv) > 6 else len(a) // vocab
    agree, worst, total, scored = 0, 0.0, 0.0, 0
    nll = [0.0, 0.0]
    for t in range(lo, hi):
        rows = (a[t * vocab:(t + 1) * vocab], b[t * vocab:(t + 1) * vocab])
        tops = [max(range(vocab), key=r.__getitem__) for r in rows]
        agree += tops[0] == tops[1]
        d = [abs(x - y) for x, y in zip(*rows)]
        worst, total = max(worst, max(d)), total + sum(d)
        if t + 1 < len(ids):
            for k, r in enumerate(rows):
                m = max(r)
                nll[k] += m + math.log(sum(math.exp(x - m) for x in r)) - r[ids[t + 1]]
            scored += 1
    n = hi - lo
    pa, pb = math.exp(nll[0] / scored), math.exp(nll[1] / scored)
    print(f"positions {lo}-{hi - 1}: top-1 agree {100 * agree / n:.2f}% ({agree}/{n}), "
          f"max|d| {worst:.3g}, mean|d| {total / (n * vocab):.3g}, "
          f"perplexity {pa:.4f} vs {pb:.4f} ({100 * (pa / pb - 1):+.3f}%)")


if __name__ == "__main__":
    main()
