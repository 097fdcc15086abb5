#!/usr/bin/env python3
"""Writes greedy continuations computed by llama.cpp (through the PyPI package
llama-cpp-python) for prompts that are not in ../shared/golden, so the engine
is checked against an implementation we did not write.

Run once, by a developer, and commit the output:
  python3 -m venv /tmp/ref && /tmp/ref/bin/pip install llama-cpp-python==0.3.36
  /tmp/ref/bin/python tests/data/make_greedy_reference.py \
      --stories ../shared/models/stories260K.gguf \
      --smollm2 models/SmolLM2-135M-Instruct.Q4_1.gguf > tests/data/greedy_reference.jsonl
"""
import argparse
import json
import sys

import llama_cpp

STORIES_PROMPTS = [
    "Sam",
    "The sun was hot and",
    "Once upon a time, in a big forest, there lived",
    "Mia and her mom baked a cake.",
    "The boy said, \"Can I play too?\"",
    "Every night the moon",
]
SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "Here is a list of fruits: apples, bananas,",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nName three primary colors.<|im_end|>\n<|im_start|>assistant\n",
]


def greedy(llm, prompt_ids, n):
    """Greedy decode where every step re-evaluates the whole sequence as one
    batch. llama.cpp's batched and one-token paths differ in rounding (on
    SmolLM2 Q4_1 by up to ~0.3 in a logit), so the reference fixes one of them:
    the batched one. Also returns, per step, the gap between the best and the
    second-best logit: where it is tiny, two correct implementations may pick
    differently."""
    import numpy as np
    toks = list(prompt_ids)
    out, margins = [], []
    while len(out) < n:
        llm.reset()
        llm.eval(toks)
        logits = np.array(llm.scores[len(toks) - 1])
        top2 = np.argsort(-logits)[:2]
        tok = int(top2[0])
        if tok == llm.token_eos():
            break
        out.append(tok)
        margins.append(round(float(logits[top2[0]] - logits[top2[1]]), 5))
        toks.append(tok)
    return out, margins


def run(path, name, prompts, add_bos, n):
    llm = llama_cpp.Llama(model_path=path, n_ctx=512, n_threads=2, verbose=False, seed=0,
                          logits_all=True)
    for p in prompts:
        ids = llm.tokenize(p.encode(), add_bos=add_bos, special=True)
        out, margins = greedy(llm, ids, n)
        print(json.dumps({"model": name, "prompt": p, "add_bos": add_bos, "prompt_ids": ids,
                          "output_ids": out, "top2_margins": margins}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stories", required=True)
    ap.add_argument("--smollm2", required=True)
    ap.add_argument("-n", type=int, default=32)
    a = ap.parse_args()
    run(a.stories, "stories260K", STORIES_PROMPTS, True, a.n)
    run(a.smollm2, "SmolLM2-135M-Instruct.Q4_1", SMOLLM2_PROMPTS, False, a.n)


if __name__ == "__main__":
    sys.exit(main())
