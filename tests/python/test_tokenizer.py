"""The tokenizer through Python against the reference ids of tests/data/tokenizer (Hugging Face tokenizers
0.23.2 on DeepSeek-V3's tokenizer.json): trusted ids, untrusted ids, decode."""
import pytest

import deepseek_recipe as ds
from conftest import TOKENIZER_DIR, read_json

CORPUS = read_json("tests", "data", "tokenizer", "corpus.json")
REFERENCE = read_json("tests", "data", "tokenizer", "reference-ids.json")


def test_reference_ids_trusted_untrusted_and_decoded(tokenizer):
    texts = REFERENCE["texts"]
    assert texts == CORPUS and len(texts) == 1516
    mismatches = []
    for i, text in enumerate(texts):
        if tokenizer.encode(text) != REFERENCE["ids"][i]:
            mismatches.append(("ids", i))
        if tokenizer.encode(text, untrusted=True) != REFERENCE["ids_untrusted"][i]:
            mismatches.append(("ids_untrusted", i))
        if tokenizer.decode(REFERENCE["ids"][i]) != REFERENCE["decoded"][i]:
            mismatches.append(("decoded", i))
    assert mismatches == []


def test_one_tokenizer_per_file(tokenizer):
    assert ds.Tokenizer("deepseek-ai/DeepSeek-V4.1-Flash") is not None
    again = ds.Tokenizer("DeepSeek-V3")
    assert again.path == tokenizer.path
    local = ds.Tokenizer(TOKENIZER_DIR)
    assert local.encode("Hello world") == tokenizer.encode("Hello world") == [19923, 2058]
    assert tokenizer.vocab_size > 128000


def test_token_lookups_and_array_input(tokenizer):
    eos = tokenizer.token_to_id("<｜end▁of▁sentence｜>")
    assert eos == 1
    assert tokenizer.id_to_token(eos) == "<｜end▁of▁sentence｜>"
    assert tokenizer.token_to_id("no such piece at all") is None
    ids = tokenizer.encode("你好, world")
    assert tokenizer.decode(ids) == "你好, world"
    assert tokenizer.decode(tuple(ids)) == "你好, world"
    np = pytest.importorskip("numpy")
    assert tokenizer.decode(np.asarray(ids, dtype=np.int32)) == "你好, world"
