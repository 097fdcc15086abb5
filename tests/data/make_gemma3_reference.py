#!/usr/bin/env python3
"""Turns llama.cpp's results on Gemma 3 270M Q4_K_M into the committed fixtures.

Gemma 3 270M Q4_K_M (deploy/setup.sh --models all; sha256 a5fd3b62...6818) was
run through llama.cpp as vendored in the llama-cpp-python 0.3.36 sdist, built
here (nothing of it is committed):

  * tokenizer: `llama-tokenize -m MODEL --stdin --ids --no-escape [--no-bos]
    [--parse-special]` on each string of tests/data/gemma3_token_strings.json,
    collected into one JSON document (TOKENS below: {"cases": [{"text",
    "ids_with_bos", "ids_no_bos", ["ids_with_bos_parse_special"]}]});
  * greedy: a 170-line program against llama.h (not kept here) that, for each
    prompt of tests/data/gemma3_prompts.json, clears the KV cache, tokenizes
    the prompt with BOS, decodes it in one batch, then takes the arg-max
    token step by step (up to N steps, stopping at an end-of-generation
    token), printing one line per prompt:
        P <prompt ids> | G <generated ids> | M <top-2 logit gap per step> | E <0|1> | H <text hex>
    (M has one more entry than G when E is 1: the step that chose EOG).

Usage:
  python3 tests/data/make_gemma3_reference.py TOKENS.json GREEDY.txt|GREEDY.json

This run (2026-12-06): 32 greedy steps per prompt, n_ctx 512, one thread,
llama.cpp's default context (F16 K/V cache, flash attention auto).

Writes tests/data/tokenizer_reference_gemma3.jsonl ({"text", "add_bos",
"special", "ids"} per line) and tests/data/gemma3_greedy_reference.jsonl
({"prompt", "prompt_ids", "ids", "margins", "eog", "text"}), read by
tests/unit/model/tokenizer_test.cc (Gemma3TokenizerTest) and
tests/e2e/model_families_test.cc (Gemma3RealE2eTest). Token ids are facts
about the tokenizer and the model's greedy choices, not model weights.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    tokens_path, greedy_path = sys.argv[1], sys.argv[2]
    doc = json.load(open(tokens_path, encoding="utf-8"))
    lines = []
    for c in doc["cases"]:
        lines.append({"text": c["text"], "add_bos": True, "special": False, "ids": c["ids_with_bos"]})
        lines.append({"text": c["text"], "add_bos": False, "special": False, "ids": c["ids_no_bos"]})
        if "ids_with_bos_parse_special" in c:
            lines.append({"text": c["text"], "add_bos": True, "special": True,
                          "ids": c["ids_with_bos_parse_special"]})
    with open(os.path.join(HERE, "tokenizer_reference_gemma3.jsonl"), "w", encoding="utf-8") as f:
        for l in lines:
            f.write(json.dumps(l, ensure_ascii=False) + "\n")

    prompts = json.load(open(os.path.join(HERE, "gemma3_prompts.json"), encoding="utf-8"))
    out = []
    if greedy_path.endswith(".json"):
        # The same results collected as JSON: {"completions": [{"prompt",
        # "prompt_ids", "token_ids", "top1_top2_logit_margin",
        # "stopped_at_eog", "text"}]}.
        for c in json.load(open(greedy_path, encoding="utf-8"))["completions"]:
            out.append({"prompt": c["prompt"], "prompt_ids": c["prompt_ids"], "ids": c["token_ids"],
                        "margins": c["top1_top2_logit_margin"], "eog": bool(c["stopped_at_eog"]),
                        "text": c["text"]})
    else:
        rows = [l for l in open(greedy_path, encoding="utf-8").read().splitlines() if l.startswith("P")]
        for prompt, row in zip(prompts, rows):
            parts = dict((p.strip().split(" ", 1) + [""])[:2] for p in row.split("|"))
            ints = lambda s: [int(x) for x in s.split()]
            out.append({"prompt": prompt, "prompt_ids": ints(parts["P"]), "ids": ints(parts["G"]),
                        "margins": [float(x) for x in parts["M"].split()],
                        "eog": parts["E"].strip() == "1",
                        "text": bytes.fromhex(parts["H"].strip()).decode("utf-8", "replace")})
    assert [e["prompt"] for e in out] == prompts
    for e in out:
        assert len(e["margins"]) == len(e["ids"]) + (1 if e["eog"] else 0), e["prompt"]
    with open(os.path.join(HERE, "gemma3_greedy_reference.jsonl"), "w", encoding="utf-8") as f:
        for e in out:
            f.write(json.dumps(e, ensure_ascii=False) + "\n")
    print(f"{len(lines)} tokenizer cases ({len(doc['cases'])} strings), {len(out)} greedy prompts")


if __name__ == "__main__":
    main()
