"""DeepSeek's deepseek-recipe Python API on our core (deepseek_recipe/_compat.py): the behaviours its own tests
check (deepseek-recipe-python/tests/test_bindings.py, server-py/tests/test_smoke.py, deepseek-recipe/tests/
stream_tool_calls.rs), ported to this module, and the places where we deliberately differ, each pinned by a test
named after the difference (docs/deepseek-recipe-parity.md has the table). Their tokenizer fixture is V4.1's;
ours is the DeepSeek-V3 tokenizer `make setup` fetches (text round-trips the same; only marker ids differ), and for
the ｜DSML｜ token conftest's v4_tokenizer (V3's plus V4's added tokens at their ids, tools/make_v4_tokenizer.py)."""
import json

import pytest

import deepseek_recipe as ds
from deepseek_recipe import (
    THINKING_END_TOKEN,
    THINKING_START_TOKEN,
    ChatCompletionRequest,
    ChatCompletionResponse,
    Conversation,
    ConversionError,
    ConversionOptions,
    DeepseekV41Encoding,
    InferenceChunk,
    InferenceFinishReason,
    MessagesRequest,
    MessagesResponse,
    ParsingOptions,
    PromptUsage,
    ResponsesRequest,
    ResponsesResponse,
    StreamProcessor,
    Tokenizer,
    ToolDefinition,
    UserMessage,
    WebSearchBehavior,
)

REQUEST = {"model": "smoke-model", "messages": [{"role": "user", "content": "hi"}]}
# The DeepSeek-V3 tokenizer.json shipped in the package (loaded once per process, shared with the other tests).
TOKENIZER_FILE = ds.Tokenizer("deepseek-ai/DeepSeek-V3").path


