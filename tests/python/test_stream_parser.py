"""StreamOutputParser fed scripted token streams: reasoning, content and tool calls in the V3, R1, V3.1 and
DSML (V3.2 / V4 / V4.1) formats, as the C++ stream_parser tests define them (model outputs written from each
format's grammar), plus the Python surface: StepEvent, ToolCall, feed, finish, result."""
import re

import pytest

import deepseek_recipe as ds
from conftest import EOS

V3_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
           "{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
V31_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


def dsml_call(block, prefix):
    """A DSML tool-call block: `block` is function_calls (V3.2), tool_calls (V4) or ' calls' (V4.1); `prefix` is
    '' or ' ' (V4.1 writes a space after ｜DSML｜)."""
    return ("\n\n<｜DSML｜{b}>\n<｜DSML｜{p}invoke name=\"get_weather\">\n"
            "<｜DSML｜{p}parameter name=\"city\" string=\"true\">Paris</｜DSML｜{p}parameter>\n"
            "<｜DSML｜{p}parameter name=\"days\" string=\"false\">3</｜DSML｜{p}parameter>\n"
            "</｜DSML｜{p}invoke>\n</｜DSML｜{b}>").format(b=block, p=prefix)


def run(parser, ids):
    """Steps every id like a gateway does; returns (reasoning, content, tool calls, events, steps)."""
    reasoning, content, calls, events = "", "", [], []
    for token_id in ids:
        ev = parser.step(token_id)
        if ev.is_reasoning():
            reasoning += ev.reasoning
        if ev.is_content():
            content += ev.content
        assert ev.text() == ev.reasoning + ev.content
        if ev.is_tool_call_completed():
            assert ev.get_tool_call().id == ev.tool_calls[0].id
            calls.extend(ev.tool_calls)
        events.extend(ev.events)
    return reasoning, content, calls, events


CASES = [
    # (name, model, parser options, output, reasoning, content, calls as (name, arguments))
    ("v3_content_then_call", "deepseek-ai/DeepSeek-V3", {}, "Let me check." + V3_CALL,
     "", "Let me check.", [("get_weather", {"city": "Paris"})]),
    ("r1_reasoning_then_content", "deepseek-ai/DeepSeek-R1", {}, "Let me think: 2+2.\n</think>\n\nThe answer is 4.",
     "Let me think: 2+2.\n", "\n\nThe answer is 4.", []),
    ("r1_reasoning_then_call", "deepseek-ai/DeepSeek-R1", {}, "Need the weather.\n</think>\n\n" + V3_CALL,
     "Need the weather.\n", "\n\n", [("get_weather", {"city": "Paris"})]),
    ("v31_thinking_reasoning_content_call", "deepseek-ai/DeepSeek-V3.1", {"starts_in_reasoning": True},
     "I need data.</think>Checking." + V31_CALL, "I need data.", "Checking.", [("get_weather", {"city": "Paris"})]),
    ("v31_chat_output_opens_think", "deepseek-ai/DeepSeek-V3.1", {}, "<think>hmm</think>Answer.",
     "hmm", "Answer.", []),
    ("v32_thinking_dsml", "deepseek-ai/DeepSeek-V3.2", {"starts_in_reasoning": True},
     "The user wants weather.</think>Let me check." + dsml_call("function_calls", ""),
     "The user wants weather.", "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("v4_call_block_before_think_end", "deepseek-ai/DeepSeek-V4-Flash", {"starts_in_reasoning": True},
     "Need data." + dsml_call("tool_calls", ""), "Need data.", "", [("get_weather", {"city": "Paris", "days": 3})]),
    ("v41_chat_dsml", "deepseek-ai/DeepSeek-V4.1-Flash", {}, "Let me check." + dsml_call(" calls", " "),
     "", "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("v41_thinking_no_tools", "deepseek-ai/DeepSeek-V4.1-Flash", {"starts_in_reasoning": True},
     "Plan: 🌸 東京 𝔘.</think>Hello 🌸 東京 𝔘!", "Plan: 🌸 東京 𝔘.", "Hello 🌸 東京 𝔘!", []),
    ("v31_tools_disabled_markup_is_content", "deepseek-ai/DeepSeek-V3.1", {"tools": False}, "Sure." + V31_CALL,
     "", "Sure." + V31_CALL, []),
    # After a prompt that pre-filled the block's opener (tool_choice required or named): the output is the calls.
    ("v4_starts_in_tool_calls", "deepseek-ai/DeepSeek-V4-Flash", {"starts_in_tool_calls": True},
     dsml_call("tool_calls", "")[len("\n\n<｜DSML｜tool_calls>\n"):], "", "",
     [("get_weather", {"city": "Paris", "days": 3})]),
    # response_format: only the JSON text is content.
    ("v41_json_output", "deepseek-ai/DeepSeek-V4.1-Flash", {"json_output": True, "starts_in_reasoning": True},
     "Plan.</think>Sure:\n```json\n{\"a\": [1]}\n```\nDone.", "Plan.", "{\"a\": [1]}", []),
]


