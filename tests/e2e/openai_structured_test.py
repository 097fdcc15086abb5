#!/usr/bin/env python3
"""Structured outputs and forced tool calls through the official `openai` client (issue 44).

Run by tests/e2e/agents_test.cc against a daemon serving SmolLM2 (chat) or
Gemma 3 270M (a base model: completions only); exits non-zero on the first
failed check. Every constrained reply is validated against its schema with
`jsonschema`; the same request without the constraint is printed beside it,
to show what the model does alone. By hand:

  python3 tests/e2e/openai_structured_test.py --base-url http://127.0.0.1:8000/v1 \
      --model smollm2 [--completions-only]
"""
import argparse
import concurrent.futures
import json
import re
import sys

import jsonschema
import openai


def check(cond, what):
    if not cond:
        print(f"FAIL: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what}")


def refused(call, param, says=""):
    """The call fails with a 400 whose error names `param` (and says `says`)."""
    try:
        call()
    except openai.BadRequestError as e:
        body = e.body if isinstance(e.body, dict) else {}
        print(f"  refusal: {body.get('message')}")
        return body.get("param") == param and says in body.get("message", "")
    return False


def valid(instance_text, schema):
    """Parses and validates; returns (ok, parsed or error)."""
    try:
        value = json.loads(instance_text)
    except json.JSONDecodeError as e:
        return False, f"not JSON: {e}"
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        return False, f"invalid: {e.message}"
    return True, value


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,16}@[a-z]{1,16}\\.com$"},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]},
                      "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "languages", "address", "member"],
    "additionalProperties": False,
}
MOVIE = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "integer", "minimum": 0, "maximum": 10},
        "genre": {"enum": ["drama", "comedy", "action", "horror"]},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["title", "year", "genre"],
}
SCHEMAS = [("person", PERSON, "Invent a person and describe them."),
           ("movie", MOVIE, "Describe a famous movie.")]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 40},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Adds two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


def chat_schemas(client, model):
    for name, schema, ask in SCHEMAS:
        msgs = [{"role": "user", "content": ask + " Answer in JSON."}]
        free = client.chat.completions.create(model=model, messages=msgs, temperature=0,
                                              max_tokens=160)
        ok_free, why = valid(free.choices[0].message.content or "", schema)
        print(f"  unconstrained {name}: valid={ok_free} {json.dumps(free.choices[0].message.content)[:200]}")
        for strict in (True, False):
            r = client.chat.completions.create(
                model=model, messages=msgs, temperature=0, max_tokens=300,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema, "strict": strict}})
            text = r.choices[0].message.content
            print(f"  constrained {name} strict={strict}: {text}")
            ok, value = valid(text, schema)
            check(ok, f"json_schema {name} (strict {strict}): the reply validates ({value if not ok else 'ok'})")
            check(r.choices[0].finish_reason == "stop", f"json_schema {name}: finishes at the grammar's end")
        # Sampled, several seeds: still valid.
        for seed in (1, 2, 3):
            r = client.chat.completions.create(
                model=model, messages=msgs, temperature=1.0, seed=seed, max_tokens=300,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema, "strict": True}})
            print(f"  sampled {name} seed {seed} ({r.choices[0].finish_reason}): {r.choices[0].message.content}")
            ok, value = valid(r.choices[0].message.content, schema)
            check(ok, f"json_schema {name} sampled seed {seed}: validates ({value if not ok else 'ok'})")
        # Streamed: the deltas assemble to a valid document.
        text = ""
        for chunk in client.chat.completions.create(
                model=model, messages=msgs, temperature=0, max_tokens=300, stream=True,
                response_format={"type": "json_schema",
                                 "json_schema": {"name": name, "schema": schema, "strict": True}}):
            for ch in chunk.choices:
                text += ch.delta.content or ""
        check(valid(text, schema)[0], f"json_schema {name} streamed: validates")

    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Give me three colours."}],
        temperature=0, max_tokens=200, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    print("  json_object:", text)
    check(isinstance(json.loads(text), dict), "json_object: the reply is a JSON object")

    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Is the sky blue?"}], temperature=0,
        max_tokens=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    check(r.choices[0].message.content in ("yes", "no"), "structured_outputs choice on chat")