def tiny_tokenizer_json():
    """A byte-level BPE tokenizer.json with one merge ("a" "n"): loads in microseconds, unlike V3's 7 MB."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: b for b in printable}
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + sum(1 for k in range(b) if k not in printable)
    vocab = {chr(c): b for b, c in chars.items()}
    vocab["an"] = 256
    return json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": ["a n"]},
                       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True},
                       "added_tokens": [], "normalizer": None, "decoder": {"type": "ByteLevel"}})


def run_chat(chunks, request=REQUEST, tokenizer=None, options=None):
    """Feeds InferenceChunks through a Chat Completions StreamProcessor; returns (streamed chunks, whole body)."""
    converted = ChatCompletionRequest(request).convert(options or ConversionOptions())
    generator = ChatCompletionRequest.chunk_generator(converted, "resp-1", "smoke-model")
    processor = StreamProcessor(generator, converted.parsing_options, tokenizer)
    response = ChatCompletionResponse("resp-1", "smoke-model", 0, 0, 0)
    streamed = []
    try:
        for chunk in chunks:
            streamed.extend(processor.push(chunk))
        streamed.extend(processor.finish())
        for output in streamed:
            response.append(output)
        assert processor.finished
        return streamed, json.loads(response.to_json())
    finally:
        processor.close()


# ---- test_bindings.py -------------------------------------------------------------------------------------

def test_rendering():
    converted = ChatCompletionRequest(REQUEST).convert(ConversionOptions())
    encoding = DeepseekV41Encoding()
    rendered = encoding.render_conversation(Conversation(messages=[UserMessage("hi")]))
    assert converted.conversation.messages[0].content == "hi"
    assert "hi" in rendered.prompt
    assert rendered.image_sources == []
    # The request's default thinking mode (on) differs from the bare Conversation's (off): both render.
    assert encoding.render_conversation(converted.conversation).prompt.endswith(THINKING_START_TOKEN)
    assert not rendered.prompt.endswith(THINKING_START_TOKEN)
    off = ChatCompletionRequest(REQUEST).convert(ConversionOptions(default_thinking_mode=False))
    assert encoding.render_conversation(off.conversation).prompt == rendered.prompt


def test_encoding_with_tokenizer():
    converted = ChatCompletionRequest(REQUEST).convert(ConversionOptions())
    tokenizer = Tokenizer.from_file(TOKENIZER_FILE)
    with pytest.raises(RuntimeError, match="no tokenizer"):
        DeepseekV41Encoding().encode(converted.conversation)
    encoding = DeepseekV41Encoding().with_tokenizer(tokenizer)
    prompt_ids = encoding.encode(converted.conversation)
    assert prompt_ids == tokenizer.encode(encoding.render_conversation(converted.conversation).prompt)


def test_web_search_conversion_options():
    defaults = ConversionOptions()
    constructed = ConversionOptions(default_thinking_mode=False, responses_web_search=WebSearchBehavior.Reject,
                                    messages_web_search=WebSearchBehavior.Ignore)
    configured = (defaults.with_default_thinking_mode(False).with_responses_web_search(WebSearchBehavior.Reject)
                  .with_messages_web_search(WebSearchBehavior.Ignore))
    assert defaults.default_thinking_mode
    assert defaults.responses_web_search == WebSearchBehavior.Ignore
    assert defaults.messages_web_search == WebSearchBehavior.Reject
    for options in (constructed, configured):
        assert not options.default_thinking_mode
        assert options.responses_web_search == WebSearchBehavior.Reject
        assert options.messages_web_search == WebSearchBehavior.Ignore

    responses = {"model": "smoke-model", "input": "hi", "tools": [{"type": "web_search"}]}
    messages = {**REQUEST, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    assert ResponsesRequest(responses).convert(defaults).conversation.tools == []
    # Their two messages differ in capitalisation ("server" / "Server"); ours is one sentence for both.
    with pytest.raises(ConversionError, match="(?i)server tools are not supported"):
        MessagesRequest(messages).convert(defaults)
    converted = MessagesRequest(messages).convert(configured)
    assert converted.conversation.tools == []
    assert not converted.conversation.thinking_mode
    with pytest.raises(ConversionError, match="(?i)server tools are not supported") as error:
        ResponsesRequest(responses).convert(configured)
    assert error.value.status_code == 400
    assert json.loads(error.value.body)["error"]["param"] == "tools[0]"


def test_custom_inference():
    request = {**REQUEST, "temperature": 0.25}
    converted = ChatCompletionRequest(request).convert(ConversionOptions())
    assert converted.inference_options.temperature == 0.25
    _, body = run_chat([InferenceChunk.ready(prompt_usage=PromptUsage(prompt_tokens=4)),
                        InferenceChunk.text(THINKING_END_TOKEN + "Custom answer", content_tokens=2),
                        InferenceChunk.finish(InferenceFinishReason.Stop)], request)
    assert body["id"] == "resp-1"
    assert body["choices"][0]["message"]["content"] == "Custom answer"
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["completion_tokens"] == 2


def test_token_chunks():
    tokenizer = Tokenizer.from_file(TOKENIZER_FILE)
    token_ids = tokenizer.encode(THINKING_END_TOKEN + "Custom answer")
    _, body = run_chat([InferenceChunk.ready(), *(InferenceChunk.token(t) for t in token_ids),
                        InferenceChunk.finish(InferenceFinishReason.Stop)], tokenizer=tokenizer)
    assert body["choices"][0]["message"]["content"] == "Custom answer"
    assert body["usage"]["completion_tokens"] == len(token_ids)


def test_split_character_tokens():
    # A character outside the vocabulary decodes from several byte tokens; every id counts.
    tokenizer = Tokenizer.from_file(TOKENIZER_FILE)
    token_ids = tokenizer.encode(THINKING_END_TOKEN + "🦀")
    assert len(token_ids) > 2
    _, body = run_chat([InferenceChunk.ready(), *(InferenceChunk.token(t) for t in token_ids),
                        InferenceChunk.finish(InferenceFinishReason.Stop)], tokenizer=tokenizer)
    assert body["choices"][0]["message"]["content"] == "🦀"
    assert body["usage"]["completion_tokens"] == len(token_ids)


def test_undecodable_token_ignored():
    tokenizer = Tokenizer.from_file(TOKENIZER_FILE)
    _, body = run_chat([InferenceChunk.ready(), InferenceChunk.token(999_999_999),
                        InferenceChunk.text(THINKING_END_TOKEN + "Hi", content_tokens=1),
                        InferenceChunk.finish(InferenceFinishReason.Stop)], tokenizer=tokenizer)
    assert body["choices"][0]["message"]["content"] == "Hi"
    assert body["usage"]["completion_tokens"] == 1


def test_token_chunk_without_tokenizer_errors():
    converted = ChatCompletionRequest(REQUEST).convert(ConversionOptions())
    generator = ChatCompletionRequest.chunk_generator(converted, "token-response", "smoke-model")
    processor = StreamProcessor(generator, converted.parsing_options)
    with pytest.raises(RuntimeError, match="without a tokenizer"):
        processor.push(InferenceChunk.token(1))


def test_tokenizer_from_str(tmp_path):
    # Loading from the file's contents gives the same ids as loading the file (their test uses V4.1's file).
    text = tiny_tokenizer_json()
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    ids = Tokenizer.from_str(text).encode("Custom answer")
    assert ids == Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("Custom answer")
    assert 256 in ids  # the merge applied


def test_tokenizer_from_str_errors():
    with pytest.raises(RuntimeError):
        Tokenizer.from_str("not json")


def test_foreign_tokenizer_errors():
    converted = ChatCompletionRequest(REQUEST).convert(ConversionOptions())
    generator = ChatCompletionRequest.chunk_generator(converted, "py-response", "smoke-model")
    with pytest.raises(TypeError):
        StreamProcessor(generator, converted.parsing_options, object())


def test_images_are_listed_not_fetched():
    # deepseek-recipe resolves images (fetch, OpenCV preprocessing); we render their place and list their sources.
    url = "data:image/png;base64,iVBORw0KGgo="
    converted = ChatCompletionRequest({**REQUEST, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}]}]}).convert(ConversionOptions())
    rendered = DeepseekV41Encoding().render_conversation(converted.conversation)
    assert ds.IMAGE_SPECIAL_TOKEN in rendered.prompt
    assert rendered.image_sources == [url]
    assert not ds.HAS_IMAGE_BINDINGS


def nested(depth):
    parameters = node = {}
    for _ in range(depth):
        node["next"] = {}
        node = node["next"]
    return parameters


def test_circular_and_deep_values_rejected():
    parameters = {}
    parameters["self"] = parameters
    items = []
    items.append(items)
    outer = {}
    outer["inner"] = {"outer": outer}
    through_tuple = {"items": []}
    through_tuple["items"].append((through_tuple,))
    for value in (parameters, items, outer, through_tuple):
        with pytest.raises(ValueError, match="circular reference"):
            ToolDefinition(name="f", parameters=value)
    body = dict(REQUEST)
    body["self"] = body
    with pytest.raises(ValueError, match="circular reference"):
        ChatCompletionRequest(body)
    with pytest.raises(RecursionError):
        ToolDefinition(name="f", parameters=nested(200))
    assert ToolDefinition(name="f", parameters=nested(127)).parameters == nested(127)
    shared = {"type": "string"}  # a subtree used twice is not a cycle
    schema = {"type": "object", "properties": {"a": shared, "b": shared}}
    assert ToolDefinition(name="f", parameters=schema).parameters == schema


# ---- stream_tool_calls.rs -----------------------------------------------------------------------------------

def tool_arguments(pieces, fmt):
    options = ParsingOptions(format=fmt)
    generator = ChatCompletionRequest.chunk_generator(
        ChatCompletionRequest(REQUEST).convert(ConversionOptions()), "id", "model")
    processor = StreamProcessor(generator, options)
    response = ChatCompletionResponse("id", "model", 0, 0, 0)
    for piece in pieces:
        for output in processor.push(InferenceChunk.text(piece)):
            response.append(output)
    for output in processor.push(InferenceChunk.finish(InferenceFinishReason.Stop)):
        response.append(output)
    (choice,) = json.loads(response.to_json())["choices"]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "submit"
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("fmt,block,prefix", [("deepseek-v4", "tool_calls", ""), ("deepseek-v4.1", " calls", " ")])
def test_quoted_tool_parameter_names_survive_chunk_boundaries(fmt, block, prefix):
    expected = {"shipping address": "Paris\n日本", " string= mode ": {"enabled": True}, "count": 2,
                "": "empty key"}
    p = prefix
    output = (f"<｜DSML｜{block}>\n<｜DSML｜{p}invoke name=\"submit\">\n"
              f"<｜DSML｜{p}parameter name=\"shipping address\" string=\"true\">Paris\n日本</｜DSML｜{p}parameter>\n"
              f"<｜DSML｜{p}parameter name=\" string= mode \" string=\"false\">{{\"enabled\":true}}"
              f"</｜DSML｜{p}parameter>\n"
              f"<｜DSML｜{p}parameter name=\"count\" string=\"false\">2</｜DSML｜{p}parameter>\n"
              f"<｜DSML｜{p}parameter name=\"\" string=\"true\">empty key</｜DSML｜{p}parameter>\n"
              f"</｜DSML｜{p}invoke>\n</｜DSML｜{block}>")
    assert tool_arguments([output], fmt) == expected
    for split in range(1, len(output)):
        assert tool_arguments([output[:split], output[split:]], fmt) == expected
    assert tool_arguments(list(output), fmt) == expected


# ---- server-py/tests/test_smoke.py: their example server's loop, without HTTP ------------------------------

PROTOCOLS = {
    "chat_completions": (ChatCompletionRequest, ChatCompletionResponse,
                         {"messages": [{"role": "user", "content": "hi"}]}, "data: [DONE]"),
    "responses": (ResponsesRequest, ResponsesResponse, {"input": "hi"}, "event: response.completed"),
    "messages": (MessagesRequest, MessagesResponse, {"messages": [{"role": "user", "content": "hi"}]},
                 "event: message_stop"),
}


def mock_inference(prompt, text="Hello |world!"):
    yield InferenceChunk.ready()
    if prompt.endswith(THINKING_START_TOKEN):
        yield InferenceChunk.text(THINKING_END_TOKEN, content_tokens=1)
    for piece in text.split("|"):
        yield InferenceChunk.text(piece, content_tokens=1)
    yield InferenceChunk.finish(InferenceFinishReason.Stop)


def serve(protocol, body, infer=mock_inference, options=None):
    """What server-py's handler does: convert, render, run the processor; (SSE text or JSON body)."""
    request_type, response_type, _, _ = PROTOCOLS[protocol]
    request = request_type(body)
    converted = request.convert(options or ConversionOptions())
    prompt = DeepseekV41Encoding().render_conversation(converted.conversation).prompt
    model = converted.model or "deepseek-flash"
    generator = request_type.chunk_generator(converted, "id-1", model)
    if protocol == "chat_completions":
        generator = generator.with_include_usage(request.include_usage())
    processor = StreamProcessor(generator, converted.parsing_options)
    response = None if converted.stream else response_type("id-1", model, 0, 0, 0)
    frames = []
    for chunk in infer(prompt):
        for output in processor.push(chunk):
            if converted.stream:
                event = response_type.chunk_event_type(output)
                frames.append((f"event: {event}\n" if event else "") + f"data: {output.to_json()}\n\n")
            else:
                response.append(output)
    processor.finish()
    if converted.stream:
        done = response_type.done_message()
        return "".join(frames) + (f"data: {done}\n\n" if done else "")
    return json.loads(response.to_json())