@pytest.mark.parametrize("name,model,options,output,reasoning,content,calls", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("untrusted", [False, True], ids=["markers_as_tokens", "markers_as_text"])
def test_scripted_stream(tokenizer, name, model, options, output, reasoning, content, calls, untrusted):
    # Either way the model may write a marker: as its added token, or as ordinary pieces. Same result.
    ids = tokenizer.encode(output, untrusted=untrusted) + [tokenizer.token_to_id(EOS)]
    parser = ds.StreamOutputParser(tokenizer_model=model, **options)
    got_reasoning, got_content, got_calls, events = run(parser, ids)
    assert (got_reasoning, got_content) == (reasoning, content)
    assert [(c.name, c.arguments) for c in got_calls] == calls
    result = parser.result()
    assert (result.reasoning, result.content) == (reasoning, content)
    assert result.ended_with_eos and parser.finished
    assert result.malformed_tool_calls == 0
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls
    assert "\ufffd" not in got_reasoning + got_content  # no character split across events
    # OpenAI streaming semantics: id and name first, then argument fragments adding up to the arguments text.
    for index, call in enumerate(got_calls):
        assert call.index == index
        assert re.fullmatch(r"call_%d_[0-9A-Za-z]{16}" % index, call.id)
        begin = [e for e in events if e.kind == "tool_call_begin" and e.tool_index == index]
        assert [(e.tool_id, e.tool_name) for e in begin] == [(call.id, call.name)]
        fragments = "".join(e.text for e in events if e.kind == "tool_arguments" and e.tool_index == index)
        assert fragments == call.arguments_text
        kinds = [e.kind for e in events if e.tool_index == index]
        assert kinds[0] == "tool_call_begin" and kinds[-1] == "tool_call_end"


def test_feed_equals_steps_and_takes_arrays(tokenizer):
    output = "I need data.</think>Checking." + V31_CALL + EOS
    ids = tokenizer.encode(output)
    stepped = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3.1", starts_in_reasoning=True)
    run(stepped, ids)
    fed = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3.1", starts_in_reasoning=True)
    ev = fed.feed(ids)
    assert ev.is_reasoning() and ev.is_content() and ev.is_tool_call_started() and ev.is_tool_call_completed()
    assert ev.reasoning == "I need data." and ev.content == "Checking."
    assert ev.text() == "I need data.Checking."  # a step carrying both kinds: text() is both, in order
    assert [e.kind for e in ev.events] == ["reasoning", "content", "tool_call_begin", "tool_arguments",
                                           "tool_call_end"]
    assert ev.is_finished()
    assert fed.result().to_openai()["tool_calls"][0]["function"] == \
        stepped.result().to_openai()["tool_calls"][0]["function"]
    np = pytest.importorskip("numpy")
    again = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3.1", starts_in_reasoning=True)
    assert again.feed(np.asarray(ids, dtype=np.int32)).content == "Checking."


def test_partial_marker_is_held_back_until_finish(tokenizer):
    parser = ds.StreamOutputParser("deepseek-ai/DeepSeek-R1")
    streamed = "".join(parser.step(i).text() for i in tokenizer.encode("still thinking </thi"))
    assert streamed == "still thinking "
    assert not parser.finished
    last = parser.finish()
    assert last.is_reasoning() and last.text() == "</thi" and last.is_finished()
    assert parser.result().reasoning == "still thinking </thi" and not parser.result().ended_with_eos


def test_multibyte_character_waits_for_its_last_token(tokenizer):
    parser = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3")
    ids = tokenizer.encode("𝔘")
    assert len(ids) == 3
    texts = [parser.step(i).text() for i in ids]
    assert texts == ["", "", "𝔘"]


def test_tokens_after_eos_are_ignored(tokenizer):
    parser = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3")
    eos = tokenizer.token_to_id(EOS)
    run(parser, tokenizer.encode("Done.") + [eos])
    ev = parser.step(tokenizer.encode("more")[0])
    assert not ev and ev.is_finished() and parser.result().content == "Done."


def test_malformed_markup_is_content_verbatim(tokenizer):
    bad = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```yaml\ncity: Paris\n```"
           "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    parser = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3")
    _, content, calls, _ = run(parser, tokenizer.encode(bad + EOS))
    assert content == bad and calls == []
    assert parser.result().malformed_tool_calls == 1


