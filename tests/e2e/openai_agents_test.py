#!/usr/bin/env python3
"""What agent clients send, through the official `openai` client, unchanged (issue 44).

Run by tests/e2e/agents_test.cc against a daemon serving SmolLM2 with the
semantic cache's sentence encoder; exits non-zero on the first failed check.
By hand:

  python3 tests/e2e/openai_agents_test.py --base-url http://127.0.0.1:8000/v1 \
      --model smollm2 --embedding-model all-MiniLM-L6-v2
"""
import argparse
import base64
import json
import math
import struct
import sys

import urllib.error
import urllib.request

import openai


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def post(url, api_key, body):
    """POSTs JSON with urllib; returns (status, parsed body)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {api_key}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refused(call, param, status=400):
    """The call fails with `status` and an error naming `param`."""
    try:
        call()
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        named = body.get("param") == param and param in body.get("message", "")
        return e.status_code == status and named
    return False


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def history_call(call_id, name, city):
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": name,
                                         "arguments": json.dumps({"city": city})}}]}


# Two earlier turns in which the assistant called a tool: a 135M model
# follows the pattern of its own history, so the next turn calls one too.
AGENT_MESSAGES = [
    {"role": "developer", "content": "You are a weather assistant. Use the tools."},
    {"role": "user", "content": "What is the weather in Paris?"},
    history_call("call_a1", "get_weather", "Paris"),
    {"role": "tool", "tool_call_id": "call_a1", "content": "{\"temp_c\": 18}"},
    {"role": "assistant", "content": "It is 18 C in Paris."},
    {"role": "user", "content": "What is the weather in Rome?"},
    history_call("call_a2", "get_weather", "Rome"),
    {"role": "tool", "tool_call_id": "call_a2", "content": "{\"temp_c\": 24}"},
    {"role": "assistant", "content": "It is 24 C in Rome."},
    {"role": "user", "content": "What is the weather in London?"},
]


def tools(client, model, base_url, api_key):
    names = {"get_weather", "get_time"}
    r = client.chat.completions.create(model=model, messages=AGENT_MESSAGES,
                                       tools=[WEATHER, TIME], tool_choice="auto",
                                       temperature=0, max_tokens=64)
    msg = r.choices[0].message
    print("model reply:", msg.model_dump_json())
    # What the model wrote, raw: the same prompt (vLLM's /tokenize renders it
    # as the chat does) continued greedily through /v1/completions.
    root = base_url.rsplit("/v1", 1)[0]
    _, tok = post(f"{root}/tokenize", api_key,
                  {"model": model, "messages": AGENT_MESSAGES, "tools": [WEATHER, TIME]})
    check(tok["count"] == r.usage.prompt_tokens, "tokenize renders the tools as the chat does")
    raw = client.completions.create(model=model, prompt=tok["tokens"], temperature=0,
                                    max_tokens=64).choices[0].text
    print("raw text:", json.dumps(raw))
    check("<tool_call>" in raw, "the model writes a <tool_call> block (Hermes) given its history")
    check(msg.tool_calls is not None and len(msg.tool_calls) >= 1,
          "the model's <tool_call> output is parsed into tool_calls")
    for c in msg.tool_calls:
        check(c.type == "function" and c.function.name in names, "the call names a given tool")
        args = json.loads(c.function.arguments)
        check(isinstance(args, dict), "the call's arguments are a JSON object")
        check(c.id.startswith("call_"), "the call has an id")
    check(r.choices[0].finish_reason == "tool_calls", "finish_reason tool_calls")

    # Streamed: the deltas assemble to the same calls (greedy, same prompt).
    calls = {}
    content = ""
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=AGENT_MESSAGES,
                                                tools=[WEATHER, TIME], temperature=0,
                                                max_tokens=64, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
    streamed = [calls[i] for i in sorted(calls)]
    check([(c["name"], json.loads(c["arguments"])) for c in streamed] ==
          [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls],
          "streamed tool_call deltas assemble to the non-streamed calls")
    check(finish == "tool_calls", "the stream ends with finish_reason tool_calls")
    check(content.strip() == (msg.content or "").strip(), "streamed content matches")

    # The reply goes back in as the client replays it, with the tool's result.
    follow = AGENT_MESSAGES + [msg.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "{\"temp_c\": 12}"}
        for c in msg.tool_calls]
    r2 = client.chat.completions.create(model=model, messages=follow, tools=[WEATHER, TIME],
                                        temperature=0, max_tokens=24)
    check(r2.choices[0].message.content is not None or r2.choices[0].message.tool_calls,
          "a conversation with the replayed call and a tool result is answered")

    # tool_choice none: the tools are not shown and nothing is parsed.
    r3 = client.chat.completions.create(model=model, messages=AGENT_MESSAGES[:2],
                                        tools=[WEATHER], tool_choice="none", temperature=0,
                                        max_tokens=16)
    check(r3.choices[0].message.tool_calls is None and r3.choices[0].finish_reason != "tool_calls",
          "tool_choice none answers in content")
    # tool_choice required and named are grammar-enforced: see
    # openai_structured_test.py. Naming a function not among the tools is
    # refused by name.
    check(refused(lambda: client.chat.completions.create(
        model=model, messages=AGENT_MESSAGES[:2], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=4),
        "tool_choice"), "a tool_choice naming a function not among tools is refused by name")


def refusals(client, model):
    msgs = [{"role": "user", "content": "hi"}]
    check(refused(lambda: client.chat.completions.create(
        model=model, messages=msgs, response_format={"type": "json_xml"}, max_tokens=4),
        "response_format"), "an unknown response_format type is refused by name")
    check(refused(lambda: client.chat.completions.create(
        model=model, messages=msgs, logit_bias={"42": 5}, max_tokens=4), "logit_bias"),
        "logit_bias is refused by name")
    check(refused(lambda: client.completions.create(
        model=model, prompt="hi", logit_bias={"42": 5}, max_tokens=4), "logit_bias"),
        "logit_bias is refused by name on completions")
    check(refused(lambda: client.chat.completions.create(
        model=model, messages=msgs, max_tokens=4, extra_body={"guided_jsonx": {"type": "object"}}),
        "guided_jsonx"), "an unknown field is refused by name")
    check(refused(lambda: client.chat.completions.create(
        model=model, messages=msgs, max_tokens=4, extra_body={"guided_json": {"type": "object"}}),
        "guided_json"), "vLLM's older guided_json is refused by name")
    check(refused(lambda: client.completions.create(
        model=model, prompt="hi", max_tokens=4, suffix="end"), "suffix"),
        "suffix is refused by name")
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=4,
                                       response_format={"type": "text"})
    check(r.choices[0].message.content is not None, "response_format text is honoured (plain text)")


def embeddings(client, emb_model, model, base_url, api_key):
    texts = ["The cat sits on the mat.", "A cat is sitting on a rug.",
             "Quarterly revenue rose by four percent."]
    r = client.embeddings.create(model=emb_model, input=texts)  # the client asks for base64
    check(len(r.data) == 3 and [d.index for d in r.data] == [0, 1, 2], "one embedding per input")
    vecs = [d.embedding for d in r.data]
    check(all(len(v) == 384 for v in vecs), "384 dimensions (all-MiniLM-L6-v2)")
    check(all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vecs), "unit vectors")
    dot = lambda a, b: sum(x * y for x, y in zip(a, b))
    check(dot(vecs[0], vecs[1]) > dot(vecs[0], vecs[2]) + 0.2,
          "a paraphrase is nearer than an unrelated sentence")
    check(r.usage.prompt_tokens > 3 * 2 and r.usage.total_tokens == r.usage.prompt_tokens,
          "usage counts the tokens")
    f = client.embeddings.create(model=emb_model, input=texts[0], encoding_format="float")
    check(f.data[0].embedding == vecs[0], "float and base64 carry the same values")
    _, raw = post(f"{base_url}/embeddings", api_key,
                  {"model": emb_model, "input": texts[0], "encoding_format": "base64"})
    decoded = list(struct.unpack("<384f", base64.b64decode(raw["data"][0]["embedding"])))
    check(decoded == vecs[0], "base64 is little-endian float32")
    check(refused(lambda: client.embeddings.create(model=emb_model, input="word " * 400),
                  "input"), "an input over the token limit is refused, naming input")
    try:
        client.embeddings.create(model=emb_model, input="word " * 400)
    except openai.BadRequestError as e:
        check("256" in str(e), "the refusal states the limit")
    check(refused(lambda: client.embeddings.create(model=model, input="x"), "model", 404),
          "another model's name is a 404 naming model")
    check(refused(lambda: client.embeddings.create(model=emb_model, input="x", dimensions=64),
                  "dimensions"), "dimensions is refused by name")
    check(refused(lambda: client.embeddings.create(model=emb_model, input="x", user="u"),
                  "user"), "user is refused by name")


def tokenize(base_url, api_key, model):
    root = base_url.rsplit("/v1", 1)[0]
    text = "Hello, tokenizer! 123"
    _, t = post(f"{root}/tokenize", api_key,
                {"model": model, "prompt": text, "add_special_tokens": False})
    check(t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] > 0, "tokenize: vLLM's shape")
    _, d = post(f"{root}/detokenize", api_key, {"model": model, "tokens": t["tokens"]})
    check(d["prompt"] == text, "detokenize inverts tokenize")
    msgs = [{"role": "user", "content": "Hi there"}]
    _, tm = post(f"{root}/tokenize", api_key, {"model": model, "messages": msgs})
    r = openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
        model=model, messages=msgs, max_tokens=1)
    check(tm["count"] == r.usage.prompt_tokens, "tokenize messages counts the chat's prompt")
    status, bad = post(f"{root}/tokenize", api_key, {"prompt": "x", "bogus": 1})
    check(status == 400 and bad["error"]["param"] == "bogus",
          "tokenize refuses an unknown field by name")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", default="sk-none")
    p.add_argument("--model", required=True)
    p.add_argument("--embedding-model", required=True)
    a = p.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=300)
    refusals(client, a.model)
    embeddings(client, a.embedding_model, a.model, a.base_url, a.api_key)
    tokenize(a.base_url, a.api_key, a.model)
    tools(client, a.model, a.base_url, a.api_key)
    print("all checks passed")


if __name__ == "__main__":
    main()