def tool_choice(client, model):
    msgs = [{"role": "user", "content": "What is the weather like in Paris?"}]
    loose = {"type": "function", "function": dict(WEATHER["function"], strict=False)}
    free = client.chat.completions.create(model=model, messages=msgs, tools=[loose, ADD],
                                          tool_choice="auto", temperature=0, max_tokens=80)
    print("  tool_choice auto (model alone):", free.choices[0].message.model_dump_json())
    for choice in ("required", {"type": "function", "function": {"name": "add"}},
                   {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER, ADD],
                                           tool_choice=choice, temperature=0, max_tokens=120)
        msg = r.choices[0].message
        print(f"  tool_choice {json.dumps(choice)}:", msg.model_dump_json())
        check(msg.tool_calls is not None and len(msg.tool_calls) == 1,
              f"tool_choice {json.dumps(choice)}: one tool call")
        call = msg.tool_calls[0]
        if isinstance(choice, dict):
            check(call.function.name == choice["function"]["name"], "the named function is called")
        check(call.function.name in TOOL_SCHEMAS, "the call names a given tool")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, TOOL_SCHEMAS[call.function.name])
        check(True, f"the arguments validate against {call.function.name}'s parameters")
        check(r.choices[0].finish_reason == "tool_calls", "finish_reason tool_calls")

        # Streamed: the same call from the deltas.
        calls = {}
        finish = None
        for chunk in client.chat.completions.create(model=model, messages=msgs,
                                                    tools=[WEATHER, ADD], tool_choice=choice,
                                                    temperature=0, max_tokens=120, stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for tc in ch.delta.tool_calls or []:
                    slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function is not None:
                        slot["name"] += tc.function.name or ""
                        slot["arguments"] += tc.function.arguments or ""
        check(len(calls) == 1 and calls[0]["name"] == call.function.name and
              json.loads(calls[0]["arguments"]) == args,
              f"tool_choice {json.dumps(choice)} streamed: the same call")
        check(finish == "tool_calls", "streamed finish_reason tool_calls")
    # strict tools under auto: free text, but a call the model opens is
    # grammar-constrained.
    history = [
        {"role": "user", "content": "What is the weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 24}"},
        {"role": "assistant", "content": "It is 24 C in Rome."},
        {"role": "user", "content": "And the weather in Oslo?"},
    ]
    r = client.chat.completions.create(model=model, messages=history, tools=[WEATHER, ADD],
                                       tool_choice="auto", temperature=0, max_tokens=120)
    msg = r.choices[0].message
    print("  tool_choice auto, strict get_weather:", msg.model_dump_json())
    # The model may answer in text (this one often does); whatever calls it
    # makes must validate.
    for call in msg.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), TOOL_SCHEMAS[call.function.name])
    check(True, "auto with strict tools: every call's arguments validate")
    check(refused(lambda: client.chat.completions.create(
        model=model, messages=msgs, tools=[WEATHER], response_format={"type": "json_object"},
        max_tokens=4), "tools", "strict"), "strict tools with response_format are refused by name")


def completions(client, model):
    prompt = "Here is a JSON record of a famous movie:\n"
    free = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=80)
    print("  unconstrained completion:", json.dumps(free.choices[0].text)[:200])
    r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=300,
                                  extra_body={"structured_outputs": {"json": MOVIE}})
    print("  constrained completion:", r.choices[0].text)
    ok, value = valid(r.choices[0].text, MOVIE)
    check(ok, f"completions structured_outputs json: validates ({value if not ok else 'ok'})")
    r = client.completions.create(model=model, prompt="The date today is ", temperature=0,
                                  max_tokens=20,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    check(re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text) is not None,
          f"completions structured_outputs regex: {r.choices[0].text!r} matches")
    r = client.completions.create(
        model=model, prompt="Answer: ", temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"grammar": 'root ::= ("yes" | "no") ", because " [a-z]+'}})
    check(re.fullmatch(r"(yes|no), because [a-z]+", r.choices[0].text) is not None,
          f"completions structured_outputs grammar: {r.choices[0].text!r} matches")
    # Bad schemas and grammars: 400 naming the field and the problem.
    check(refused(lambda: client.completions.create(
        model=model, prompt="x", max_tokens=4,
        extra_body={"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}),
        "structured_outputs"), "a bad schema is refused by name")
    check(refused(lambda: client.completions.create(
        model=model, prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "(unclosed"}}),
        "structured_outputs", "regex"), "a bad regex is refused by name")
    check(refused(lambda: client.completions.create(
        model=model, prompt="x", max_tokens=4,
        extra_body={"structured_outputs": {"grammar": "root ::= missing_rule"}}),
        "structured_outputs", "grammar"), "a bad grammar is refused by name")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--base-url", required=True)
    p.add_argument("--api-key", default="sk-none")
    p.add_argument("--model", required=True)
    p.add_argument("--completions-only", action="store_true")
    a = p.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=300)
    # The three groups are independent: sent at once, the daemon decodes them
    # in one batch (a third of the serial run's time on 2 cores). A failed
    # check's SystemExit comes back through result().
    groups = [completions] + ([] if a.completions_only else [chat_schemas, tool_choice])
    with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
        for f in [pool.submit(g, client, a.model) for g in groups]:
            f.result()
    if not a.completions_only:
        msgs = [{"role": "user", "content": "hi"}]
        check(refused(lambda: client.chat.completions.create(
            model=a.model, messages=msgs, max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}),
            "response_format"), "a bad response_format schema is refused by name")
    print("all checks passed")


if __name__ == "__main__":
    main()
