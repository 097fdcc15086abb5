#!/usr/bin/env python3
# Multi-turn completions against two OpenAI-compatible daemons (e.g. prefix
# cache on and off), interleaved turn by turn so machine load hits both
# alike. Each turn resends the whole transcript plus ~300 new tokens of text
# (words of a local text file) and asks for 16 greedy tokens, streamed;
# prints one JSON line per turn: TTFT (first text chunk), prompt tokens,
# cached tokens (usage.prompt_tokens_details.cached_tokens), their share of
# the previous turn's tokens, and whether both daemons wrote the same text;
# then a summary line: TTFT p50 of each daemon over turns 1.. (turn 0 has
# nothing cached on either) and their ratio.
#
#   bench/multi_turn_ttft.py http://127.0.0.1:A http://127.0.0.1:B MODEL [TURNS] [TEXT] [WORDS]
#
# WORDS: words of text per question (default 240, ~300 tokens on Gemma 3's
# vocabulary; a chat user's turn is nearer 80).
import json
import statistics
import sys
import time
import urllib.request


def post(url, model, prompt):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.time()
    ttft, text, usage = None, "", None
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            if d.get("choices") and d["choices"][0].get("text"):
                if ttft is None:
                    ttft = time.time() - t0
                text += d["choices"][0]["text"]
            if d.get("usage"):
                usage = d["usage"]
    return ttft, text, usage


def main():
    a, b, model = sys.argv[1], sys.argv[2], sys.argv[3]
    turns = int(sys.argv[4]) if len(sys.argv) > 4 else 7
    text_file = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] else "/usr/share/common-licenses/GPL-3"
    words = open(text_file).read().split()
    per_turn = int(sys.argv[6]) if len(sys.argv) > 6 else 240
    ttfts = {"a": [], "b": []}
    transcript = {a: "", b: ""}
    prev = {a: 0, b: 0}
    for t in range(turns):
        row = {"turn": t}
        texts = {}
        for name, url in (("a", a), ("b", b)):
            transcript[url] += ("\n\nQuestion: " if t else "Question: ") + \
                " ".join(words[t * per_turn:(t + 1) * per_turn]) + "\nAnswer:"
            ttft, text, u = post(url, model, transcript[url])
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            row[name] = {"ttft_s": round(ttft, 2), "prompt": u["prompt_tokens"], "cached": cached,
                         "share_prev": round(cached / prev[url], 3) if prev[url] else None}
            prev[url] = u["prompt_tokens"] + u["completion_tokens"]
            transcript[url] += text
            texts[name] = text
            if t > 0:
                ttfts[name].append(ttft)
        row["same_text"] = texts["a"] == texts["b"]
        print(json.dumps(row), flush=True)
    if turns > 1:
        p50 = {k: statistics.median(v) for k, v in ttfts.items()}
        print(json.dumps({"turns_1_on": turns - 1, "ttft_p50_a_s": round(p50["a"], 3),
                          "ttft_p50_b_s": round(p50["b"], 3),
                          "b_over_a": round(p50["b"] / p50["a"], 2)}), flush=True)


if __name__ == "__main__":
    main()
