"""
production_affinity_gateway.py
生产级 API 网关：前缀一致性哈希路由 + deepseek-recipe 协议桥接 + 流式解耦

The seed's second gateway example (FastAPI + httpx), runnable. Lines the seed shows are kept as it wrote them;
what its text leaves out (the node addresses, the route, steps 1-2) is filled in and marked "filled in".
tests/python/test_seed_examples.py serves it with FastAPI's TestClient against scripted prefill and decode
nodes (httpx.MockTransport): no network.

Note, as in the seed: the SSE lines are built with f-strings, so a delta holding a quote or a newline makes
invalid JSON; a real gateway would write json.dumps({"choices": [{"delta": {...}}]}). And the parser starts in
content: after a thinking-mode prompt pass starts_in_reasoning=True, or use rendered_input.stream_parser().
"""
import hashlib
from typing import List, Dict, Any
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
import httpx
import deepseek_recipe as ds_recipe

app = FastAPI(title="DeepSeek Production Gateway")

# (filled in) the prefill pool and the decode supernode
PREFILL_NODES = ["http://192.168.10.101:8001", "http://192.168.10.102:8001",
                 "http://192.168.10.103:8001", "http://192.168.10.104:8001"]
DECODE_SUPERNODE = "http://192.168.10.111:8002"


def compute_prefix_hash(messages: List[Dict[str, str]]) -> str:
    """
    提取 System Prompt 与首轮对话文本，计算 64 位哈希指纹用于会话亲和性路由
    """
    prefix_str = ""
    for msg in messages:
        if msg["role"] in ["system", "user"]:
            prefix_str += msg["content"]
            if len(prefix_str) > 2048:
                break
    return hashlib.sha256(prefix_str.encode("utf-8")).hexdigest()


@app.post("/v1/chat/completions")  # (filled in)
async def chat_completions(request: Request):
    payload = await request.json()

    # 1. 前缀亲和性路由：同一会话前缀总是落到同一个 Prefill 节点 (filled in)
    p_hash = compute_prefix_hash(payload["messages"])
    selected_p_node = PREFILL_NODES[int(p_hash, 16) % len(PREFILL_NODES)]

    # 2. deepseek-recipe：OpenAI 请求 -> DeepSeek 原生 Token 流 (filled in)
    conversation = ds_recipe.Conversation.from_openai(payload)
    rendered_input = conversation.render_for_engine(
        tokenizer_model="deepseek-ai/DeepSeek-V4.1-Flash",
        add_generation_prompt=True
    )
    
    # 3. 异步向 Prefill 节点发起计算，Prefill 算完后自动通过 RDMA 推送至 Decode 节点
    async with httpx.AsyncClient(timeout=60.0) as client:
        p_resp = await client.post(
            f"{selected_p_node}/execute_prefill",
            json={
                "tokens": rendered_input.token_ids,
                "target_decode_node": DECODE_SUPERNODE,
                "session_hash": p_hash
            }
        )
        prefill_meta = p_resp.json()

    # 4. 转向 Decode 超节点发起流式生成，并通过 deepseek-recipe 实时拆解 <think>
    async def token_generator():
        parser = ds_recipe.StreamOutputParser(tokenizer_model="deepseek-ai/DeepSeek-V4.1-Flash")
        
        async with httpx.AsyncClient(timeout=300.0) as client:
            async with client.stream(
                "POST",
                f"{DECODE_SUPERNODE}/stream_decode",
                json={"kv_session_id": prefill_meta["kv_session_id"]}
            ) as stream:
                async for chunk in stream.aiter_bytes():
                    # 假定 chunk 包含生成的 Token ID 序列
                    token_ids = [int(x) for x in chunk.decode().split(",") if x]
                    for tid in token_ids:
                        ev = parser.step(tid)
                        if ev.is_reasoning():
                            yield f"data: {{\"choices\": [{{\"delta\": {{\"reasoning_content\": \"{ev.text()}\"}}}}]}}\n\n"
                        elif ev.is_content():
                            yield f"data: {{\"choices\": [{{\"delta\": {{\"content\": \"{ev.text()}\"}}}}]}}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(token_generator(), media_type="text/event-stream")
