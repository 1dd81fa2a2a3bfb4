"""Shared fixtures of the deepseek_recipe tests. tests/python/run.sh installs the module (pip install .) and
runs these with it on PYTHONPATH; they need no network, no model and no GPU."""
import json
import os
import subprocess
import sys

import pytest

import deepseek_recipe as ds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN_DIR = os.path.join(ROOT, "tests", "data", "chat-templates", "goldens")
TOKENIZER_DIR = os.path.join(ROOT, "models", "deepseek-v3")  # fetched by `make setup`
EOS = "<｜end▁of▁sentence｜>"


def pytest_configure(config):
    # Said once per process; test_models checks it.
    config.addinivalue_line("filterwarnings", "ignore:deepseek_recipe.*shipped DeepSeek-V3 tokenizer:UserWarning")


def golden_cases():
    """(format, case) for every golden case the reference could render."""
    cases = []
    for fmt in ds.FORMATS:
        with open(os.path.join(GOLDEN_DIR, fmt + ".json"), encoding="utf-8") as f:
            for case in json.load(f)["cases"]:
                if "prompt" in case:
                    cases.append((fmt, case))
    return cases


def case_id(fmt, case):
    return "%s-%s-%s" % (fmt, case["case"], json.dumps(case["options"], sort_keys=True))


def apply_options(conversation, options):
    """The goldens' options: V3.1 `thinking`, the encoders' `thinking_mode` and `reasoning_effort`."""
    if "thinking" in options:
        conversation.set_reasoning_mode(options["thinking"])
    if "thinking_mode" in options:
        conversation.set_reasoning_mode(options["thinking_mode"] == "thinking")
    if "reasoning_effort" in options:
        conversation.set_reasoning_effort(options["reasoning_effort"])
    if "v4_revision" in options:
        conversation.set_v4_revision(options["v4_revision"])


@pytest.fixture(scope="session")
def tokenizer():
    return ds.Tokenizer("deepseek-ai/DeepSeek-V3")


@pytest.fixture(scope="session")
def v4_tokenizer(tmp_path_factory):
    """A DeepSeek-V4-shaped tokenizer: the DeepSeek-V3 one shipped in the package plus V4's added tokens at their
    ids (<think> 128821, </think> 128822, ｜DSML｜ 128825, <｜latest_reminder｜> 128828), written once per session
    by tools/make_v4_tokenizer.py, as CMake writes the C++ tests' copy."""
    out = tmp_path_factory.mktemp("tokenizer-v4")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_v4_tokenizer.py"),
                    "--src", ds.Tokenizer("deepseek-ai/DeepSeek-V3").path, "--out", str(out)], check=True)
    return ds.Tokenizer.from_file(str(out / "tokenizer.json"))


def read_json(*parts):
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return json.load(f)
