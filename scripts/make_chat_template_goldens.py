#!/usr/bin/env python3
"""Golden renderings of chat templates by transformers' `apply_chat_template` (Jinja2 with
trim_blocks, lstrip_blocks and transformers' own tojson), for tern's minijinja renderer to equal.

Templates (tests/fixtures/chat-templates/*.jinja): the tiny Qwen3.5 fixtures' own template, and
the templates Qwen publishes for Qwen3.5, Qwen3 and Qwen2.5 (copies of the files in llama.cpp's
models/templates, which come from the models' tokenizer_config.json). Conversations cover a
system message, several turns, assistant reasoning, tools with tool calls and tool responses,
content given as a list of parts, enable_thinking off, and no generation prompt.

    python scripts/make_chat_template_goldens.py        # writes tests/fixtures/chat-templates/goldens.json

Needs the golden environment (../shared/tools/golden-env.sh).
"""
import json
import os

import transformers
from transformers import AutoTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DIR = os.path.join(ROOT, "tests", "fixtures", "chat-templates")
TOKENIZER_DIR = os.path.join(ROOT, "tests", "fixtures", "qwen35", "dense-untied")

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather at a place, \"now\".",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                        "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a seabird."}],
    "multi_turn": [
        {"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "def f(x):\n    return x"},
        {"role": "assistant", "content": "  A function.  "}, {"role": "user", "content": "Ünïcödé 我们 😀"},
    ],
    "reasoning": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nSmall sum.\n</think>\n\n4"},
        {"role": "user", "content": "And 3+3?"},
    ],
    "tools": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": -3}"},
        {"role": "user", "content": "Thanks."},
    ],
    "parts": [{"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Part two."}]}],
}

# (template, conversation, keyword arguments) triples; templates without tool or reasoning
# support get the plain conversations only.
CASES = [
    ("fixture", "single", {}), ("fixture", "multi_turn", {}), ("fixture", "multi_turn", {"add_generation_prompt": False}),
    ("qwen3.5", "single", {}), ("qwen3.5", "system", {}), ("qwen3.5", "multi_turn", {}),
    ("qwen3.5", "multi_turn", {"add_generation_prompt": False}), ("qwen3.5", "reasoning", {}),
    ("qwen3.5", "single", {"enable_thinking": False}), ("qwen3.5", "tools", {"tools": TOOLS}),
    ("qwen3.5", "system", {"tools": TOOLS}), ("qwen3.5", "parts", {}),
    ("qwen3", "single", {}), ("qwen3", "multi_turn", {}), ("qwen3", "reasoning", {}),
    ("qwen3", "single", {"enable_thinking": False}), ("qwen3", "tools", {"tools": TOOLS}),
    ("qwen2.5", "single", {}), ("qwen2.5", "system", {}), ("qwen2.5", "multi_turn", {}),
    ("qwen2.5", "tools", {"tools": TOOLS}),
]


def main():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json")) as f:
        fixture_template = json.load(f)["chat_template"]
    with open(os.path.join(DIR, "fixture.jinja"), "w") as f:
        f.write(fixture_template)
    cases = []
    for name, conv, kwargs in CASES:
        with open(os.path.join(DIR, f"{name}.jinja")) as f:
            source = f.read()
        kw = dict(kwargs)
        gen = kw.pop("add_generation_prompt", True)
        text = tok.apply_chat_template(CONVERSATIONS[conv], chat_template=source, tokenize=False,
                                       add_generation_prompt=gen, **kw)
        cases.append({"template": f"{name}.jinja", "conversation": conv, "messages": CONVERSATIONS[conv],
                      "add_generation_prompt": gen, "variables": kw, "text": text})
    out = {"generator": "scripts/make_chat_template_goldens.py", "transformers": transformers.__version__,
           "templates_from": "llama.cpp models/templates (Qwen3.5-4B, Qwen-Qwen3-0.6B, Qwen-Qwen2.5-7B-Instruct)",
           "cases": cases}
    with open(os.path.join(DIR, "goldens.json"), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"{len(cases)} renderings")


if __name__ == "__main__":
    main()