def response_text(protocol, body):
    if protocol == "chat_completions":
        return body["choices"][0]["message"]["content"]
    if protocol == "responses":
        return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                       for part in item["content"] if part["type"] == "output_text")
    return "".join(block["text"] for block in body["content"] if block["type"] == "text")


@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
@pytest.mark.parametrize("stream", [False, True])
def test_example_server(protocol, stream):
    _, _, payload, terminal = PROTOCOLS[protocol]
    out = serve(protocol, {"model": "deepseek-flash", "stream": stream, **payload})
    if stream:
        assert "Hello " in out and "world!" in out and terminal in out
    else:
        assert response_text(protocol, out) == "Hello world!"


def test_example_server_custom_inference():
    def infer(prompt):
        assert "hi" in prompt
        yield InferenceChunk.text(THINKING_END_TOKEN + "Custom answer")  # no ready, no finish

    body = serve("responses", {"model": "custom-model", "input": "hi", "temperature": 0.25}, infer)
    assert body["model"] == "custom-model"
    assert body["temperature"] == 0.25
    assert response_text("responses", body) == "Custom answer"


def test_example_server_invalid_request():
    with pytest.raises(ConversionError) as error:
        serve("chat_completions", {})
    assert error.value.status_code == 400
    assert json.loads(error.value.body)["error"]["type"] == "invalid_request_error"
    with pytest.raises(ConversionError) as error:  # Anthropic-shaped on the Messages dialect
        serve("messages", {"messages": "hi"})
    assert json.loads(error.value.body)["type"] == "error"


