#!/usr/bin/env python3
"""Response-cache latency against a running daemon (issue 19): TTFT and
end-to-end time of a computed reply (miss), the same request again (exact
hit), and, with --semantic, a reworded request verified against the cached
answer (semantic-verified: k of N draft tokens accepted), each streamed.

  kvserve -m models/SmolLM2-135M-Instruct.Q4_1.gguf serve --response-cache-bytes 64MiB
  python3 bench/response_cache_latency.py --url http://127.0.0.1:8000

Only the standard library is used.
"""

import argparse
import json
import statistics
import time
import urllib.request

QUESTIONS = [
    ("What is the capital of France?", "Tell me the capital of France."),
    ("How do I reverse a list in Python?", "How can I reverse a Python list?"),
    ("Why is the sky blue?", "What makes the sky look blue?"),
    ("What is photosynthesis?", "Explain photosynthesis."),
    ("How do I reset my password?", "How can I reset my password?"),
    ("What causes earthquakes?", "Why do earthquakes happen?"),
    ("Who painted the Mona Lisa?", "Who is the painter of the Mona Lisa?"),
    ("How do I center a div in CSS?", "How can I center a div using CSS?"),
]


def stream(url, key, question, max_tokens, cache):
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "response_cache": cache,
    }
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    t0 = time.perf_counter()
    ttft = None
    info = {}
    with urllib.request.urlopen(req, timeout=300) as res:
        kind = res.headers.get("x-kvserve-cache")
        for line in res:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                if ttft is None and c.get("delta", {}).get("content"):
                    ttft = time.perf_counter() - t0
            if "kvserve_cache" in chunk:
                info = chunk["kvserve_cache"]
    return kind, ttft or 0.0, time.perf_counter() - t0, info


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--semantic", action="store_true", help="also time verified semantic hits")
    args = ap.parse_args()
    rows = {"miss": [], "exact": [], "semantic-verified": []}
    accepted = []
    for a, b in QUESTIONS:
        mode = {"semantic": "verified", "min_similarity": 0.8} if args.semantic else {}
        kind, ttft, e2e, _ = stream(args.url, args.api_key, a, args.max_tokens,
                                    dict(mode, lookup=False))
        rows["miss"].append((ttft, e2e))
        kind, ttft, e2e, _ = stream(args.url, args.api_key, a, args.max_tokens, mode)
        assert kind == "exact", kind
        rows["exact"].append((ttft, e2e))
        if args.semantic:
            kind, ttft, e2e, info = stream(args.url, args.api_key, b, args.max_tokens,
                                           dict(mode, store=False))
            if kind == "semantic-verified":
                rows["semantic-verified"].append((ttft, e2e))
                accepted.append((info.get("accepted_tokens", 0), info.get("draft_tokens", 0)))
    print("| reply | n | TTFT p50 (ms) | end-to-end p50 (ms) |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        if not r:
            continue
        print(f"| {name} | {len(r)} | {statistics.median(x[0] for x in r) * 1e3:.1f} | "
              f"{statistics.median(x[1] for x in r) * 1e3:.1f} |")
    if accepted:
        print("accepted / draft tokens per verified hit:",
              ", ".join(f"{k}/{n}" for k, n in accepted))


if __name__ == "__main__":
    main()
