"""tokenizer_model resolution: known names (tokenizer shipped in the package), local directories (format from
format=, an official chat template, or name_or_path), and what is refused. Nothing is downloaded."""
import json
import os
import warnings

import pytest

import deepseek_recipe as ds
from conftest import TOKENIZER_DIR


def test_model_table():
    assert set(ds.MODELS.values()) == set(ds.FORMATS)
    assert ds.format_for_model("deepseek-ai/DeepSeek-V4.1-Flash") == "deepseek-v4.1"
    assert ds.format_for_model("deepseek-v3.1-terminus") == "deepseek-v3.1"
    assert ds.format_for_model(" DeepSeek-R1 ") == "deepseek-r1"
    assert ds.format_for_model("deepseek-ai/DeepSeek-V5") is None
    assert ds.FORMATS == ("deepseek-v3", "deepseek-r1", "deepseek-v3.1", "deepseek-v3.2", "deepseek-v4",
                          "deepseek-v4.1")


@pytest.mark.parametrize("name,fmt", sorted(ds.MODELS.items()))
def test_every_name_renders_in_its_format(name, fmt):
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    rendered = conversation.render_for_engine(tokenizer_model=name)
    assert rendered.format == fmt
    assert ds.StreamOutputParser(tokenizer_model=name).format == fmt


def test_names_newer_than_r1_warn_once_about_the_shipped_tokenizer():
    from deepseek_recipe import _models
    _models._warned.clear()
    _models._resolved.clear()
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    with pytest.warns(UserWarning, match="DeepSeek-V4.1-Flash is tokenized with the shipped DeepSeek-V3 tokenizer"):
        conversation.render_for_engine("deepseek-ai/DeepSeek-V4.1-Flash")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        conversation.render_for_engine("deepseek-ai/DeepSeek-V4.1-Flash")  # once
        conversation.render_for_engine("deepseek-ai/DeepSeek-R1")  # exact: no warning
        conversation.render_for_engine(TOKENIZER_DIR, format="deepseek-v4.1")  # a directory is what it is


def test_the_repository_tokenizer_directory_is_deepseek_v3():
    assert ds.detect_format(TOKENIZER_DIR) == "deepseek-v3"  # the official V3 chat template, byte for byte
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    by_dir = conversation.render_for_engine(TOKENIZER_DIR)
    by_file = conversation.render_for_engine(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
    by_name = conversation.render_for_engine("deepseek-ai/DeepSeek-V3")
    assert by_dir.format == by_file.format == by_name.format == "deepseek-v3"
    assert by_dir.token_ids == by_file.token_ids == by_name.token_ids


def make_checkpoint(tmp_path, tokenizer_config=None, config=None):
    os.symlink(os.path.join(TOKENIZER_DIR, "tokenizer.json"), tmp_path / "tokenizer.json")
    if tokenizer_config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_directory_named_by_its_configs(tmp_path):
    (tmp_path / "a").mkdir()
    a = make_checkpoint(tmp_path / "a", tokenizer_config={"name_or_path": "deepseek-ai/DeepSeek-V3.1"})
    assert ds.detect_format(a) == "deepseek-v3.1"
    (tmp_path / "b").mkdir()
    b = make_checkpoint(tmp_path / "b", config={"_name_or_path": "/models/DeepSeek-V4.1-Flash/",
                                                 "model_type": "deepseek_v4"})
    assert ds.detect_format(b) == "deepseek-v4.1"
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    assert conversation.render_for_engine(b).format == "deepseek-v4.1"


def test_directory_named_as_the_server_reads_it(tmp_path):
    # config.json's chat_format (the demo model's way) and DeepSeek's encoder files, as `deepinfer serve` reads them.
    (tmp_path / "a").mkdir()
    a = make_checkpoint(tmp_path / "a", config={"model_type": "deepseek_v3", "chat_format": "deepseek-v4.1"})
    assert ds.detect_format(a) == "deepseek-v4.1"
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    assert conversation.render_for_engine(a).format == "deepseek-v4.1"
    (tmp_path / "b").mkdir()
    b = make_checkpoint(tmp_path / "b", config={"model_type": "deepseek_v3", "chat_format": "chatml"})
    with pytest.raises(ValueError, match=r"config.json's chat_format must be one of deepseek-v3.*got \"chatml\""):
        ds.detect_format(b)
    (tmp_path / "c").mkdir()
    c = make_checkpoint(tmp_path / "c", config={"model_type": "deepseek_v4"})
    (tmp_path / "c" / "encoding").mkdir()
    (tmp_path / "c" / "encoding" / "encoding_dsv4.py").write_text("# DeepSeek's encoder\n")
    assert ds.detect_format(c) == "deepseek-v4"


def test_unidentified_directory_needs_format(tmp_path, tokenizer):
    directory = make_checkpoint(tmp_path, config={"model_type": "deepseek_v3"})
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    with pytest.raises(ValueError, match=r"cannot tell the prompt format of .*: pass format=, one of deepseek-v3"):
        conversation.render_for_engine(directory)
    assert conversation.render_for_engine(directory, format="deepseek-r1").format == "deepseek-r1"
    assert ds.StreamOutputParser(directory, format="deepseek-v3.2").format == "deepseek-v3.2"
    # The tokenizer itself needs no format.
    assert ds.Tokenizer(directory).encode("Hi") == tokenizer.encode("Hi")


def test_format_alone_uses_the_shipped_tokenizer():
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    assert conversation.render_for_engine(format="deepseek-v3.2").format == "deepseek-v3.2"
    # format= also overrides a model name's own format.
    assert conversation.render_for_engine("deepseek-ai/DeepSeek-V3", format="deepseek-v4").format == "deepseek-v4"
