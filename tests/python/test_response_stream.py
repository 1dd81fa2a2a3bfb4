"""ResponseStream: the recipe's output builder and response builders (what `deepinfer serve` sends) from Python,
per dialect: the chunk sequence, the SSE bytes, the whole body, stop strings, usage and stream errors."""
import json

import pytest

import deepseek_recipe as ds
from conftest import EOS

MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
OUTPUT = ("Need the weather.</think>Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
          "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n"
          "</｜DSML｜ calls>")


def stream(dialect, **options):
    return ds.ResponseStream(dialect, id="id-1", model="m", created=5, tokenizer_model=MODEL,
                             starts_in_reasoning=dialect != "completions", **options)


def feed(response, tokenizer, text):
    chunks = response.start(prompt_tokens=3, cached_tokens=1)
    for token_id in tokenizer.encode(text + EOS):
        chunks += response.push_token(token_id)
    return chunks + response.finish("stop")


def test_chat_chunks_and_body(tokenizer):
    response = stream("chat_completions", include_usage=True)
    chunks = feed(response, tokenizer, OUTPUT)
    assert all(chunk.event is None for chunk in chunks)
    assert chunks[0].data["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1].done and chunks[-1].to_sse() == "data: [DONE]\n\n"
    assert chunks[-2].data["usage"] == {"prompt_tokens": 3, "completion_tokens": response.completion_tokens,
                                        "total_tokens": 3 + response.completion_tokens,
                                        "prompt_tokens_details": {"cached_tokens": 1}}
    assert chunks[-3].data["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[1].to_sse().startswith('data: {"id":"id-1","object":"chat.completion.chunk","created":5,')
    reasoning = "".join(c.data["choices"][0]["delta"].get("reasoning_content", "") for c in chunks[:-2])
    assert reasoning == "Need the weather."
    body = response.response()
    message = body["choices"][0]["message"]
    assert (message["content"], message["reasoning_content"]) == ("Checking.", "Need the weather.")
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert response.message["tool_calls"][0]["name"] == "get_weather"
    assert response.response(id="other", created=9)["id"] == "other"


def test_messages_events(tokenizer):
    response = stream("messages")
    chunks = feed(response, tokenizer, OUTPUT)
    names = [chunk.event for chunk in chunks if chunk.event != "content_block_delta"]
    assert names == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                     "content_block_stop", "content_block_start", "content_block_stop", "message_delta",
                     "message_stop"]
    assert chunks[0].to_sse().startswith("event: message_start\ndata: {")
    body = response.response()
    assert [block["type"] for block in body["content"]] == ["thinking", "text", "tool_use"]
    # Anthropic's input_tokens leave out the cache reads (3 prompt tokens, 1 of them cached).
    assert body["usage"]["input_tokens"] == 2 and body["usage"]["cache_read_input_tokens"] == 1
    assert body["stop_reason"] == "tool_use"


def test_responses_events_and_echo(tokenizer):
    echo = ds._core.responses_echo({"input": "hi", "instructions": "Be brief."}, temperature=0.5)
    response = stream("responses", echo=echo)
    chunks = feed(response, tokenizer, OUTPUT)
    assert [c.data["sequence_number"] for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].event == "response.completed"
    body = response.response()
    assert [item["type"] for item in body["output"]] == ["reasoning", "message", "function_call"]
    assert (body["instructions"], body["temperature"], body["tool_choice"]) == ("Be brief.", 0.5, "auto")


def test_stop_string_ends_the_stream(tokenizer):
    response = stream("messages", stop=["STOP"])
    response.start()
    chunks = response.push_text("Plan.</think>Say STOP now", completion_tokens=4)
    assert response.finished and response.stop_string == "STOP"
    assert chunks[-1].event == "message_stop"
    assert response.finish() == [] and response.push_text("more") == []
    body = response.response()
    assert (body["stop_reason"], body["stop_sequence"], body["content"][1]["text"]) == ("stop_sequence", "STOP",
                                                                                         "Say ")
    assert body["usage"]["output_tokens"] == 4


def test_completions_and_errors(tokenizer):
    response = stream("completions")
    chunks = []
    for token_id in tokenizer.encode("plain text"):
        chunks += response.push_token(token_id)
    chunks += response.finish("length")
    assert "".join(c.data["choices"][0]["text"] for c in chunks if not c.done) == "plain text"
    assert response.response()["choices"][0]["finish_reason"] == "length"
    errors = stream("chat_completions").error(503, "shutting down")
    assert [e.done for e in errors] == [False, True]
    assert errors[0].data["error"]["type"] == "server_error"
    assert stream("messages").error(400, "bad")[0].to_sse().startswith("event: error\n")
    with pytest.raises(ValueError, match="dialect"):
        ds.ResponseStream("chat", id="x", model="m", tokenizer_model=MODEL)
