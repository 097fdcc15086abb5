#!/usr/bin/env python3
"""sentence-transformers' own speed on the texts of bench/embed_bench.cc
(one sentence per call, torch on one thread), for a side-by-side figure
with kvserve's encoder:

  /tmp/st-venv/bin/python bench/embed_st_bench.py models/all-MiniLM-L6-v2 && \\
    build/bench/embed_bench --benchmark_filter='BM_Embed/text:./f16:0'
"""

import sys
import time

import torch
from sentence_transformers import SentenceTransformer

TEXTS = [
    "How do I enable 2FA on my account?",
    "The response cache sits at the front door of the serving daemon; a semantic hit is "
    "verified by the model before it is served, so greedy answers never change.",
    "Semantic caching is great. " * 60,
]


def main():
    torch.set_num_threads(1)
    model = SentenceTransformer(sys.argv[1], device="cpu")
    for i, text in enumerate(TEXTS):
        tokens = len(model.tokenize([text])["input_ids"][0])
        for _ in range(3):
            model.encode(text, show_progress_bar=False)
        n, t0, c0 = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - t0 < 2.0:
            model.encode(text, show_progress_bar=False)
            n += 1
        wall = (time.perf_counter() - t0) / n
        cpu = (time.process_time() - c0) / n
        print("sentence-transformers text:%d tokens=%d  %.2f ms wall  %.2f ms cpu  %.1f sentences/s"
              % (i, tokens, wall * 1e3, cpu * 1e3, 1.0 / wall))


if __name__ == "__main__":
    main()
