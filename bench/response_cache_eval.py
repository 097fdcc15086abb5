#!/usr/bin/env python3
"""Semantic response-cache evaluation (issue 19) against a running daemon.

For each pair of bench/data/response_cache_pairs.jsonl (paraphrases that
should be served, traps -- negations, swapped entities, other numbers -- that
must not be), it stores the answer to `a`, then asks `b` three ways:

  * semantic "verified" with min_similarity -1: the nearest candidate's
    similarity, the draft tokens offered and accepted, and the answer;
  * with the cache bypassed (lookup and store off): the model's own greedy
    answer to `b`.

From those it reports, per similarity threshold t:

  * hit rate: paraphrases whose candidate reaches t;
  * wrong-hit rate without verification (approximate mode, GPTCache
    semantics): traps whose candidate reaches t -- their cached answer, to
    another question, would be served;
  * wrong answers with verification: pairs whose verified answer differs
    from the model's own greedy answer (zero by construction), and the share
    of draft tokens the model kept.

The daemon needs the response cache and the sentence encoder:

  kvserve -m models/SmolLM2-135M-Instruct.Q4_1.gguf serve \
      --response-cache-bytes 64MiB --semantic-cache-model DIR --http-port 8000
  python3 bench/response_cache_eval.py --url http://127.0.0.1:8000

Only the standard library is used.
"""

import argparse
import json
import os
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def post(url, path, body, key):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", "Bearer " + key)
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as res:
        data = json.loads(res.read())
        data["_header"] = res.headers.get("x-kvserve-cache")
    data["_seconds"] = time.perf_counter() - t0
    return data


def chat(question, max_tokens, cache):
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "response_cache": cache,
    }


def answer(reply):
    return reply["choices"][0]["message"]["content"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY", ""))
    ap.add_argument("--pairs", default=os.path.join(HERE, "data", "response_cache_pairs.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--limit", type=int, default=0, help="first N pairs only (0: all)")
    ap.add_argument("--thresholds", default="0.70,0.75,0.80,0.85,0.88,0.90,0.92,0.94,0.96,0.98")
    ap.add_argument("--out", default="", help="write per-pair results here (JSON lines)")
    args = ap.parse_args()

    pairs = [json.loads(line) for line in open(args.pairs) if line.strip()]
    if args.limit:
        pairs = pairs[: args.limit]
    rows = []
    for i, p in enumerate(pairs):
        # One pair at a time: the index holds only `a`'s answer.
        post(args.url, "/admin/response_cache/purge", {"all": True}, args.api_key)
        post(args.url, "/v1/chat/completions",
             chat(p["a"], args.max_tokens, {"semantic": "verified"}), args.api_key)
        verified = post(args.url, "/v1/chat/completions",
                        chat(p["b"], args.max_tokens,
                             {"semantic": "verified", "min_similarity": -1, "store": False}),
                        args.api_key)
        plain = post(args.url, "/v1/chat/completions",
                     chat(p["b"], args.max_tokens, {"lookup": False, "store": False}),
                     args.api_key)
        info = verified.get("kvserve_cache") or {}
        row = {
            "kind": p["kind"],
            "should_serve": p["should_serve"],
            "similarity": info.get("similarity"),
            "hit_kind": info.get("kind"),
            "draft_tokens": info.get("draft_tokens", 0),
            "accepted_tokens": info.get("accepted_tokens", 0),
            "verified_equals_plain": answer(verified) == answer(plain),
            "seconds_verified": verified["_seconds"],
            "seconds_plain": plain["_seconds"],
        }
        rows.append(row)
        print(f"{i + 1}/{len(pairs)} {p['kind']:15s} sim={row['similarity']} "
              f"accepted={row['accepted_tokens']}/{row['draft_tokens']}", file=sys.stderr)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")

    para = [r for r in rows if r["should_serve"]]
    traps = [r for r in rows if not r["should_serve"]]
    print(f"pairs: {len(rows)} ({len(para)} paraphrases, {len(traps)} traps)")
    print("| threshold | paraphrase hit rate | trap wrong-hit rate, approximate | "
          "wrong answers, verified | draft tokens kept, verified hits |")
    print("|---|---|---|---|---|")
    for t in [float(x) for x in args.thresholds.split(",")]:
        hit = [r for r in para if r["similarity"] is not None and r["similarity"] >= t]
        wrong = [r for r in traps if r["similarity"] is not None and r["similarity"] >= t]
        served = [r for r in rows if r["similarity"] is not None and r["similarity"] >= t]
        wrong_verified = [r for r in served if not r["verified_equals_plain"]]
        offered = sum(r["draft_tokens"] for r in served)
        kept = sum(r["accepted_tokens"] for r in served)
        print(f"| {t:.2f} | {len(hit) / max(1, len(para)):.1%} | "
              f"{len(wrong) / max(1, len(traps)):.1%} | {len(wrong_verified)} of {len(served)} | "
              f"{kept / max(1, offered):.1%} |")
    differing = [r for r in rows if not r["verified_equals_plain"]]
    print(f"verified answers that differ from the model's own: {len(differing)} of {len(rows)}")


if __name__ == "__main__":
    main()
