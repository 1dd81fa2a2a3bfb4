#!/usr/bin/env python3
"""deepseek_recipe through Python on the 88K-token agent session, against transformers' apply_chat_template.

Times, in one process and one thread: Conversation.from_openai on the request dict, render_for_engine (C++
render + tokenize, ids left in C++), the same plus .token_ids (a Python list, what apply_chat_template returns)
and the whole request -> list path; then, if transformers is importable, AutoTokenizer.from_pretrained on the
same tokenizer directory and apply_chat_template(tokenize=False) / (tokenize=True) on the same request. Prints
one JSON line per measurement (median, min, max over --reps, and the first, cold, repetition) and whether the
two id lists are equal (the first difference if not). A benchmark, never a test: it always exits 0 once it ran.

Usage: bench_recipe_module.py TOKENIZER_DIR [--conversation FILE] [--format NAME] [--reps N]
  TOKENIZER_DIR  a directory with tokenizer.json and tokenizer_config.json (e.g. models/deepseek-v3; its
                 chat template is the official DeepSeek-V3 one, which transformers renders with Jinja)
  --format       our prompt format (default: the one the directory identifies, else deepseek-v3)
Needs deepseek_recipe importable (pip install ., or PYTHONPATH=build/python-site after make python-test).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the peer on one thread too, like ours
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("RAYON_RS_NUM_CPUS", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, reps):
    samples, result = [], None
    for _ in range(reps):
        start = time.perf_counter()
        result = fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "first_ms": samples[0]}, result


def emit(line):
    print(json.dumps(line, ensure_ascii=False), flush=True)


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def peer_ids(output):
    """apply_chat_template(tokenize=True) returns a list (transformers 4) or a BatchEncoding / dict (5)."""
    if isinstance(output, dict) or hasattr(output, "keys"):
        output = output["input_ids"]
    if hasattr(output, "tolist"):
        output = output.tolist()
    if output and isinstance(output[0], list):
        output = output[0]
    return list(output)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokenizer_dir")
    parser.add_argument("--conversation", default=os.path.join(ROOT, "tests", "data", "conversations",
                                                               "agent-session.json"))
    parser.add_argument("--format", default=None)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    try:
        import deepseek_recipe as ds
    except ImportError as error:
        sys.exit("bench_recipe_module: deepseek_recipe is not importable (%s): pip install . first, or set "
                 "PYTHONPATH=build/python-site after make python-test" % error)

    with open(args.conversation, encoding="utf-8") as f:
        request_text = f.read()
    request = json.loads(request_text)
    fmt = args.format or ds.detect_format(args.tokenizer_dir) or "deepseek-v3"
    common = {"python": platform.python_version(), "machine": platform.machine(),
              "messages": len(request["messages"]), "tools": len(request.get("tools", [])), "reps": args.reps}

    # Ours. The tokenizer loads once (cached per file), as in a long-running gateway.
    start = time.perf_counter()
    ds.Tokenizer(args.tokenizer_dir)
    load_ms = (time.perf_counter() - start) * 1e3
    conversation = ds.Conversation.from_openai(request)
    parse, _ = timed(lambda: ds.Conversation.from_openai(request), args.reps)
    parse_text, _ = timed(lambda: ds.Conversation.from_openai(request_text), args.reps)
    render, rendered = timed(lambda: conversation.render_for_engine(args.tokenizer_dir, format=fmt), args.reps)
    render_list, ours = timed(lambda: conversation.render_for_engine(args.tokenizer_dir, format=fmt).token_ids,
                              args.reps)
    render_array, _ = timed(lambda: conversation.render_for_engine(args.tokenizer_dir, format=fmt).token_array,
                            args.reps)
    end_to_end, _ = timed(lambda: ds.Conversation.from_openai(request).render_for_engine(
        args.tokenizer_dir, format=fmt).token_ids, args.reps)
    emit(dict(common, bench="python_agent_session", impl="deepseek_recipe", version=ds.__version__, format=fmt,
              tokens=len(ours), chars=len(rendered.text), tokenizer_load_ms=load_ms,
              from_openai_dict_ms=parse["median_ms"], from_openai_json_text_ms=parse_text["median_ms"],
              render_for_engine_ms=render["median_ms"], render_plus_token_ids_list_ms=render_list["median_ms"],
              render_plus_token_array_ms=render_array["median_ms"],
              request_to_id_list_ms=end_to_end["median_ms"], request_to_id_list_min_ms=end_to_end["min_ms"],
              request_to_id_list_max_ms=end_to_end["max_ms"], request_to_id_list_first_ms=end_to_end["first_ms"]))

    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError:
        emit(dict(common, bench="python_agent_session", impl="transformers", skipped="transformers not importable"))
        return
    start = time.perf_counter()
    peer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    peer_load_ms = (time.perf_counter() - start) * 1e3
    messages, tools = request["messages"], request.get("tools")
    render_text, text = timed(lambda: peer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                               add_generation_prompt=True), args.reps)
    full, output = timed(lambda: peer.apply_chat_template(messages, tools=tools, tokenize=True,
                                                          add_generation_prompt=True), args.reps)
    ids = peer_ids(output)
    difference = first_difference(ids, ours)
    emit(dict(common, bench="python_agent_session", impl="transformers", version=transformers.__version__,
              tokenizer_class=type(peer).__name__, tokens=len(ids), chars=len(text),
              tokenizer_load_ms=peer_load_ms, apply_chat_template_text_ms=render_text["median_ms"],
              apply_chat_template_tokenize_true_ms=full["median_ms"],
              apply_chat_template_tokenize_true_min_ms=full["min_ms"],
              apply_chat_template_tokenize_true_max_ms=full["max_ms"],
              apply_chat_template_tokenize_true_first_ms=full["first_ms"],
              text_equal=text == rendered.text, ids_equal=difference is None, first_id_difference=difference,
              speedup_request_to_id_list=full["median_ms"] / end_to_end["median_ms"]))


if __name__ == "__main__":
    main()
