"""The pool of the OpenAI-serving and agent tests, shared by both modules: one engine of the tiny model serving
``/v1/chat/completions`` with the hermes tool parser, whose episodes an agent server plays (``env.agents.agent``).
The ``served`` fixture (conftest.py) deploys it once per session; :func:`agent_app` is that agent server."""
from __future__ import annotations

import asyncio

import openai
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

POOL_NAME = "inflight-openai-pool"
TOKEN = "openai-admin-token"
CHAT = "policy.generation.vllm_cfg.http_server_serving_chat_kwargs"
OVERRIDES = (f"rollout_pool.name={POOL_NAME}", "rollout_pool.num_engines=1", "rollout_pool.route_prefix=/openai-pool",
             "policy.generation.vllm_cfg.expose_http_server=true", f"{CHAT}.enable_auto_tools=true",
             f"{CHAT}.tool_parser=hermes", f"{CHAT}.reasoning_parser=granite",  # granite's marks are text
             "policy.max_total_sequence_length=1024")  # the tools turn of the tiny tokenizer is ~300 tokens
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}

AGENT_TIMEOUT_S = 20
"""The pool's bound on an agent episode. The "ok" episode's two chat completions took over 6 s on the 2-core
machine beside another test session (two xdist workers): the bound must leave them room."""
SERVED_IDS: dict[str, list[list[int]]] = {}
"""The token ids each ``ok`` episode of the agent server was answered, per call (by the task's ``key``)."""


def agent_app() -> FastAPI:
    """An agent server in NeMo-Gym's shape; what an episode does is its task's ``mode``."""
    app = FastAPI()

    @app.post("/run")
    async def run(request: Request) -> Response:
        body = await request.json()
        if body["mode"] == "timeout":
            await asyncio.sleep(AGENT_TIMEOUT_S + 2)
        if body["mode"] == "http500":
            return Response("agent crashed", status_code=500)
        if body["mode"] == "malformed":
            return Response("{not json", media_type="application/json")
        client = openai.AsyncOpenAI(base_url=body["policy_base_url"], api_key=body["policy_api_key"], max_retries=0)
        messages, ids = list(MESSAGES), []
        for _ in range(2):
            answer = await client.chat.completions.create(
                model=body["policy_model_name"], messages=messages, max_tokens=6, logprobs=True,
                extra_body={"return_tokens_as_token_ids": True})
            choice = answer.choices[0]
            ids.append([int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content])
            messages += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "More."}]
        await client.close()
        SERVED_IDS[body["key"]] = ids
        return JSONResponse({"reward": 0.25, "response": {}})

    return app
