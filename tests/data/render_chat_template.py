#!/usr/bin/env python3
"""Renders one chat template with Python's jinja2, for the model-families e2e test.

Reads a JSON object from stdin: {"template": "...", "messages": [...],
"bos_token": "...", "eos_token": "...", "add_generation_prompt": true} and
writes {"text": "..."} (or {"error": "..."} when the template raises) to
stdout. The environment is make_chat_template_reference.py's (Hugging Face's
apply_chat_template), except that strftime_now reads the current local time,
as the daemon does (tests/e2e/model_families_test.cc).

Needs jinja2 >= 3.1 (Debian's python3-jinja2; deploy/setup.sh installs it).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_chat_template_reference as ref  # noqa: E402


def main():
    req = json.load(sys.stdin)
    env = ref.environment()
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt, time.localtime())
    try:
        text = env.from_string(req["template"]).render(
            messages=req["messages"], add_generation_prompt=req["add_generation_prompt"],
            bos_token=req["bos_token"], eos_token=req["eos_token"])
        json.dump({"text": text}, sys.stdout, ensure_ascii=False)
    except Exception as e:  # noqa: BLE001 - the template's own raise_exception
        json.dump({"error": str(e)}, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
