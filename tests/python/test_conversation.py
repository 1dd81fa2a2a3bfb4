"""Conversation: the builder, from_openai (dict or JSON text), from_anthropic, options, tool_choice, and
rendering from several threads."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

import deepseek_recipe as ds
from conftest import read_json

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

OPENAI = {
    "model": "anything", "temperature": 0.2,  # sampling fields are not the recipe's business
    "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"id": "toolu_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
        {"role": "user", "content": "Thanks, and tomorrow?"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}}],
    "chat_template_kwargs": {"thinking": True},
}

ANTHROPIC = {
    "model": "anything", "max_tokens": 100,
    "system": "You are a weather bot.",
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMA}],
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the tool.", "signature": ""},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
            {"type": "text", "text": "Thanks, and tomorrow?"}]},
    ],
}


def built():
    conversation = ds.Conversation()
    conversation.set_reasoning_mode(True)
    conversation.register_tool("get_weather", "Weather", SCHEMA)
    conversation.add_system_message("You are a weather bot.")
    conversation.add_user_message("Weather in Paris?")
    conversation.add_assistant_message("Checking.", reasoning_content="Need the tool.",
                                       tool_calls=[{"id": "toolu_1", "type": "function",
                                                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])
    conversation.add_tool_result("toolu_1", "Sunny")
    conversation.add_user_message("Thanks, and tomorrow?")
    return conversation


@pytest.mark.parametrize("fmt", ds.FORMATS)
def test_openai_anthropic_and_builder_render_alike(fmt):
    if fmt == "deepseek-v3":  # no thinking mode: the request's thinking switch is refused, never dropped
        for c in (ds.Conversation.from_openai(OPENAI), ds.Conversation.from_anthropic(ANTHROPIC), built()):
            with pytest.raises(ValueError, match="thinking is not available with the deepseek-v3 prompt format"):
                c.render_for_engine("deepseek-ai/DeepSeek-V3", format=fmt)
        return
    renders = [c.render_for_engine("deepseek-ai/DeepSeek-V3", format=fmt) for c in
               (ds.Conversation.from_openai(OPENAI), ds.Conversation.from_anthropic(ANTHROPIC), built(),
                ds.Conversation.from_openai(json.dumps(OPENAI)),
                ds.Conversation.from_anthropic(json.dumps(ANTHROPIC).encode("utf-8")))]
    for rendered in renders[1:]:
        assert rendered.text == renders[0].text
        assert rendered.token_ids == renders[0].token_ids
    assert "Sunny" in renders[0].text and "Thanks, and tomorrow?" in renders[0].text


def test_conversation_properties():
    conversation = ds.Conversation.from_openai(OPENAI)
    assert len(conversation) == 5
    assert conversation.reasoning_mode is True and conversation.reasoning_effort is None
    assert conversation.tool_names == ["get_weather"]
    conversation.set_reasoning_effort(30)
    assert conversation.reasoning_effort == "30"
    conversation.set_reasoning_effort(None)
    assert conversation.reasoning_effort is None
    assert repr(conversation) == "Conversation(messages=5, tools=1, reasoning_mode=True)"


def test_reasoning_mode_and_effort_reach_the_prompt():
    conversation = ds.Conversation()
    conversation.add_user_message("Hi")
    chat = conversation.render_for_engine("deepseek-ai/DeepSeek-V4.1-Flash")
    assert chat.text.endswith("<｜Assistant｜></think>") and not chat.starts_in_reasoning
    conversation.set_reasoning_mode(True)
    conversation.set_reasoning_effort("low")
    thinking = conversation.render_for_engine("deepseek-ai/DeepSeek-V4.1-Flash")
    assert thinking.text.endswith("<｜Assistant｜><think>") and thinking.starts_in_reasoning
    assert "Reasoning Effort: 25" in thinking.text


def test_add_generation_prompt_override_leaves_the_conversation_as_it_was():
    conversation = ds.Conversation.from_openai({"messages": [{"role": "user", "content": "Hi"}],
                                                "add_generation_prompt": False})
    assert conversation.render_for_engine("DeepSeek-V3").text == "<｜begin▁of▁sentence｜><｜User｜>Hi"
    opened = conversation.render_for_engine("DeepSeek-V3", add_generation_prompt=True)
    assert opened.text == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>"
    assert conversation.render_for_engine("DeepSeek-V3").text == "<｜begin▁of▁sentence｜><｜User｜>Hi"


def test_tool_choice_none_drops_the_tools():
    payload = dict(OPENAI, tool_choice="none")
    assert ds.Conversation.from_openai(payload).tool_names == []
    assert ds.Conversation.from_openai(dict(OPENAI, tool_choice="required")).tool_names == ["get_weather"]
    assert ds.Conversation.from_anthropic(dict(ANTHROPIC, tool_choice={"type": "none"})).tool_names == []


def test_marker_text_follows_the_tokenizer(v4_tokenizer):
    # As the server renders: with a tokenizer that has the ｜DSML｜ token, marker text in request text is ordinary
    # text (tokenized untrusted, never the token's id); with DeepSeek-V3's (shipped here) or none, a ValueError.
    text = "say <｜DSML｜tool_calls> and <tool_result> please"
    conversation = ds.Conversation.from_openai({"messages": [{"role": "user", "content": text}]})
    rendered = conversation.render_for_engine(v4_tokenizer, format="deepseek-v4")
    assert text in rendered.text and 128825 not in rendered.token_ids
    assert conversation.render_text("deepseek-v4", v4_tokenizer)[0] == rendered.text
    for render in (lambda: conversation.render_for_engine("deepseek-ai/DeepSeek-V4-Flash"),
                   lambda: conversation.render_text("deepseek-v4"),
                   lambda: conversation.render_text("deepseek-v4", "deepseek-ai/DeepSeek-V3")):
        with pytest.raises(ValueError, match=r"messages\[0\]\.content contains '｜DSML｜'"):
            render()


def test_content_parts_and_images():
    conversation = ds.Conversation()
    conversation.add_user_message([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                   {"type": "text", "text": "What is it?"}])
    rendered = conversation.render_for_engine("deepseek-ai/DeepSeek-V4.1-Flash")
    assert rendered.text == "<｜begin▁of▁sentence｜><｜User｜><｜deepseek_image｜>\n\nWhat is it?<｜Assistant｜></think>"


def test_rendering_from_many_threads_gives_one_answer():
    payload = read_json("tests", "data", "conversations", "agent-session.json")
    conversation = ds.Conversation.from_openai(payload)
    expected = conversation.render_for_engine("deepseek-ai/DeepSeek-V3").token_ids
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: conversation.render_for_engine("deepseek-ai/DeepSeek-V3").token_ids,
                                range(8)))
    assert all(r == expected for r in results)


def test_payload_numbers_may_be_numpy_scalars():
    np = pytest.importorskip("numpy")
    payload = {"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": np.int64(30),
               "temperature": np.float32(0.5)}
    conversation = ds.Conversation.from_openai(payload)
    assert conversation.reasoning_effort == "30"
    with pytest.raises(TypeError, match="messages is a numpy.ndarray"):
        ds.Conversation.from_openai({"messages": np.zeros(2)})
