#!/usr/bin/env python3
"""Adds golden cases rendered by DeepSeek's official Jinja chat templates, the way Hugging Face
`apply_chat_template` renders them (sandboxed Jinja2, trim_blocks, lstrip_blocks, loopcontrols, tojson without
ASCII escaping, bos/eos tokens set), to tests/data/chat-templates/goldens/<format>.json.

Test data only: the product never runs Jinja. Usage (from the repo root, with ../shared present):
    python3 tools/render_template_goldens.py
It (re)writes the cases named in CASES below, keeping every other case as it is.
"""
import json
import pathlib

import jinja2
import jinja2.sandbox

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared" / "data"
GOLDENS = ROOT / "tests" / "data" / "chat-templates" / "goldens"
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
EOS = "<\uff5cend\u2581of\u2581sentence\uff5c>"

TEMPLATES = {
    "deepseek-v3": lambda: json.loads((SHARED / "tokenizers" / "deepseek-v3" / "tokenizer_config.json").read_text())[
        "chat_template"],
    "deepseek-r1": lambda: (SHARED / "chat-templates" / "llamacpp-deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text(),
}

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18C, cloudy"}

# Issue 16: an assistant message whose content is "" (not null) next to tool_calls and/or reasoning_content.
CASES = {
    "empty_content_with_tool_calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        TOOL_RESULT,
    ],
    "null_content_with_tool_calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        TOOL_RESULT,
    ],
    "empty_content_with_reasoning": [
        {"role": "user", "content": "Is 91 prime?"},
        {"role": "assistant", "content": "", "reasoning_content": "Check small factors: 7*13=91."},
        {"role": "user", "content": "And 97?"},
    ],
    "empty_content_with_tool_calls_and_reasoning": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should call the tool.", "tool_calls": [CALL]},
        TOOL_RESULT,
        {"role": "assistant", "content": "It is 18C and cloudy."},
        {"role": "user", "content": "Thanks!"},
    ],
}


def render(template_text, messages):
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, **kw: json.dumps(value, ensure_ascii=False, **kw)
    return env.from_string(template_text).render(messages=messages, add_generation_prompt=True, bos_token=BOS,
                                                 eos_token=EOS)


def main():
    for fmt, template in TEMPLATES.items():
        path = GOLDENS / f"{fmt}.json"
        golden = json.loads(path.read_text())
        kept = [c for c in golden["cases"] if c["case"] not in CASES]
        text = template()
        for name, messages in CASES.items():
            kept.append({"case": name, "options": {}, "request": {"messages": messages}, "prompt": render(text, messages)})
        golden["cases"] = kept
        path.write_text(json.dumps(golden, ensure_ascii=False, indent=1))
        print(f"{path.relative_to(ROOT)}: {len(kept)} cases")


if __name__ == "__main__":
    main()
