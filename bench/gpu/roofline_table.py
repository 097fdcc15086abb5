#!/usr/bin/env python3
"""Turns the files of `bench/gpu/run.sh roofline` into the markdown tables of
docs/gpu.md: the probe's copy rate, paged decode attention per KV codec and
context (GB/s, share of the copy traffic, tokens/s and the ratio to f16's
tokens/s), `kvserve bench`'s decode table, and the three daemon runs.

    python3 bench/gpu/roofline_table.py OUT/roofline > roofline.md

Missing inputs are reported as such in the output, never invented.
"""
import json
import os
import re
import sys


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def probe_section(d):
    text = read(os.path.join(d, "probe.txt"))
    out = ["### Device copy (`kvserve probe`)", ""]
    if not text:
        return out + ["(no probe output)", ""], None
    m = re.search(r"device->device copy: ([\d.]+) GB/s copied \(([\d.]+) GB/s", text)
    dev = re.search(r"device: (.*)", text)
    if not m:
        return out + ["(probe failed: %s)" % text.strip().splitlines()[-1][:200], ""], None
    traffic = float(m.group(2))
    out.append("| device | copied GB/s | HBM traffic GB/s (read + write) |")
    out.append("|---|---:|---:|")
    out.append("| %s | %s | %s |" % (dev.group(1).strip() if dev else "?", m.group(1), m.group(2)))
    return out + [""], traffic


def attention_section(d, traffic):
    out = ["### Paged decode attention (`kvserve_cuda_bench`, 16 sequences, 8 KV heads x 128, GQA 4)", ""]
    text = read(os.path.join(d, "decode_attention.json"))
    if not text:
        return out + ["(no benchmark output)", ""]
    try:
        runs = json.loads(text).get("benchmarks", [])
    except json.JSONDecodeError as e:
        return out + ["(unreadable benchmark output: %s)" % e, ""]
    rows = {}
    for b in runs:
        m = re.search(r"BM_PagedDecodeAttention/ctx:(\d+)/dtype:(\d+)", b.get("name", ""))
        if not m or b.get("error_occurred"):
            continue
        rows[(b.get("label", m.group(2)), int(m.group(1)))] = b
    if not rows:
        return out + ["(no successful runs)", ""]
    codecs = []
    for codec, _ in rows:
        if codec not in codecs:
            codecs.append(codec)
    ctxs = sorted({c for _, c in rows})
    out.append("| codec | positions | GB/s | % of copy traffic | tokens/s | x f16 tokens/s |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for codec in codecs:
        for ctx in ctxs:
            b = rows.get((codec, ctx))
            if b is None:
                continue
            f16 = rows.get(("f16", ctx))
            ratio = ""
            if f16 and f16.get("tok/s"):
                ratio = "%.2f" % (b.get("tok/s", 0) / f16["tok/s"])
            pct = b.get("pct_of_copy", 0)
            if not pct and traffic:
                pct = 100.0 * b.get("GB/s", 0) / traffic
            out.append("| %s | %d | %.0f | %.0f%% | %.0f | %s |" %
                       (codec, ctx, b.get("GB/s", 0), pct, b.get("tok/s", 0), ratio))
    return out + [""]


def engine_section(d):
    out = ["### Decode in the engine (`kvserve bench`, SmolLM2's shape)", ""]
    text = read(os.path.join(d, "engine_bench.txt"))
    lines = [l for l in (text or "").splitlines() if l.startswith("|")]
    if not lines:
        return out + ["(no `kvserve bench` table%s)" %
                      (": " + text.strip().splitlines()[-1][:200] if text else ""), ""]
    return out + lines + [""]


def daemon_section(d):
    out = ["### The daemon (`kvserve serve --device cuda` + `kvserve-bench`, SmolLM2's shape)", "",
           "| run | requests | output tok/s | prompt tok/s (prompt tokens / run time) | "
           "TTFT p50 ms | TPOT p50 ms | TPOT p99 ms |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    names = {"c1": "batch 1 (concurrency 1)", "mixed": "mixed, concurrency 64",
             "noreuse": "no reuse, 64 x 512, concurrency 8"}
    for key, title in names.items():
        text = read(os.path.join(d, key + ".result.json"))
        if not text:
            out.append("| %s | (not run) | | | | | |" % title)
            continue
        s = json.loads(text).get("summary", {})
        dur = s.get("duration_s") or 0
        out.append("| %s | %d ok / %d failed | %.0f | %.0f | %.1f | %.2f | %.2f |" % (
            title, s.get("completed", 0), s.get("failed", 0), s.get("output_token_throughput", 0),
            s.get("prompt_tokens", 0) / dur if dur else 0, s.get("ttft_ms", {}).get("p50", 0),
            s.get("tpot_ms", {}).get("p50", 0), s.get("tpot_ms", {}).get("p99", 0)))
    return out + [""]


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: roofline_table.py DIR")
    d = sys.argv[1]
    lines, traffic = probe_section(d)
    lines += attention_section(d, traffic)
    lines += engine_section(d)
    lines += daemon_section(d)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
