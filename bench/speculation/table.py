#!/usr/bin/env python3
"""Turns bench/speculation/run.sh output into the docs' table.

Usage: bench/speculation/run.sh ... | tee out.txt; bench/speculation/table.py out.txt

For each workload and concurrency: output tokens/s with speculation off and
on (the mean of the runs), and the ratio. With SPEC_ABBA=1 output (each
point also measured in the reverse order) the ratio is the geometric mean
of the two orders' on/off ratios, which cancels the second run's warm-daemon
advantage; the spread between the two orders is printed too.
"""
import math
import re
import sys


def main(path):
    text = open(path).read()
    points = {}  # (workload, c) -> list of (off tok/s, on tok/s)
    order = []
    for block in text.split("### ")[1:]:
        head = block.split("\n", 1)[0]
        m = re.search(r"workload=(\S+) concurrency=(\d+)", head)
        if not m:
            continue
        key = (m.group(1), int(m.group(2)))
        rates = [float(x) for x in re.findall(r"^output tokens/s\s+([\d.]+)", block, re.M)]
        if len(rates) < 2:
            continue
        # run.sh prints A then B; A is off unless the block is reversed (or
        # SPEC_FRESH's, which measures the mode first).
        mode_first = head.startswith(("reversed", "fresh"))
        off, on = (rates[1], rates[0]) if mode_first else (rates[0], rates[1])
        if key not in points:
            points[key] = []
            order.append(key)
        points[key].append((off, on))
    concs = sorted({c for _, c in order})
    workloads = []
    for w, _ in order:
        if w not in workloads:
            workloads.append(w)
    print("| workload | " + " | ".join(f"c = {c}" for c in concs) + " |")
    print("|---|" + "---|" * len(concs))
    for w in workloads:
        cells = []
        for c in concs:
            runs = points.get((w, c))
            if not runs:
                cells.append("")
                continue
            off = sum(r[0] for r in runs) / len(runs)
            on = sum(r[1] for r in runs) / len(runs)
            ratios = [r[1] / r[0] for r in runs]
            g = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            cell = f"{off:.1f} → {on:.1f} ({g:.2f}x)"
            if len(ratios) > 1:
                cell += f" [{min(ratios):.2f}-{max(ratios):.2f}]"
            cells.append(cell)
        print(f"| {w} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
