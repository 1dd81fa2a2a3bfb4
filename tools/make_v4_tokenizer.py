#!/usr/bin/env python3
"""DeepSeek-V3's tokenizer with the added tokens of DeepSeek-V4 / V4.1 at their ids: a V4-shaped tokenizer.

    python3 tools/make_v4_tokenizer.py --src models/deepseek-v3 --out DIR

writes DIR/tokenizer.json and DIR/tokenizer_config.json. --src is a tokenizer.json or a directory holding one
(and maybe a tokenizer_config.json). The four tokens below replace whatever the source has at their ids (in
DeepSeek-V3 these ids are unused placeholder slots of the 129,280-row embedding) and are appended when absent.
Everything else is copied unchanged, so the output differs from the source only by these entries: a fixture for
the renderer and parser tests (CMake runs it into the build directory), and the demo model's tokenizer.

Flags: `<think>`, `</think>` and `｜DSML｜` are added tokens that are not special (structural markers the model
writes and the parser reads, like `<｜User｜>` in V3); `<｜latest_reminder｜>` is special. Deterministic: the
same source gives the same bytes (stdlib json, keys in their source order, no timestamps).
"""
import argparse
import json
import os
import sys

# id -> (content, special), from DeepSeek-V4's tokenizer (issue 16).
V4_ADDED_TOKENS = {
    128821: ("<think>", False),
    128822: ("</think>", False),
    128825: ("\uff5cDSML\uff5c", False),
    128828: ("<\uff5clatest_reminder\uff5c>", True),
}


def added_token(token_id, content, special):
    # The flags DeepSeek-V3's own added tokens carry: special ones are matched on the raw text, the others
    # "normalized" (the tokenizer has no normalizer, so both match the same text).
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": not special, "special": special}


def with_v4_tokens(tokenizer):
    added = [entry for entry in tokenizer.get("added_tokens") or [] if entry["id"] not in V4_ADDED_TOKENS]
    contents = {entry["content"]: entry["id"] for entry in added}
    for token_id, (content, special) in V4_ADDED_TOKENS.items():
        if content in contents:
            raise SystemExit("make_v4_tokenizer: the source already has %r at id %d" % (content, contents[content]))
        added.append(added_token(token_id, content, special))
    added.sort(key=lambda entry: entry["id"])
    tokenizer["added_tokens"] = added
    return tokenizer


def config_for(source_config):
    # Keep the source's settings (BOS/EOS, model_max_length, tokenizer class); drop its chat template, which
    # is V3's: DeepSeek-V4 ships no Jinja template (its prompt format is named by --chat-format).
    config = {key: value for key, value in (source_config or {}).items() if key != "chat_template"}
    config["added_tokens_decoder"] = {
        str(token_id): {key: value for key, value in added_token(token_id, content, special).items() if key != "id"}
        for token_id, (content, special) in V4_ADDED_TOKENS.items()}
    return config


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="tokenizer.json, or a directory holding one")
    parser.add_argument("--out", required=True, help="directory to write tokenizer.json and tokenizer_config.json")
    args = parser.parse_args()
    source = os.path.join(args.src, "tokenizer.json") if os.path.isdir(args.src) else args.src
    with open(source, encoding="utf-8") as f:
        tokenizer = json.load(f)
    source_config_path = os.path.join(os.path.dirname(source), "tokenizer_config.json")
    source_config = None
    if os.path.exists(source_config_path):
        with open(source_config_path, encoding="utf-8") as f:
            source_config = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    # Written to a temporary name and renamed, so a build that is interrupted never leaves half a file.
    outputs = (("tokenizer.json", with_v4_tokens(tokenizer)), ("tokenizer_config.json", config_for(source_config)))
    for name, value in outputs:
        path = os.path.join(args.out, name)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(value, f, ensure_ascii=False, indent=None if name == "tokenizer.json" else 2)
            f.write("\n")
        os.replace(path + ".tmp", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