def test_example_server_web_search_options():
    messages = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
    responses = {"model": "deepseek-flash", "input": "hi", "tools": [{"type": "web_search"}]}
    with pytest.raises(ConversionError):
        serve("messages", messages)
    assert response_text("responses", serve("responses", responses)) == "Hello world!"
    options = ConversionOptions(responses_web_search=WebSearchBehavior.Reject,
                                messages_web_search=WebSearchBehavior.Ignore)
    assert response_text("messages", serve("messages", messages, options=options)) == "Hello world!"
    with pytest.raises(ConversionError):
        serve("responses", responses, options=options)


# ---- where we deliberately differ (docs/deepseek-recipe-parity.md) -----------------------------------------

def chat_text(text, options=None, request=REQUEST):
    """(reasoning, content, tool calls, finish_reason) of `text` streamed as one text chunk."""
    _, body = run_chat([InferenceChunk.text(text), InferenceChunk.finish(InferenceFinishReason.Stop)], request,
                       options=options)
    choice = body["choices"][0]
    message = choice["message"]
    return message["reasoning_content"], message["content"], message.get("tool_calls", []), choice["finish_reason"]


def test_difference_newlines_after_think_end_stay_content():
    # deepseek-recipe drops newlines that lead reasoning or the answer; we keep the model's text as written.
    assert chat_text("\nPlan.</think>\n\nAnswer.")[:2] == ("\nPlan.", "\n\nAnswer.")


