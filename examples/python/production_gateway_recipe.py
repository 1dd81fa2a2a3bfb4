"""
production_gateway_recipe.py
基于 deepseek-recipe 实现生产级 API 协议统一转换与思考链/工具调用分离

The seed's first gateway example, runnable. Lines the seed shows are kept as it wrote them; the steps its text
leaves out (2 and 4 of handle_chat_completion_request, the loop of parse_engine_stream_output) are filled in
and marked "filled in". tests/python/test_seed_examples.py runs it on scripted token streams.
"""
from typing import Dict, Any, List
import deepseek_recipe as ds_recipe


def handle_chat_completion_request(payload: Dict[str, Any]) -> ds_recipe.RenderedInput:
    """
    接收标准 OpenAI 格式的请求体，通过 deepseek-recipe 编译为原生 Token 流
    """
    # 1. 构造统一的结构化对话模型
    conversation = ds_recipe.Conversation()

    # 2. 思考模式与对话历史 (filled in)
    conversation.set_reasoning_mode(bool(payload.get("chat_template_kwargs", {}).get("thinking", False)))
    if payload.get("reasoning_effort") is not None:
        conversation.set_reasoning_effort(payload["reasoning_effort"])
    for msg in payload["messages"]:
        if msg["role"] == "system":
            conversation.add_system_message(msg["content"])
        elif msg["role"] == "user":
            conversation.add_user_message(msg["content"])
        elif msg["role"] == "assistant":
            conversation.add_assistant_message(msg.get("content"),
                                               reasoning_content=msg.get("reasoning_content"),
                                               tool_calls=msg.get("tool_calls"))
        elif msg["role"] == "tool":
            conversation.add_tool_result(msg["tool_call_id"], msg["content"])

    # 3. 动态绑定工具调用定义 (Function Calling)
    if "tools" in payload:
        for tool in payload["tools"]:
            conversation.register_tool(
                name=tool["function"]["name"],
                description=tool["function"].get("description", ""),
                parameters=tool["function"].get("parameters", {})
            )

    # 4. 渲染为引擎可执行的 Token ID 向量 (filled in)
    return conversation.render_for_engine(
        tokenizer_model="deepseek-ai/DeepSeek-V4.1-Flash",
        add_generation_prompt=True
    )


def parse_engine_stream_output(raw_token_stream: List[int]) -> Dict[str, Any]:
    """
    流式反序列化模型输出：状态机无缝解耦 <think>...</think> 与 Tool Call
    """
    parser = ds_recipe.StreamOutputParser(tokenizer_model="deepseek-ai/DeepSeek-V4.1-Flash")
    
    parsed_result = {
        "reasoning_chunk": "",
        "content_chunk": "",
        "detected_tool_calls": []
    }

    # (filled in)
    for token_id in raw_token_stream:
        ev = parser.step(token_id)
        if ev.is_reasoning():
            parsed_result["reasoning_chunk"] += ev.text()
        elif ev.is_content():
            parsed_result["content_chunk"] += ev.text()
        if ev.is_tool_call_completed():
            parsed_result["detected_tool_calls"].append(ev.get_tool_call())

    return parsed_result


if __name__ == "__main__":  # (filled in) a demonstration: `PYTHONPATH=build/python-site python3 <this file>`
    rendered = handle_chat_completion_request({
        "messages": [{"role": "user", "content": "What is the weather in Tokyo?"}],
    })
    print("prompt:", len(rendered.token_ids), "token ids")
    # An answer as the engine would stream it: token ids of the same (shipped) tokenizer.
    answer = ds_recipe.Tokenizer("deepseek-ai/DeepSeek-V4.1-Flash").encode("It is mild and clear in Tokyo.")
    print(parse_engine_stream_output(answer))