def test_a_call_cut_by_the_length_limit_shows_no_markup(tokenizer):
    ids = tokenizer.encode("Checking." + V3_CALL)

    def cut_at(marker):  # the ids up to where `marker` begins in the call
        return ids[:len(tokenizer.encode("Checking." + V3_CALL[:V3_CALL.index(marker)]))]

    in_name, in_arguments = cut_at("weather"), cut_at("city")
    parser = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3")
    run(parser, in_name)
    assert parser.finish(cut_off=True).is_finished()
    assert parser.result().content == "Checking." and parser.result().tool_calls == []
    assert parser.result().malformed_tool_calls == 0
    plain = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3")  # the model's own end there: malformed, kept as text
    run(plain, in_name)
    plain.finish()
    assert "｜tool▁sep｜" in plain.result().content and plain.result().malformed_tool_calls == 1
    parser = ds.StreamOutputParser("deepseek-ai/DeepSeek-V3")
    run(parser, in_arguments)
    parser.finish(cut_off=True)
    assert parser.result().content == "Checking."
    assert [c.name for c in parser.result().tool_calls] == ["get_weather"]


def test_tool_call_objects(tokenizer):
    parser = ds.StreamOutputParser("deepseek-ai/DeepSeek-V4.1-Flash")
    _, _, calls, _ = run(parser, tokenizer.encode("Let me check." + dsml_call(" calls", " ") + EOS))
    (call,) = calls
    assert call.arguments_text == '{"city": "Paris", "days": 3}'
    assert call.to_openai() == {"id": call.id, "type": "function",
                                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
    assert call.to_anthropic() == {"type": "tool_use", "id": call.id, "name": "get_weather",
                                   "input": {"city": "Paris", "days": 3}}
    assert parser.result().to_openai() == {"role": "assistant", "content": "Let me check.",
                                           "tool_calls": [call.to_openai()]}
    # A parsed call goes straight back into the next turn, and renders as the model wrote it.
    conversation = ds.Conversation()
    conversation.add_user_message("What is the weather?")
    conversation.add_assistant_message("Let me check.", tool_calls=[call])
    conversation.add_tool_result(call.id, "Sunny, 21°C")
    rendered = conversation.render_for_engine("deepseek-ai/DeepSeek-V4.1-Flash")
    assert dsml_call(" calls", " ") in rendered.text and "Sunny, 21°C" in rendered.text


def test_rendered_input_builds_the_matching_parser(tokenizer):
    conversation = ds.Conversation()
    conversation.set_reasoning_mode(True)
    conversation.add_user_message("What is the weather?")
    rendered = conversation.render_for_engine("deepseek-ai/DeepSeek-V3.1")
    assert rendered.starts_in_reasoning and not rendered.tools_enabled
    parser = rendered.stream_parser()
    assert parser.format == "deepseek-v3.1"
    reasoning, content, calls, _ = run(parser, tokenizer.encode("Think.</think>Sure." + V31_CALL + EOS))
    # Thinking prompt: output starts in reasoning. No tools offered: call markup is content.
    assert (reasoning, content, calls) == ("Think.", "Sure." + V31_CALL, [])
    conversation.set_reasoning_mode(False)
    conversation.register_tool("get_weather", "Weather", {"type": "object"})
    rendered = conversation.render_for_engine("deepseek-ai/DeepSeek-V3.1")
    assert not rendered.starts_in_reasoning and rendered.tools_enabled
    _, content, calls, _ = run(rendered.stream_parser(), tokenizer.encode("Sure." + V31_CALL + EOS))
    assert content == "Sure." and [c.name for c in calls] == ["get_weather"]


def test_rendered_input_carries_the_prefilled_block_and_json_output(tokenizer):
    # render_for_engine's parser takes every option the server takes from the prompt (stream_parser_options).
    conversation = ds.Conversation.from_openai({
        "messages": [{"role": "user", "content": "Weather in Paris?"}], "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})
    rendered = conversation.render_for_engine("deepseek-ai/DeepSeek-V4-Flash")
    assert rendered.text.endswith("\n\n<｜DSML｜tool_calls>\n")
    assert rendered.parser_options == {"starts_in_reasoning": False, "tools": True, "starts_in_tool_calls": True,
                                       "json_output": False}
    output = dsml_call("tool_calls", "")[len("\n\n<｜DSML｜tool_calls>\n"):]
    _, content, calls, _ = run(rendered.stream_parser(), tokenizer.encode(output + EOS))
    assert (content, [c.name for c in calls]) == ("", ["get_weather"])
    # The same options reach a ResponseStream through parser_options.
    stream = ds.ResponseStream("chat_completions", id="id", model="m", tokenizer_model="deepseek-ai/DeepSeek-V4-Flash",
                               **rendered.parser_options)
    for token_id in tokenizer.encode(output + EOS):
        stream.push_token(token_id)
    stream.finish("stop")
    assert stream.response()["choices"][0]["finish_reason"] == "tool_calls"

    asked = ds.Conversation.from_openai({"messages": [{"role": "user", "content": "JSON, please."}],
                                         "response_format": {"type": "json_object"}})
    rendered = asked.render_for_engine("deepseek-ai/DeepSeek-V4.1-Flash")
    assert rendered.json_output and not rendered.starts_in_tool_calls
    _, content, _, _ = run(rendered.stream_parser(), tokenizer.encode("Sure: {\"a\": 1}" + EOS))
    assert content == "{\"a\": 1}"


def test_prefilled_block_without_tools_is_refused():
    # The parser would read the block as text: the option would be accepted and then ignored.
    with pytest.raises(ValueError, match="starts_in_tool_calls .* needs tools=True"):
        ds.StreamOutputParser(format="deepseek-v4", tools=False, starts_in_tool_calls=True)
    with pytest.raises(ValueError, match="starts_in_tool_calls .* needs tools=True"):
        ds.ResponseStream("chat_completions", id="i", model="m", format="deepseek-v4", tools=False,
                          starts_in_tool_calls=True)
    with pytest.raises(ValueError, match="completions"):
        ds.ResponseStream("completions", id="i", model="m", format="deepseek-v4", json_output=True)