def test_difference_extra_think_end_is_content():
    # deepseek-recipe skips a second </think> in the answer as invalid; we keep it: only the first ends reasoning.
    assert chat_text("Plan.</think>A</think>B")[:2] == ("Plan.", "A</think>B")


def test_difference_stop_sequences_match_in_reasoning_too():
    # deepseek-recipe matches stop sequences in the answer only; we match them in reasoning too (what the server
    # does with `stop`), and the answer then ends there.
    reasoning, content, _, finish = chat_text("Plan STOP more.</think>Answer.", request={**REQUEST, "stop": "STOP"})
    assert (reasoning, content, finish) == ("Plan ", "", "stop")
    assert chat_text("Plan.</think>Ans STOP wer.", request={**REQUEST, "stop": ["STOP"]})[1] == "Ans "


def test_difference_turn_marker_text_ends_the_answer():
    # A turn marker the model writes ends its answer and never reaches the client (issue 16 item 2's rule);
    # deepseek-recipe passes it through as answer text.
    assert chat_text("Plan.</think>Hi.<｜User｜>Next question")[1] == "Hi."


def test_difference_parser_is_per_format():
    # deepseek-recipe's one state machine reads both V4 (`tool_calls`) and V4.1 (` calls`) blocks; ours reads the
    # format's own markup, and another format's stays text (ParsingOptions.format, from ConversionOptions.format).
    v4_block = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    request = {**REQUEST, "tools": [{"type": "function", "function": {"name": "f"}}]}
    _, content, calls, _ = chat_text("Plan.</think>" + v4_block, request=request)
    assert calls == [] and content == v4_block
    _, content, calls, finish = chat_text("Plan.</think>" + v4_block, request=request,
                                          options=ConversionOptions(format="deepseek-v4"))
    assert content is None and calls[0]["function"]["name"] == "f" and finish == "tool_calls"


