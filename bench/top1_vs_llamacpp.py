#!/usr/bin/env python3
"""Teacher-forced top-1 agreement of kvserve with llama.cpp on the same text.

kvserve side: `kvserve -m MODEL perplexity -f TEXT -c 512 --top1-out OURS`
writes two lines per window: the most likely next token at every scored
position (positions c/2 .. c-2 of each window, llama-perplexity's layout),
then each position's negative log-likelihood.

llama.cpp side: a per-window teacher-forced dump on the same windows (BOS
first, c tokens), one line per window of the form
  C <k> | T <c input ids> | A <argmax at positions 0..c-2> | M <top1-top2 logit
  margin at 0..c-2> | N <nll of the scored positions>
as written by a ~170-line program on llama.h (llama_decode of the window in
one batch with logits for every position; not part of this repository).

Prints the agreement over all scored positions, and how many of the
disagreements fall where llama.cpp's own top-2 margin is below --near-tie
(positions where a last-bit difference may flip the choice); then the
per-position NLL differences: their mean is log(ppl ratio), and their
standard deviation / sqrt(n) is how far apart two engines whose per-token
scores differ that much may land by chance.
"""
import math
import argparse
import sys


def ref_is_dump(path):
    with open(path) as f:
        return f.read(2) == "C "


def read_dump(path):
    out = []
    for line in open(path):
        if not line.startswith("C "):
            continue
        fields = {p.strip()[0]: p.strip()[2:].split() for p in line.split("|")}
        out.append((list(map(int, fields["A"])), list(map(float, fields["M"])),
                    list(map(float, fields["N"]))))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ours", help="kvserve perplexity --top1-out file (or a second llama.cpp dump)")
    ap.add_argument("ref", help="llama.cpp per-window dump (C|T|A|M|N lines)")
    ap.add_argument("--near-tie", type=float, default=0.1)
    args = ap.parse_args()

    ref = read_dump(args.ref)
    if ref_is_dump(args.ours):
        # A second llama.cpp dump in place of kvserve's file: llama.cpp against
        # itself (another attention setting, or a last-bit perturbation), the
        # ceiling any other engine can reach on the same file.
        ours, ours_nll = [], []
        for a, _, nll in read_dump(args.ours):
            c = len(a) + 1
            ours.append(a[c // 2:c - 1])
            ours_nll.append(nll)
    else:
        lines = [line.split() for line in open(args.ours) if line.strip()]
        ours = [list(map(int, l)) for l in lines[0::2]]
        ours_nll = [list(map(float, l)) for l in lines[1::2]]
    n = min(len(ours), len(ref))
    if n == 0:
        sys.exit("no windows to compare")
    if len(ours) != len(ref):
        print(f"note: comparing the first {n} windows ({len(ours)} kvserve, {len(ref)} llama.cpp)")
    total = agree = near = 0
    diffs = []
    for k in range(n):
        a, m, ref_nll = ref[k]
        diffs += [o - r for o, r in zip(ours_nll[k], ref_nll)]
        c = len(a) + 1
        first = c // 2
        want = a[first:c - 1]
        got = ours[k]
        if len(got) != len(want):
            sys.exit(f"window {k}: {len(got)} scored positions vs {len(want)}: different -c?")
        for j, (g, w) in enumerate(zip(got, want)):
            total += 1
            if g == w:
                agree += 1
            elif m[first + j] < args.near_tie:
                near += 1
    miss = total - agree
    print(f"top-1 agreement {agree}/{total} = {100.0 * agree / total:.2f}% over {n} windows; "
          f"{miss} misses, {near} of them where llama.cpp's top-2 margin < {args.near_tie}")
    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(1, len(diffs) - 1))
    print(f"per-position NLL, first file - llama.cpp dump: mean {mean:+.5f} (ppl ratio "
          f"{math.exp(mean):.4f}), sd {sd:.4f}, mean |diff| "
          f"{sum(abs(d) for d in diffs) / len(diffs):.4f}; chance spread of the ppl ratio "
          f"+-{100 * sd / math.sqrt(len(diffs)):.2f}%")


if __name__ == "__main__":
    main()
