"""Any ``run(task, client)`` agent served over HTTP in NeMo-Gym's shape: no Inflight import (docs/agents.md).

    python recipes/agents/agent_server.py --agent recipes/agents/calculator_agent.py --port 8200

``POST /run`` takes a JSON object: the task's fields, and the model endpoint of the sample's session as
``policy_base_url``, ``policy_api_key`` and ``policy_model_name`` (NeMo-Gym's names); it plays one episode with
an ``openai.AsyncOpenAI`` client on that endpoint and answers ``{"reward": <number>}``. ``GET /healthz`` answers
``{"ok": true}``. An agent that raises answers HTTP 500 with the reason (Inflight fails the sample with it).
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import openai
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

ENDPOINT_KEYS = ("policy_base_url", "policy_api_key", "policy_model_name")


def load_run(path: str):
    """``run`` of the Python file at ``path``."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--agent: no Python file at {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.run


def make_app(run) -> FastAPI:
    app = FastAPI(title="agent server", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.post("/run")
    async def run_episode(request: Request):
        body = await request.json()
        missing = [k for k in ENDPOINT_KEYS if not isinstance(body.get(k), str)]
        if missing:
            return JSONResponse({"error": f"missing {missing}"}, status_code=422)
        client = openai.AsyncOpenAI(base_url=body.pop("policy_base_url"), api_key=body.pop("policy_api_key"))
        body.pop("policy_model_name")
        try:
            reward = await run(body, client)
        except Exception as exc:  # noqa: BLE001 - the reason goes back to the trainer
            return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)
        finally:
            await client.close()
        return {"reward": reward}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--agent", required=True, help="a Python file defining async def run(task, client)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    uvicorn.run(make_app(load_run(args.agent)), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
