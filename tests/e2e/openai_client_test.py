#!/usr/bin/env python3
"""Drives a running kvserve daemon with the official `openai` client, unchanged.

Run by tests/e2e/http_test.cc (which starts the daemons); exits non-zero on the
first failed check. By hand:

  python3 tests/e2e/openai_client_test.py --base-url http://127.0.0.1:8000/v1 \
      --model stories260K [--chat-base-url ... --chat-model ...]
"""
import argparse
import sys

import openai


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def completions(client, model, expected):
    models = client.models.list()
    check([m.id for m in models.data] == [model], "models.list names the served model")

    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=48,
                                  temperature=0)
    check(r.object == "text_completion", "completion object")
    check(r.choices[0].finish_reason == "length", "finish_reason length")
    check(r.usage.completion_tokens == 48, "usage.completion_tokens")
    check(r.usage.total_tokens == r.usage.prompt_tokens + 48, "usage.total_tokens")
    if expected is not None:
        check(r.choices[0].text == expected, "greedy text equals the golden continuation")

    text = ""
    usage = None
    finish = None
    stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=48,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    check(text == r.choices[0].text, "streamed deltas concatenate to the full text")
    check(finish == "length", "stream ends with finish_reason")
    check(usage is not None and usage.completion_tokens == 48, "stream usage chunk")

    # Extras ride in extra_body, as with vLLM.
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8,
                                  temperature=0.7, seed=3, stop=["\n"],
                                  extra_body={"top_k": 20, "repetition_penalty": 1.1})
    check(len(r.choices) == 1, "sampling extras accepted")

    try:
        client.completions.create(model=model, prompt="x", max_tokens=8, temperature=-1)
        check(False, "negative temperature is rejected")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and "temperature" in str(e), "BadRequestError names temperature")
    try:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=8)
        check(False, "unknown model is rejected")
    except openai.NotFoundError as e:
        check(e.status_code == 404, "NotFoundError for an unknown model")


def chat(client, model):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}],
        max_completion_tokens=12, temperature=0)
    check(r.object == "chat.completion", "chat completion object")
    check(r.choices[0].message.role == "assistant", "assistant message")
    check(bool(r.choices[0].message.content), "assistant content")

    text = ""
    roles = []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=12, temperature=0, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            text += c.delta.content or ""
    check(roles == ["assistant"], "stream opens with the assistant role")
    check(text == r.choices[0].message.content, "chat stream equals the non-streamed reply")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--expected-file")
    ap.add_argument("--chat-base-url")
    ap.add_argument("--chat-model")
    args = ap.parse_args()

    expected = None
    if args.expected_file:
        with open(args.expected_file, encoding="utf-8") as f:
            expected = f.read()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    completions(client, args.model, expected)

    bad = openai.OpenAI(base_url=args.base_url, api_key="wrong-key", max_retries=0)
    try:
        bad.models.list()
        if args.api_key != "none":
            check(False, "a wrong API key is rejected")
    except openai.AuthenticationError as e:
        check(e.status_code == 401, "AuthenticationError for a wrong key")

    if args.chat_base_url:
        chat(openai.OpenAI(base_url=args.chat_base_url, api_key=args.api_key, max_retries=0),
             args.chat_model)
    print("all openai client checks passed")


if __name__ == "__main__":
    main()
