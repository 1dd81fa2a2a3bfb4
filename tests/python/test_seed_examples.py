"""The seed's gateway examples (examples/python), run against the installed module on scripted token streams:
production_gateway_recipe.py as plain functions, production_affinity_gateway.py as a FastAPI app served by
TestClient, its prefill and decode nodes played by httpx.MockTransport. No network."""
import asyncio
import hashlib
import importlib.util
import json
import os

import pytest

import deepseek_recipe as ds
from conftest import EOS, ROOT

EXAMPLES = os.path.join(ROOT, "examples", "python")
MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
PAYLOAD = {
    "model": "deepseek-v4.1-flash",
    "stream": True,
    "messages": [
        {"role": "system", "content": "You are a travel assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather",
                                                "parameters": SCHEMA}}],
}
# What DeepSeek-V4.1 writes after the chat-mode prompt: a sentence, then a DSML tool call (its grammar).
CALL = ("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n"
        "<｜DSML｜ parameter name=\"city\" string=\"true\">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls>")


def load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_recipe_example_renders_like_from_openai():
    example = load("production_gateway_recipe")
    payload = dict(PAYLOAD, messages=PAYLOAD["messages"] + [
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_0", "content": "Sunny, 21°C"},
        {"role": "user", "content": "And tomorrow?"}], chat_template_kwargs={"thinking": True})
    rendered = example.handle_chat_completion_request(payload)
    assert isinstance(rendered, ds.RenderedInput)
    expected = ds.Conversation.from_openai(payload).render_for_engine(tokenizer_model=MODEL)
    assert rendered.format == "deepseek-v4.1"
    assert rendered.text == expected.text and rendered.token_ids == expected.token_ids
    assert rendered.text.endswith("<｜Assistant｜><think>")


def test_recipe_example_parses_a_scripted_stream(tokenizer):
    example = load("production_gateway_recipe")
    stream = tokenizer.encode("<think>The user wants the weather.</think>Let me check." + CALL + EOS)
    result = example.parse_engine_stream_output(stream)
    assert result["reasoning_chunk"] == "The user wants the weather."
    assert result["content_chunk"] == "Let me check."
    (call,) = result["detected_tool_calls"]
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris"})


def test_affinity_gateway_serves_the_seed_flow(tokenizer, monkeypatch):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    gateway = load("production_affinity_gateway")
    decode_ids = tokenizer.encode("Let me check the weather in Paris." + CALL + EOS)
    prefill_requests = []

    async def decode_chunks():  # the decode node streams "id,id,...," chunks, as the seed assumes
        for start in range(0, len(decode_ids), 5):
            yield ("".join("%d," % i for i in decode_ids[start:start + 5])).encode()
            await asyncio.sleep(0)

    def nodes(request):
        body = json.loads(request.content)
        if request.url.path == "/execute_prefill":
            prefill_requests.append((str(request.url), body))
            return httpx.Response(200, json={"kv_session_id": "kv-42"})
        assert request.url.path == "/stream_decode" and body == {"kv_session_id": "kv-42"}
        assert str(request.url).startswith(gateway.DECODE_SUPERNODE)
        return httpx.Response(200, content=decode_chunks())

    real_client = httpx.AsyncClient
    monkeypatch.setattr(gateway.httpx, "AsyncClient",
                        lambda **kwargs: real_client(transport=httpx.MockTransport(nodes), **kwargs))

    with TestClient(gateway.app) as client:
        response = client.post("/v1/chat/completions", json=PAYLOAD)
        again = client.post("/v1/chat/completions", json=dict(PAYLOAD, temperature=0.7))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")

    # Prefill got the exact prompt ids, JSON-encoded by httpx from rendered_input.token_ids.
    expected = ds.Conversation.from_openai(PAYLOAD).render_for_engine(tokenizer_model=MODEL)
    url, body = prefill_requests[0]
    assert body["tokens"] == expected.token_ids
    assert body["target_decode_node"] == gateway.DECODE_SUPERNODE
    # Session affinity: the prefix hash picks the node, the same one for the same conversation prefix.
    prefix_hash = hashlib.sha256("You are a travel assistant.What is the weather in Paris?".encode()).hexdigest()
    assert body["session_hash"] == prefix_hash
    assert url == gateway.PREFILL_NODES[int(prefix_hash, 16) % 4] + "/execute_prefill"
    assert prefill_requests[1][0] == url

    # The SSE stream: content deltas as the seed writes them, the tool-call markup parsed away, then [DONE].
    events = [line[len("data: "):] for line in response.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
    assert all(list(d) == ["content"] for d in deltas)
    assert "".join(d["content"] for d in deltas) == "Let me check the weather in Paris."
    assert again.text == response.text
