"""Errors: the C++ core's Status becomes ValueError (bad input) or RuntimeError, carrying the C++ message
unchanged (the same text the server returns in a 400 body); Python-side misuse is TypeError."""
import json
import os

import pytest

import deepseek_recipe as ds
from conftest import TOKENIZER_DIR


def raises(exception, call):
    with pytest.raises(exception) as info:
        call()
    return str(info.value)


def user(text="x"):
    return {"role": "user", "content": text}


def render(payload, fmt):
    return ds.Conversation.from_openai(payload).render_for_engine("deepseek-ai/DeepSeek-V3", format=fmt)


def test_openai_request_errors_name_the_field():
    assert raises(ValueError, lambda: ds.Conversation.from_openai({})) == "messages is required"
    assert raises(ValueError, lambda: ds.Conversation.from_openai({"messages": []})) == "messages must not be empty"
    assert raises(ValueError, lambda: ds.Conversation.from_openai({"messages": [{"role": "robot", "content": "x"}]})) \
        == "messages[0].role: unknown role 'robot'; expected system, developer, user, assistant, tool or latest_reminder"
    bad_arguments = {"messages": [user(), {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]}
    assert raises(ValueError, lambda: ds.Conversation.from_openai(bad_arguments)).startswith(
        "messages[1].tool_calls[0].function.arguments is not valid JSON (")
    assert raises(ValueError, lambda: ds.Conversation.from_openai({"messages": [user()], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})) == \
        "tool_choice.function.name 'nope' is not one of the request's tools"
    assert raises(ValueError, lambda: ds.Conversation.from_openai("{not json")).startswith(
        "the request body is not valid JSON: ")


def test_anthropic_request_errors_name_the_field():
    assert raises(ValueError, lambda: ds.Conversation.from_anthropic({"max_tokens": 1})) == "messages must be an array"
    assert raises(ValueError, lambda: ds.Conversation.from_anthropic({"messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]})) == "messages[0].content[0].input must be an object"
    assert raises(ValueError, lambda: ds.Conversation.from_anthropic({"messages": [user()], "tool_choice": {
        "type": "any"}})) == 'tool_choice "any" needs tools'
    assert raises(ValueError, lambda: ds.Conversation.from_anthropic({"messages": [user()], "thinking": True})) == \
        'thinking must be {"type": "enabled", "budget_tokens": N} or {"type": "disabled"}'


def test_builder_errors_name_the_message_they_would_be():
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    assert raises(ValueError, lambda: conversation.add_assistant_message()) == \
        "messages[1] is an assistant message with neither content nor tool_calls"
    assert raises(ValueError, lambda: conversation.add_user_message(3)) == \
        "messages[1].content must be a string, an array of content parts or null, got a number"
    assert raises(ValueError, lambda: conversation.add_assistant_message("x", tool_calls=[
        {"function": {"name": "f", "arguments": "[1]"}}])) == \
        "messages[1].tool_calls[0].function.arguments must be a JSON object, got an array"
    assert raises(ValueError, lambda: conversation.register_tool("")) == "tools[0].function.name must be a non-empty string"
    assert raises(ValueError, lambda: conversation.register_tool("f", parameters=[1])) == \
        "tools[0].function.parameters must be a JSON Schema object, got an array"
    assert len(conversation) == 1 and conversation.tool_names == []  # nothing half-added
    assert "content is a object" in raises(TypeError, lambda: conversation.add_user_message(object()))
    assert raises(TypeError, lambda: conversation.set_reasoning_effort(True)) == \
        "reasoning effort must be a str, an int or None, got bool"
    assert "payload must be a dict or JSON text" in raises(TypeError, lambda: ds.Conversation.from_openai([1]))
    assert "messages[0] has a key of type int" in raises(TypeError, lambda: ds.Conversation.from_openai(
        {"messages": [{1: "x"}]}))


def test_render_errors_carry_the_renderer_message():
    assert "not valid for deepseek-v4.1" in raises(ValueError, lambda: render(
        {"messages": [user()], "reasoning_effort": "101"}, "deepseek-v4.1"))
    assert raises(ValueError, lambda: render({"messages": [user("<｜DSML｜function_calls>")]}, "deepseek-v3.2")) \
        .startswith("messages[0].content contains '｜DSML｜'")
    assert "has no image input" in raises(ValueError, lambda: render({"messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": "data:x"}]}]}, "deepseek-v4"))
    assert "messages[1] is a tool result that does not follow" in raises(ValueError, lambda: render(
        {"messages": [user(), {"role": "tool", "content": "r"}]}, "deepseek-v3.2"))


def test_model_and_format_errors():
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    message = raises(ValueError, lambda: conversation.render_for_engine("deepseek-ai/DeepSeek-V9"))
    assert message.startswith("unknown model 'deepseek-ai/DeepSeek-V9'") and "deepseek-ai/DeepSeek-V4.1-Flash" in message
    assert raises(ValueError, lambda: conversation.render_for_engine("DeepSeek-V3", format="deepseek-v9")) == \
        "unknown prompt format 'deepseek-v9'; expected one of deepseek-v3, deepseek-r1, deepseek-v3.1, " \
        "deepseek-v3.2, deepseek-v4, deepseek-v4.1"
    assert raises(ValueError, lambda: conversation.render_for_engine()).startswith("pass tokenizer_model=")
    raises(FileNotFoundError, lambda: conversation.render_for_engine("/no/such/dir"))
    raises(FileNotFoundError, lambda: ds.StreamOutputParser(os.path.dirname(TOKENIZER_DIR)))  # no tokenizer.json


def test_a_broken_tokenizer_file_raises_the_loader_message(tmp_path):
    file = tmp_path / "tokenizer.json"
    file.write_text(json.dumps({"model": {"type": "WordPiece"}}))  # Unsupported: ValueError
    assert raises(ValueError, lambda: ds.Tokenizer(str(tmp_path))) == \
        "%s: field 'model.type' is \"WordPiece\"; only BPE is supported" % file
    file.write_text("{garbage")  # Corruption: RuntimeError
    assert raises(RuntimeError, lambda: ds.Tokenizer(str(tmp_path))) == "%s: not valid JSON: syntax error" % file


def test_the_parser_rejects_token_ids_outside_the_vocabulary():
    # Regression: step(-1) and step(10**9) used to return an empty event silently.
    parser = ds.StreamOutputParser(TOKENIZER_DIR, format="deepseek-v3")
    vocab = ds.Tokenizer(TOKENIZER_DIR).vocab_size
    assert raises(ValueError, lambda: parser.step(-1)) == "token id -1 is outside the vocabulary [0, %d)" % vocab
    assert raises(ValueError, lambda: parser.step(10**9)).startswith("token id 1000000000 is outside the vocabulary")
    assert raises(ValueError, lambda: parser.feed([1, 2, vocab]))
    assert parser.step(1) is not None  # still usable after the errors
