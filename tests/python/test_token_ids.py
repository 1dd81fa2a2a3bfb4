"""Token ids handed to Python: `token_ids` a list (JSON-ready), `token_array` zero-copy over the C++ vector,
a NumPy int32 array when NumPy imports and a memoryview when it does not."""
import gc
import json
import sys

import pytest

import deepseek_recipe as ds


@pytest.fixture(scope="module")
def rendered():
    conversation = ds.Conversation()
    conversation.add_user_message("Hello! 你好 🌸 " * 50)
    return conversation.render_for_engine("deepseek-ai/DeepSeek-V3")


def test_token_ids_is_a_cached_json_ready_list(rendered):
    ids = rendered.token_ids
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert rendered.token_ids is ids  # built once
    assert json.loads(json.dumps({"tokens": ids})) == {"tokens": ids}
    assert len(rendered) == len(ids) > 100


def test_token_array_is_a_read_only_numpy_view(rendered):
    np = pytest.importorskip("numpy")
    array = rendered.token_array
    assert isinstance(array, np.ndarray) and array.dtype == np.int32 and array.shape == (len(rendered),)
    assert array.tolist() == rendered.token_ids
    assert not array.flags.writeable
    # Zero-copy: two arrays of one prompt view the same C++ buffer.
    assert np.shares_memory(array, rendered.token_array)
    assert array.copy().flags.writeable


def test_token_array_without_numpy_is_a_memoryview(rendered, monkeypatch):
    monkeypatch.setitem(sys.modules, "numpy", None)  # `import numpy` now raises ImportError
    view = rendered.token_array
    assert isinstance(view, memoryview)
    assert view.format == "i" and view.itemsize == 4 and view.readonly
    assert view.tolist() == rendered.token_ids and len(view) == len(rendered) and view[0] == rendered.token_ids[0]
    assert len(bytes(view)) == 4 * len(rendered)


def test_the_array_outlives_the_rendered_input():
    conversation = ds.Conversation()
    conversation.add_user_message("keep me")
    rendered = conversation.render_for_engine("deepseek-ai/DeepSeek-V3")
    expected = rendered.token_ids
    view = memoryview(rendered.token_array)
    del rendered
    gc.collect()
    assert view.tolist() == expected


def test_arrays_go_back_into_the_tokenizer(rendered, tokenizer):
    assert tokenizer.decode(rendered.token_array) == rendered.text
