#!/usr/bin/env python3
"""Renders the chat templates in tests/data/chat_templates/ with Python's jinja2.

Writes tests/data/chat_template_reference.jsonl: for every template and every
conversation below, the text jinja2 renders (or the error it raises), so
tests/unit/model/jinja_test.cc can check kvserve's own interpreter
(model/jinja.cc) against it without Python at test time.

The environment is the one Hugging Face's apply_chat_template builds
(transformers/utils/chat_template_utils.py): ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loopcontrols extension, its own
tojson filter (json.dumps, no key sorting), raise_exception and
strftime_now. strftime_now reads a fixed time here (FIXED_NOW, local time),
and the C++ test pins its clock to the same instant.

Usage (from the repository root): python3 tests/data/make_chat_template_reference.py
(needs jinja2 >= 3.1; Debian's python3-jinja2 will do).

The templates are the models' own tokenizer.chat_template strings, as
llama.cpp's models/templates/ ships them (MIT); SmolLM2's is the one its
GGUF carries.
"""

import json
import os
import time

import jinja2
import jinja2.ext
import jinja2.sandbox

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATES = os.path.join(HERE, "chat_templates")
OUT = os.path.join(HERE, "chat_template_reference.jsonl")

# 2026-01-02 03:04:05 UTC. The test renders with TZ=UTC.
FIXED_NOW = 1767323045

# bos_token / eos_token as each model's GGUF names them.
SPECIAL = {
    "HuggingFaceTB-SmolLM2-135M-Instruct": ("<|im_start|>", "<|im_end|>"),
    "meta-llama-Llama-3.1-8B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "meta-llama-Llama-3.2-3B-Instruct": ("<|begin_of_text|>", "<|eot_id|>"),
    "Qwen-Qwen2.5-7B-Instruct": ("<|endoftext|>", "<|im_end|>"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("<s>", "</s>"),
    "Mistral-Small-3.2-24B-Instruct-2506": ("<s>", "</s>"),
    "google-gemma-2-2b-it": ("<bos>", "<eos>"),
    # Gemma 3's instruction-tuned template (google/gemma-3-*-it
    # tokenizer_config.json, which the GGUF converter copies into
    # tokenizer.chat_template; llama.cpp's models/templates has no Gemma 3).
    "google-gemma-3-270m-it": ("<bos>", "<eos>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [
        {"role": "system", "content": "  Answer in French.\n"},
        {"role": "user", "content": "Good morning"},
        {"role": "assistant", "content": "Bonjour"},
        {"role": "user", "content": "Thank you"},
    ],
    [{"role": "user", "content": "  padded with spaces and a newline  \n"}],
    [{"role": "user", "content": "Grüße, 世界 🙂 — \"quotes\" and 'apostrophes' {{ not a tag }}"}],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "one"}, {"role": "user", "content": "two in a row"}],
    [{"role": "system", "content": "System only"}],
    [
        {"role": "user", "content": "line one\nline two"},
        {"role": "assistant", "content": "  reply with spaces  "},
    ],
]


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def strftime_now(fmt):
    return time.strftime(fmt, time.gmtime(FIXED_NOW))


def environment():
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def main():
    env = environment()
    lines = []
    for name in sorted(SPECIAL):
        with open(os.path.join(TEMPLATES, name + ".jinja"), encoding="utf-8") as f:
            source = f.read()
        template = env.from_string(source)
        bos, eos = SPECIAL[name]
        for messages in CONVERSATIONS:
            for gen in (True, False):
                entry = {"template": name, "bos_token": bos, "eos_token": eos,
                         "messages": messages, "add_generation_prompt": gen}
                try:
                    entry["expected"] = template.render(
                        messages=messages, add_generation_prompt=gen, bos_token=bos,
                        eos_token=eos)
                except jinja2.exceptions.TemplateError as e:
                    entry["error"] = str(e)
                lines.append(json.dumps(entry, ensure_ascii=False))
    with open(OUT, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} renderings to {OUT} (jinja2 {jinja2.__version__})")


if __name__ == "__main__":
    main()
