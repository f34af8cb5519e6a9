"""Environment servers (docs/environment_servers.md): any environment object served over HTTP, as a Ray Serve
application next to the pool or as a process of its own.

:func:`environment_app` is the FastAPI app that serves one environment at ``POST /reset``, ``POST /step`` and
``GET /healthz`` -- the stateless protocol :class:`rollout.episodes.env_http.HttpEnvironment` speaks (the episode's
state travels as JSON with every call, so any replica answers). :func:`deploy_environment` runs it as the Serve
application ``inflight-env-<name>`` at route prefix ``/env/<name>`` of the cluster's Serve HTTP proxy (the pool
has ``/``; the longest prefix wins, so both live on one port) and returns its URL; :func:`shutdown_environment`
removes it. :func:`serve_environment_main` is ``inflight env serve module:Class --port 8300``: uvicorn in the
foreground.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr
from ray import serve

from rollout.episodes.environment import AsyncEnvironment, Environment, EnvStep, Message, Turn

APP_PREFIX = "inflight-env-"
"""Serve application name of environment ``<name>``: ``inflight-env-<name>``."""
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DEFAULT_HTTP_PORT = 8123
"""Port of the Serve proxy when this is the first Serve application (the pool's ``rollout_pool.http_port``)."""
_TURN_FIELDS = {f.name for f in dataclasses.fields(Turn)}


class ResetBody(BaseModel):
    """``POST /reset``: the prompt's task."""

    task: dict[str, Any]


class TurnBody(BaseModel):
    """The sampled turn of ``POST /step``."""

    text: StrictStr
    token_ids: list[StrictInt] = Field(default_factory=list)
    final: StrictBool = False
    """The engine's last turn of the episode (its turn or token budget is spent)."""


class StepBody(BaseModel):
    """``POST /step``: the state the last answer gave and the turn to answer."""

    state: Any
    turn: TurnBody


def environment_app(env: Environment[Any] | AsyncEnvironment[Any], name: str) -> FastAPI:
    """A FastAPI app serving ``env`` (plain methods run on the thread pool, ``async`` ones on the loop).
    Answers: 200 with the protocol's JSON; 422 for a request body that is not the protocol's (naming the field);
    500 when the environment raises, answers something that is not ``(state, list[Message])`` / an ``EnvStep``,
    or keeps a state that is not JSON -- each with a ``detail`` that names the environment."""
    if not (isinstance(name, str) and name):
        raise ValueError(f"environment_app name: expected a non-empty string, got {name!r}")
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise TypeError(f"environment {name!r}: {type(env).__name__} has no method {method}(); see "
                            f"rollout.episodes.environment.Environment")
    app = FastAPI(title=f"Inflight environment {name!r}", version="1", docs_url=None, redoc_url=None,
                  openapi_url=None)  # no API pages: /docs loads scripts from a CDN (docs/security.md)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"body field {_loc(e.get('loc', ()))!r}: {e.get('msg', '')}" for e in exc.errors())
        return JSONResponse({"detail": f"environment {name!r}: {request.method} {request.url.path}: {problems}"},
                            status_code=422)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "environment": name}

    @app.post("/reset")
    async def reset(body: ResetBody) -> Response:
        got = await _run(env.reset, name, "reset", body.task)
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], list)
                and all(isinstance(m, Message) for m in got[1])):
            raise HTTPException(500, f"environment {name!r}: reset returned {_short(got)}, expected "
                                     f"(state, list[Message])")
        state, messages = got
        return _answer(name, "reset", state, {"messages": [m.to_chat() for m in messages]})

    @app.post("/step")
    async def step(body: StepBody) -> Response:
        state = body.state
        turn_args: dict[str, Any] = {"text": body.turn.text, "token_ids": tuple(body.turn.token_ids)}
        if "final" in _TURN_FIELDS:
            turn_args["final"] = body.turn.final
        got = await _run(env.step, name, "step", state, Turn(**turn_args))
        if not isinstance(got, EnvStep):
            raise HTTPException(500, f"environment {name!r}: step returned {_short(got)}, expected an EnvStep")
        return _answer(name, "step", state, {
            "observation": [m.to_chat() for m in got.observation], "done": got.done, "reward": got.reward,
            "components": got.components, "info": got.info, "failure": got.failure})

    return app