def test_difference_incomplete_tail_is_kept():
    # Output that ends inside a character or a tool call: deepseek-recipe drops the undecoded ids (and does not
    # count them); we flush them as U+FFFD and count every id, and a tool call that never committed stays text.
    tokenizer = Tokenizer.from_file(TOKENIZER_FILE)
    ids = tokenizer.encode(THINKING_END_TOKEN + "ok 🦀")
    _, body = run_chat([InferenceChunk.token(t) for t in ids[:-1]], tokenizer=tokenizer)
    assert body["choices"][0]["message"]["content"] == "ok \ufffd"
    assert body["usage"]["completion_tokens"] == len(ids) - 1
    request = {**REQUEST, "tools": [{"type": "function", "function": {"name": "f"}}]}
    _, content, calls, finish = chat_text("Plan.</think>\n\n<｜DSML｜ calls>\n<｜DSML｜ inv", request=request)
    assert (content, calls, finish) == ("\n\n<｜DSML｜ calls>\n<｜DSML｜ inv", [], "stop")


def test_difference_text_after_the_tool_call_block_is_content():
    # deepseek-recipe drops output after the block's closing tag (ContentAfterFinished); we keep it as content,
    # after the text before the block: nothing the model wrote is lost.
    request = {**REQUEST, "tools": [{"type": "function", "function": {"name": "f"}}]}
    block = "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"f\">\n</｜DSML｜ invoke>\n</｜DSML｜ calls>"
    _, content, calls, finish = chat_text("Plan.</think>Hi." + block + " trailing", request=request)
    assert (content, [c["function"]["name"] for c in calls], finish) == ("Hi. trailing", ["f"], "tool_calls")


def test_json_object_output_keeps_only_the_json():
    # response_format json_object: parse_json_output, as deepseek-recipe's state machine reads it: the answer is the
    # JSON text, from a fence ("```json\n" or "```\n", dropped) or the first "{" or "[", to the next "\n```".
    request = {**REQUEST, "messages": [{"role": "user", "content": "Answer in JSON."}],
               "response_format": {"type": "json_object"}}
    assert ChatCompletionRequest(request).convert().parsing_options.parse_json_output
    assert not ChatCompletionRequest(REQUEST).convert().parsing_options.parse_json_output
    responses = {"input": "Answer in JSON.", "text": {"format": {"type": "json_object"}}}
    assert ResponsesRequest(responses).convert().parsing_options.parse_json_output
    answer = "Sure: ```json\n{\"a\": 1}\n``` done"
    assert chat_text("Plan.</think>" + answer, request=request)[:2] == ("Plan.", "{\"a\": 1}")
    assert chat_text("Plan.</think>Here: [1, {\"b\": 2}]", request=request)[1] == "[1, {\"b\": 2}]"
    _, body = run_chat([InferenceChunk.text(c) for c in "Plan.</think>" + answer], request)  # any chunking
    assert body["choices"][0]["message"]["content"] == "{\"a\": 1}"


def test_difference_json_output_drops_the_text_around_the_json():
    # deepseek-recipe turns each piece of text around the JSON into one space (how many depends on how the output
    # was chunked); we drop it, so the content is the JSON text alone however it arrives.
    request = {**REQUEST, "messages": [{"role": "user", "content": "json"}], "response_format": {"type": "json_object"}}
    assert chat_text("Plan.</think>Here it is: {\"a\": 1}", request=request)[1] == "{\"a\": 1}"


def test_partial_marker_at_the_end_is_text():
    # Both: a tail that could still have become a marker is flushed as text when the output ends.
    assert chat_text("Plan.</think>Answer </thi")[:2] == ("Plan.", "Answer </thi")
    assert chat_text("Plan </thi")[:2] == ("Plan </thi", "")


