#!/usr/bin/env python3
"""Writes the speculative-decoding benchmark workloads (kvserve-bench --workload file).

Four JSONL files of {"prompt", "max_tokens"} in this directory, 16 prompts each:
  code-edit.jsonl  repeat a given code block with one change (drafts: the block itself)
  summarize.jsonl  summarize a provided text (drafts: phrases of the text)
  json.jsonl       answer as JSON from given facts (drafts: keys and values)
  chat.jsonl       plain chat questions (little to copy: the adaptive floor)
Deterministic: rerunning rewrites the same files. See docs/speculation.md.
"""
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))

FUNCS = [
    ("total_price", "items", "price", "quantity"),
    ("average_score", "scores", "value", "weight"),
    ("count_words", "lines", "text", "limit"),
    ("merge_records", "records", "key", "value"),
]


def code_block(i):
    name, coll, a, b = FUNCS[i % len(FUNCS)]
    return (
        f"def {name}({coll}):\n"
        f"    result = 0\n"
        f"    for item in {coll}:\n"
        f"        if item.{a} is None:\n"
        f"            continue\n"
        f"        result += item.{a} * item.{b}\n"
        f"    return result\n"
    )


def code_edit(i):
    name = FUNCS[i % len(FUNCS)][0]
    change = [
        f"rename the function to {name}_v{i}",
        "replace `result = 0` with `result = 1`",
        "add the comment `# done` after the return line",
        "rename the loop variable `item` to `entry`",
    ][i // len(FUNCS) % 4]
    return (
        "Repeat the following Python code exactly, with one change: " + change + ".\n\n"
        "```python\n" + code_block(i) + "```\n"
    )


TEXTS = [
    "The city council met on Tuesday to discuss the new park. The park will have a playground, "
    "a small lake and a running track. The council said the park will open next spring. Many "
    "families in the city asked for the park because the old playground was closed last year.",
    "Solar panels turn sunlight into electricity. The panels are made of silicon cells. When light "
    "hits the cells, electrons move and create a current. Solar power is clean and cheap, but the "
    "panels work less well on cloudy days and at night.",
    "The library will be closed on Monday for repairs. The roof of the library was damaged in the "
    "storm last week. Books can be returned at the post office. The library will open again on "
    "Tuesday at nine in the morning.",
    "Bees are important for farms. Bees carry pollen from one flower to another, and this helps "
    "plants make fruit and seeds. Without bees, many fruits such as apples and cherries would be "
    "hard to grow. Farmers keep bees near their fields.",
]


def summarize(i):
    t = TEXTS[i % len(TEXTS)]
    style = ["in two sentences", "in one sentence", "as three bullet points", "briefly"][i // 4 % 4]
    return "Summarize the following text " + style + ".\n\nText: " + t + "\n"


PEOPLE = [
    ("Alice Smith", 34, "Boston", "engineer"),
    ("Bob Jones", 51, "Denver", "teacher"),
    ("Carol White", 27, "Seattle", "nurse"),
    ("David Brown", 45, "Austin", "chef"),
]


def json_answer(i):
    n, a, c, j = PEOPLE[i % len(PEOPLE)]
    extra = ["", " Add a field \"active\": true.", " Use the key \"job\" for the occupation.",
             " Put the fields in alphabetical order."][i // 4 % 4]
    return (
        f"Write a JSON object with the fields name, age, city and occupation for this person: "
        f"{n} is {a} years old, lives in {c} and works as a {j}.{extra} Answer with JSON only.\n"
    )


CHAT = [
    "What are three tips for staying healthy?",
    "Why is the sky blue?",
    "Tell me a short story about a cat who learns to swim.",
    "How do I make a cup of tea?",
    "What is the capital of France and what is it famous for?",
    "Give me some ideas for a birthday party.",
    "Explain what a computer does in simple words.",
    "What should I pack for a trip to the beach?",
    "How can I learn to play the guitar?",
    "Describe your favourite season and why.",
    "What is the difference between a frog and a toad?",
    "How do plants grow?",
    "Write a short poem about the sea.",
    "What are good habits for studying?",
    "Why do we need sleep?",
    "How does a rainbow form?",
]


def main():
    sets = {
        "code-edit": [code_edit(i) for i in range(16)],
        "summarize": [summarize(i) for i in range(16)],
        "json": [json_answer(i) for i in range(16)],
        "chat": CHAT,
    }
    for name, prompts in sets.items():
        with open(os.path.join(HERE, name + ".jsonl"), "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": p, "max_tokens": 64}) + "\n")


if __name__ == "__main__":
    main()