async def _run(method: Callable[..., Any], name: str, what: str, *args: Any) -> Any:
    try:
        if inspect.iscoroutinefunction(method):
            return await method(*args)
        got = await run_in_threadpool(method, *args)
        return await got if inspect.isawaitable(got) else got
    except Exception as exc:  # noqa: BLE001 - the environment's error goes to the client with its text
        raise HTTPException(500, f"environment {name!r}: {what} raised {type(exc).__name__}: {exc}") from None


def _answer(name: str, what: str, state: Any, rest: dict[str, Any]) -> Response:
    """The answer as JSON; the rest of it is checked by ``EnvStep`` / ``Message``, so only the state can fail."""
    try:
        content = json.dumps({"state": state, **rest}, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise HTTPException(500, f"environment {name!r}: {what} left a state of type {type(state).__name__} that "
                                 f"is not JSON ({exc}); an environment served over HTTP keeps its state in JSON "
                                 f"values (dicts, lists, strings, numbers)") from None
    return Response(content, media_type="application/json")


def _loc(loc: Any) -> str:
    parts = [str(p) for p in loc if p != "body"]
    return ".".join(parts) or "(body)"


def _short(value: object, limit: int = 120) -> str:
    text = f"{type(value).__name__} {value!r}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def build_environment_object(environment_path: str, kwargs: dict[str, Any] | None, name: str) -> Any:
    """An instance of the class at ``environment_path`` (a registered name, ``module:Class`` or
    ``file.py:Class``) made with ``kwargs``; a ``ValueError`` that names the environment otherwise."""
    from rollout.episodes.env_registry import load_environment_class

    cls = load_environment_class(environment_path)
    try:
        return cls(**dict(kwargs or {}))
    except Exception as exc:  # noqa: BLE001 - a bad kwarg is the user's error, said with the environment
        raise ValueError(f"environment {name!r}: {environment_path}(**kwargs) failed: "
                         f"{type(exc).__name__}: {exc}") from None


REPLICA_STOP_POLL_S = 0.2
"""How often a stopping Serve replica (the pool's, an environment server's) looks for unfinished requests. Serve's
default, 2 s, is waited before the first look, so every ``serve.delete`` took at least 2 s; requests still running
are waited for as before (``graceful_shutdown_timeout_s``)."""


@serve.deployment(num_replicas=1, max_ongoing_requests=256, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=30, max_constructor_retry_count=3,
                  graceful_shutdown_wait_loop_s=REPLICA_STOP_POLL_S)
@serve.ingress()
class EnvironmentServer:
    """One replica of an environment server: builds the environment once and serves it with
    :func:`environment_app` (the app is made after the constructor, by Serve's ``__serve_build_asgi_app__``)."""

    def __init__(self, name: str, environment_path: str, kwargs: dict[str, Any]):
        self.name = name
        self.env = build_environment_object(environment_path, kwargs, name)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return environment_app(self.env, self.name)


class EnvironmentDeployError(RuntimeError):
    """An environment server did not start; the message gives the reason (its application was removed)."""


def app_name(name: str) -> str:
    """The Serve application name of environment ``name``."""
    return APP_PREFIX + name


def deploy_environment(name: str, environment_path: str, kwargs: dict[str, Any] | None = None,
                       route_prefix: str | None = None, num_replicas: int = 1, *, http_host: str = "127.0.0.1",
                       http_port: int = DEFAULT_HTTP_PORT, num_cpus: float = 0.0, max_ongoing_requests: int = 256,
                       ready_timeout_s: float = 120.0) -> str:
    """Deploy (or update) the environment class at ``environment_path`` built with ``kwargs`` as the Serve
    application ``inflight-env-<name>`` with ``num_replicas`` replicas at ``route_prefix`` (default
    ``/env/<name>``) on the connected Ray cluster; wait until ``/healthz`` answers through the proxy and return
    the URL to give :class:`~rollout.episodes.env_http.HttpEnvironment` (``env.<name>.url``). ``http_host`` /
    ``http_port`` (0: a free port) apply only when Serve is not running yet; otherwise its proxy is used as is.
    A server that does not start is removed and :class:`EnvironmentDeployError` says why."""
    import httpx

    from rollout.episodes.env_registry import load_environment_class
    from services.cluster.head import free_port
    from services.pool.startup import reason

    if not (isinstance(name, str) and NAME_PATTERN.match(name)):
        raise ValueError(f"environment server name: expected 1-64 of [A-Za-z0-9_.-], got {name!r}")
    prefix = f"/env/{name}" if route_prefix is None else route_prefix
    if not (prefix.startswith("/") and prefix != "/" and not prefix.endswith("/")):
        raise ValueError(f"environment {name!r}: route_prefix: expected '/<path>' without a trailing '/' (the "
                         f"pool has '/'), got {prefix!r}")
    if isinstance(num_replicas, bool) or not (isinstance(num_replicas, int) and num_replicas >= 1):
        raise ValueError(f"environment {name!r}: num_replicas: expected an integer >= 1, got {num_replicas!r}")
    load_environment_class(environment_path)  # an import error is said here, before Serve is involved
    from ray.serve.context import _get_global_client

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:  # Serve is not running: this is its first application
        serve.start(http_options={"host": http_host, "port": http_port or free_port()})
        client = _get_global_client()
    assert client is not None
    host, port = client.http_config.host, client.http_config.port
    if host in ("0.0.0.0", "::", ""):
        import ray

        host = ray.util.get_node_ip_address()
    url = f"http://{host}:{port}{prefix}"
    deployment = EnvironmentServer.options(num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                                           ray_actor_options={"num_cpus": num_cpus})
    try:
        serve.run(deployment.bind(name, environment_path, dict(kwargs or {})), name=app_name(name),
                  route_prefix=prefix, blocking=False)
        deadline = time.monotonic() + ready_timeout_s
        last = "no answer yet"
        with httpx.Client(timeout=5.0, trust_env=False) as http:
            while True:
                try:
                    got = http.get(f"{url}/healthz")
                    if got.status_code == 200:
                        break
                    last = f"HTTP {got.status_code}: {got.text[:200]}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                if time.monotonic() > deadline:
                    raise TimeoutError(f"GET {url}/healthz did not answer 200 in {ready_timeout_s:g}s ({last})")
                time.sleep(0.2)
    except Exception as exc:  # noqa: BLE001 - the application is removed and the reason raised
        why = _replica_error(name) or reason(exc)
        shutdown_environment(name)
        raise EnvironmentDeployError(f"environment server {name!r} ({environment_path}) did not start: "
                                     f"{why} (its Serve application was removed)") from None
    return url


def _replica_error(name: str) -> str | None:
    """The last line of what Serve says of the application's deployment (a failed constructor's traceback ends
    with the exception that names the cause), or None."""
    try:
        app = serve.status().applications.get(app_name(name))
        messages = [d.message for d in app.deployments.values() if d.message] if app is not None else []
    except Exception:  # noqa: BLE001 - the status is only a better reason; the caller has one
        return None
    lines = [ln.strip() for m in messages for ln in m.splitlines() if ln.strip()]
    return lines[-1] if lines else None


def shutdown_environment(name: str) -> None:
    """Remove the Serve application of environment ``name`` (nothing if there is none)."""
    serve.delete(app_name(name))


def serve_environment_main(argv: list[str] | None = None) -> int:
    """``inflight env serve ENVIRONMENT [--host H] [--port P] [--kwargs JSON] [--name N]``: serve one environment
    with uvicorn in the foreground until interrupted. Returns the exit status (2: a usage error)."""
    import uvicorn

    parser = argparse.ArgumentParser(prog="inflight env serve",
                                     description="Serve an environment over HTTP (docs/environment_servers.md).")
    parser.add_argument("environment", help="a registered name, module:Class or file.py:Class")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--kwargs", default="{}", help="constructor keyword arguments, a JSON object")
    parser.add_argument("--name", default=None, help="the name failures carry (default: the class name)")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    args = parser.parse_args(argv)
    name = args.name or args.environment.rpartition(":")[2] or args.environment
    try:
        kwargs = json.loads(args.kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError(f"expected a JSON object, got {type(kwargs).__name__}")
    except ValueError as exc:
        print(f"inflight: --kwargs: {exc}", file=sys.stderr)
        return 2
    try:
        env = build_environment_object(args.environment, kwargs, name)
        app = environment_app(env, name)
    except (ValueError, TypeError) as exc:
        print(f"inflight: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