MARKER_TEXTS = ("say <｜DSML｜ calls> please", "a <tool_result> b", "img <｜deepseek_image｜> x")
DSML_ID = 128825  # ｜DSML｜ in DeepSeek-V4's and V4.1's tokenizers (and the v4_tokenizer fixture)


@pytest.mark.parametrize("encoding", [DeepseekV41Encoding, ds.DeepseekV4Encoding])
def test_marker_text_in_user_content_is_ordinary_text(encoding, v4_tokenizer):
    # With a tokenizer that has ｜DSML｜ as a token (V4's, V4.1's), marker text in request text is ordinary text,
    # tokenized untrusted: the prompt's ｜DSML｜ ids are only its own markup's (deepseek-recipe 0.2 accepts it too).
    history = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_token = encoding().with_tokenizer(v4_tokenizer)
    for text in MARKER_TEXTS:
        messages = [{"role": "user", "content": "hi"}, *history, {"role": "user", "content": text}]
        converted = ChatCompletionRequest({"messages": messages, "tools": tools}).convert()
        prompt = with_token.render_conversation(converted.conversation).prompt
        assert text in prompt
        ids = with_token.encode(converted.conversation)
        assert ids.count(DSML_ID) == prompt.count("｜DSML｜") - text.count("｜DSML｜") > 0


def test_marker_text_needs_a_tokenizer_with_the_dsml_token():
    # With DeepSeek-V3's tokenizer (the one this package ships), or none, the model could not tell marker text from
    # the prompt's markup: a ValueError naming the field, never text silently altered.
    v3 = Tokenizer.from_file(TOKENIZER_FILE)
    converted = ChatCompletionRequest({"messages": [{"role": "user", "content": MARKER_TEXTS[0]}]}).convert()
    for encoding in (DeepseekV41Encoding(), DeepseekV41Encoding().with_tokenizer(v3)):
        with pytest.raises(ValueError, match=r"messages\[0\]\.content contains '｜DSML｜'.*no '｜DSML｜' token"):
            encoding.render_conversation(converted.conversation)
    with pytest.raises(ValueError, match="no '｜DSML｜' token"):
        DeepseekV41Encoding().with_tokenizer(v3).encode(converted.conversation)


def test_image_placeholder_is_the_reference_encoders():
    # encoding_dsv41.py writes <｜deepseek_image｜> (id 129264 in V4.1's tokenizer); deepseek-recipe's constant is
    # <｜image｜>. Ours names the reference's, so IMAGE_SPECIAL_TOKEN is what the prompt holds.
    assert (ds.IMAGE_SPECIAL_TOKEN, ds.IMAGE_SPECIAL_TOKEN_ID) == ("<｜deepseek_image｜>", 129264)


def test_v4_encoding_renders_deepseek_v4():
    converted = ChatCompletionRequest({**REQUEST, "reasoning_effort": "max"}).convert(
        ConversionOptions(format="deepseek-v4"))
    prompt = ds.DeepseekV4Encoding().render_conversation(converted.conversation).prompt
    assert prompt == converted.conversation.render_text("deepseek-v4")[0]
    assert "Beyond maximum" in prompt  # the 0731 revision's max preamble (thinking mode: the default)
    assert converted.parsing_options.format == "deepseek-v4"


# ---- tool_choice required / named: the tool-call block is pre-filled, parsing starts inside it --------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
FORCED = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS,
          "thinking": {"type": "disabled"}}
OPENERS = {"deepseek-v4": "\n\n<｜DSML｜tool_calls>\n", "deepseek-v4.1": "\n\n<｜DSML｜ calls>\n"}
ENCODINGS = {"deepseek-v4": ds.DeepseekV4Encoding, "deepseek-v4.1": DeepseekV41Encoding}


def forced_call(fmt, name):
    """What the model writes after the pre-filled opener: one call, then the block's end."""
    p, block = (" ", " calls") if fmt == "deepseek-v4.1" else ("", "tool_calls")
    return (f"<｜DSML｜{p}invoke name=\"{name}\">\n<｜DSML｜{p}parameter name=\"city\" string=\"true\">Paris"
            f"</｜DSML｜{p}parameter>\n</｜DSML｜{p}invoke>\n</｜DSML｜{block}>")


@pytest.mark.parametrize("fmt", sorted(OPENERS))
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_choice_prefills_the_block_and_parsing_starts_inside_it(fmt, tool_choice):
    request = {**FORCED, "tool_choice": tool_choice}
    options = ConversionOptions(format=fmt)
    converted = ChatCompletionRequest(request).convert(options)
    parsing = converted.parsing_options
    assert parsing.tool_call_initial_stage and parsing.parse_tool_calls and parsing.reasoning_initial_stage is None
    prompt = ENCODINGS[fmt]().render_conversation(converted.conversation).prompt
    assert prompt.endswith("<｜Assistant｜></think>" + OPENERS[fmt])
    name = "get_weather" if tool_choice == "required" else "get_time"
    assert ("get_weather" in prompt) == (name == "get_weather")  # a named choice describes only that function
    output = forced_call(fmt, name)
    for pieces in ([output], list(output)):
        _, body = run_chat([InferenceChunk.text(piece) for piece in pieces], request, options=options)
        choice = body["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("tool_calls", None)
        (call,) = choice["message"]["tool_calls"]
        assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == (name, {"city": "Paris"})


def test_forced_tool_choice_in_messages_gives_a_tool_use_block():
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"}}

    def infer(prompt):
        assert prompt.endswith(OPENERS["deepseek-v4.1"])
        yield InferenceChunk.text(forced_call("deepseek-v4.1", "get_weather"))

    out = serve("messages", body, infer)
    (block,) = out["content"]
    assert (block["type"], block["name"], block["input"], out["stop_reason"]) == (
        "tool_use", "get_weather", {"city": "Paris"}, "tool_use")


def test_forced_tool_choice_with_thinking_is_a_conversion_error():
    # The pre-filled block would open where the reasoning starts (the renderer refuses it too); thinking is on by
    # default in this API, so the message says how to turn it off.
    request = {**FORCED, "tool_choice": "required"}
    del request["thinking"]
    with pytest.raises(ConversionError, match="cannot be combined with thinking.*default_thinking_mode") as error:
        ChatCompletionRequest(request).convert()
    assert json.loads(error.value.body)["error"]["param"] == "tool_choice"
    with pytest.raises(ConversionError, match="naming the function 'get_time' cannot be combined with thinking"):
        ChatCompletionRequest({**request, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                               "thinking": {"type": "enabled"}}).convert()
    converted = ChatCompletionRequest(request).convert(ConversionOptions(default_thinking_mode=False))
    assert converted.parsing_options.tool_call_initial_stage


def test_prefilled_block_needs_tool_parsing():
    # Starting inside the block with tool calls not parsed would read the block as text: refused, not ignored.
    generator = ChatCompletionRequest.chunk_generator(ChatCompletionRequest(REQUEST).convert(), "id", "model")
    with pytest.raises(ValueError, match="tool_call_initial_stage.*parse_tool_calls"):
        StreamProcessor(generator, ParsingOptions(tool_call_initial_stage=True, parse_tool_calls=False))


# ---- both APIs over one core ------------------------------------------------------------------------------

def test_both_apis_give_the_same_prompt_and_conversation():
    payload = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
               "thinking": {"type": "enabled"}}
    seed = Conversation.from_openai(payload)
    converted = ChatCompletionRequest(payload).convert(ConversionOptions()).conversation
    assert seed.render_text("deepseek-v4.1") == converted.render_text("deepseek-v4.1")
    rebuilt = Conversation(messages=converted.messages, tools=converted.tools, thinking_mode=True)
    assert rebuilt.render_text("deepseek-v4.1") == seed.render_text("deepseek-v4.1")
    assert [type(m).__name__ for m in converted.messages] == ["SystemMessage", "UserMessage"]
    assert converted.tools == [ToolDefinition("f", parameters={"type": "object"})]
