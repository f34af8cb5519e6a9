"""The rollout pool's Serve deployment: the learner's handle API and the HTTP routes, delegating to the parts.

One replica is the pool's controller and HTTP ingress: ``GET /healthz``,
``/readyz`` (503 until every engine is loaded at a known version), ``/metrics``
(Prometheus), ``/v1/status``, ``/v1/history`` and the live status page ``/``
(:mod:`services.pool.status_page`, read-only like them), and ``POST /v1/admin/{pause,resume,drain,scale}`` with
``Authorization: Bearer <token>``; with ``vllm_cfg.expose_http_server``, OpenAI's ``POST /v1/chat/completions``
and ``GET /v1/models`` for agents (:mod:`services.pool.openai_api`, docs/agents.md). The work is done by the
parts it builds: the :class:`~services.pool.fleet.Fleet` (engines, their table), the
:class:`~services.pool.dispatch.Dispatcher` (prompts), the
:class:`~services.pool.watcher.HealthWatcher`, and the pool halves of the
weight transports (:mod:`services.refit`). Serve copies this class into the
replica: everything it uses is imported at the top of this module.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request, Response
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError
from ray import serve

from protocol.pool_replies import EngineStatsReply, EvaluationReply, PoolStatus, UndeliveredPrompt
from services.pool.agent_driver import PoolAccess
from services.pool.dispatch import Dispatcher
from services.pool.env_server import REPLICA_STOP_POLL_S
from services.pool.fleet import MAX_DRAIN_TIMEOUT_S, Fleet, ScaleError, ScaleRequestError, ScaleResult
from services.pool.metrics import PoolMetrics
from services.pool.openai_api import (
    SESSION_HEADER,
    ChatLimits,
    ChatOutcome,
    ChatPlaces,
    OpenAIError,
    SessionRoutes,
    check_chat_body,
    check_key,
    check_session,
    model_list,
    rollout_key_secret,
)
from services.pool.status_page import StepHistory, TokenRates, render_page, security_headers
from services.pool.streaming import ClosingStreamingResponse
from services.pool.watcher import HealthWatcher
from services.recipe.config import Recipe
from services.refit.collective import GroupPlan, WeightGroup
from services.refit.cuda_ipc import IpcFanout, IpcPlan
from services.refit.object_store import ObjectStoreFanout
from services.refit.result import RefitResult

app = FastAPI(title="Inflight rollout pool", version="1", docs_url=None, redoc_url=None, openapi_url=None)
"""No ``/docs``, ``/redoc`` or ``/openapi.json``: nobody asked for them, and ``/docs`` loads scripts from a CDN
(docs/security.md)."""


class ScaleRequest(BaseModel):
    """The body of ``POST /v1/admin/scale``."""

    model_config = ConfigDict(extra="forbid")
    engines: StrictInt
    """Engines the pool should have: within ``rollout_pool.num_engines``' bounds (1..1024), checked by the pool
    with the rest of its recipe as at deploy."""
    drain_timeout_s: float | None = Field(default=None, ge=0.0, le=MAX_DRAIN_TIMEOUT_S)
    """Longest a removed engine's batches may take to finish before they are handed back to the others;
    default ``policy.generation.request_timeout_s`` (at most 3600 s)."""


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=60,
                  graceful_shutdown_wait_loop_s=REPLICA_STOP_POLL_S)
@serve.ingress(app)
class RolloutPool:
    def __init__(self, recipe_json: str, model_path: Any, admin_token: str, base_url: str = ""):
        self.recipe = Recipe.model_validate_json(recipe_json)
        self.name = self.recipe.rollout_pool.name
        self._token = admin_token
        self.metrics = PoolMetrics()
        self._last_report: dict | None = None
        """The learner's last step report (without its per-group lists), for ``status``."""
        self.history = StepHistory()
        """The scalars of the last step reports, for the status page's plots and ``/v1/history``."""
        self.token_rates = TokenRates()
        access = PoolAccess(base_url, rollout_key_secret(admin_token)) if base_url else None
        self.fleet = Fleet(self.recipe, model_path, self.metrics, access)
        self.dispatcher = Dispatcher(self.fleet)
        refit_timeout_s = self.recipe.policy.refit_timeout_s
        self.fanout = ObjectStoreFanout(self.fleet, refit_timeout_s)
        self.group = WeightGroup(self.fleet, refit_timeout_s)
        self.ipc = IpcFanout(self.fleet, refit_timeout_s)
        self.watcher = HealthWatcher(self.fleet, self.dispatcher, self.fanout.reinstall)
        self._boot: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self._chat_routes = SessionRoutes()
        """The engine of each chat call: one per rollout session, round robin outside sessions."""
        self._chats = ChatPlaces(self.recipe.policy.generation.vllm_cfg.max_num_seqs, self.metrics.openai_running,
                                 self.metrics.openai_requests)
        """Chat requests admitted at once (more are refused with 429): one engine's ``max_num_seqs``."""

    def _ensure_started(self) -> None:
        """Start the engines and the health watcher on the loop that serves requests.

        (Not in the constructor: with a FastAPI ingress Serve runs ``__init__`` on a loop that stops
        afterwards, which would freeze any task started there — measured.)"""
        if self._boot is None:
            loop = asyncio.get_running_loop()
            self._boot = loop.create_task(self.fleet.start())
            self._monitor = loop.create_task(self.watcher.watch())

    # ------------------------------------------------------------ learner API (DeploymentHandle)
    async def wait_ready(self, timeout_s: float = 600.0) -> PoolStatus:
        self._ensure_started()
        await asyncio.wait_for(self.fleet.ready.wait(), timeout_s)
        return await self.status()

    async def attach(self, learner_id: str, channel: Any) -> PoolStatus:
        self._ensure_started()
        self.dispatcher.attach(learner_id, channel)
        return await self.status()

    async def detach(self, learner_id: str) -> None:
        self.dispatcher.detach(learner_id)

    async def take_undelivered(self, learner_id: str) -> list[UndeliveredPrompt]:
        return self.dispatcher.take_undelivered(learner_id)

    async def submit(self, prompt_bytes: list[bytes], group_size: int) -> int:
        return self.dispatcher.submit(prompt_bytes, group_size)

    async def evaluate(self, prompt_bytes: list[bytes], num_generations: int, temperature: float,
                       timeout_s: float) -> EvaluationReply:
        """Validation: scored groups of ``num_generations`` answers at ``temperature`` (0: greedy), returned to
        the caller and never put into a trajectory channel (:meth:`Dispatcher.evaluate`)."""
        self._ensure_started()
        return await self.dispatcher.evaluate(prompt_bytes, num_generations, temperature, timeout_s)

    async def push(self, manifest_bytes: bytes, bucket_refs: list, reset: bool = False,
                   timeout_s: float | None = None) -> RefitResult:
        """An object-store push: every engine that is up installs it (:class:`ObjectStoreFanout`)."""
        return await self.fanout.push(manifest_bytes, bucket_refs, reset, timeout_s)

    async def weight_group_current(self) -> bool:
        return self.group.current()

    async def engines_wanting_weights(self) -> list[str]:
        return self.group.wanting_weights()

    async def weight_group_plan(self, timeout_s: float) -> GroupPlan:
        return await self.group.plan(timeout_s)

    async def join_weight_group(self, host: str, port: int, plan: GroupPlan, timeout_s: float) -> GroupPlan:
        return await self.group.join(host, port, plan, timeout_s)

    async def install_group_push(self, reset: bool = False, timeout_s: float | None = None) -> RefitResult:
        """A collective push: every engine of the weight group installs it (:class:`WeightGroup`)."""
        return await self.group.install(reset, timeout_s)

    async def ipc_plan(self, gpu: str) -> IpcPlan:
        """Which engines could map buffers of the learner's GPU ``gpu`` (:class:`IpcFanout`)."""
        return await self.ipc.plan(gpu)

    async def install_ipc_push(self, manifest_bytes: bytes, shares: list, gpu: str, reset: bool = False,
                               timeout_s: float | None = None) -> RefitResult:
        """A CUDA IPC push: the engine on the learner's GPU maps the shared buckets and installs them."""
        return await self.ipc.install(manifest_bytes, shares, gpu, reset, timeout_s)

    async def logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                          engine_id: str | None = None, image_prompts: list[bytes] | None = None) -> list[list[float]]:
        """One engine's response log-probs; ``image_prompts``: per sequence, an encoded ``PromptRequest`` whose
        ``images`` are the prompt's (vision-language prompts)."""
        return await self.fleet.logprobs_of(prompt_ids, response_ids, engine_id, image_prompts)

    async def take_session(self, session: str) -> list:
        """The :class:`~services.pool.token_capture.CapturedCompletion` s served in rollout ``session`` (its
        ``/v1/chat/completions`` calls with that ``x-inflight-session``), from every engine; forgotten there."""
        parts = await asyncio.gather(*(h.take_session.remote(session) for h in self.fleet.handles.values()))
        return [c for part in parts for c in part]

    async def sleep_engines(self) -> None:
        await self.fleet.sleep()

    async def wake_engines(self) -> None:
        await self.fleet.wake()

    async def report_step(self, report: dict) -> None:
        self.metrics.record_step(report)
        self._last_report = {k: v for k, v in report.items() if k not in ("trajectory_ages", "rejected")}
        try:  # the history plots steps; a report without one still counts in the metrics above
            self.history.record(report, self.dispatcher.learner.id if self.dispatcher.learner else None)
        except ValueError as exc:
            logging.getLogger("inflight.pool").warning("pool %s: status page history skipped a report: %s",
                                                       self.name, exc)

    async def engine_stats(self) -> dict[str, EngineStatsReply]:
        return await self.fleet.engine_stats()

    async def status(self) -> PoolStatus:
        self._ensure_started()
        d = self.dispatcher
        return PoolStatus(name=self.name, version=self.fleet.version, ready=self.fleet.is_ready(), pid=os.getpid(),
                          learner=d.learner, paused=d.paused, draining=d.draining,
                          engines=self.fleet.table.snapshot(self.fleet.version),
                          uptime_s=time.time() - self.fleet.started_at, requeued_prompts=d.requeued_prompts,
                          waiting_prompts=d.waiting_prompts(), undelivered_prompts=len(d.undelivered),
                          errors=self.fleet.errors[-5:], last_report=self._last_report)

    async def shutdown_engines(self) -> None:
        await self.fleet.shutdown()

    async def scale(self, engines: int, drain_timeout_s: float | None = None) -> ScaleResult:
        """Add or remove engines while the pool serves (:meth:`Fleet.scale`): a new engine takes work once it
        holds the pool's version; a removed one finishes its batches or hands them back."""
        return await self.fleet.scale(engines, self.watcher.admit, self.dispatcher.drain, drain_timeout_s)

    def colocation_group(self) -> Any:
        """The colocation placement group (colocated recipes on GPUs; None otherwise): learner rank ``j`` takes
        half of GPU slot ``j``, engine ``i`` of ``k`` GPUs the slots ``k*i .. k*i+k-1``
        (:mod:`services.recipe.gpu_layout`). A learner job places its ranks with it."""
        return self.fleet.colocation

    def check_health(self) -> None:
        """Serve's periodic replica health check: fails if the health watcher died."""
        if self._monitor is not None and self._monitor.done() and not self._monitor.cancelled():
            raise RuntimeError(f"pool monitor stopped: {self._monitor.exception()!r}")

    # ------------------------------------------------------------ HTTP
    @app.get("/healthz")
    async def healthz(self):
        return {"status": "ok", "pool": self.name}

    @app.get("/readyz")
    async def readyz(self, response: Response):
        ready = self.fleet.is_ready()
        if not ready:
            response.status_code = 503
        table = self.fleet.table
        return {"ready": ready, "version": self.fleet.version, "learner_attached": self.dispatcher.learner is not None,
                "engines": {e: table[e].up for e in table}}

    @app.get("/metrics")
    async def metrics_endpoint(self):
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def status_endpoint(self):
        return (await self.status()).to_json()

    @app.get("/v1/history")
    async def history_endpoint(self):
        return self.history.as_json()

    @app.get("/", response_class=HTMLResponse)
    async def status_page(self):
        await self.token_rates.sample(self.fleet.handles)
        page = render_page((await self.status()).to_json(), list(self.history.points), self.token_rates.rates(),
                           time.time(), self.fleet.recipe.rollout_pool.route_prefix)
        return HTMLResponse(page, headers=security_headers())

    def _authorize(self, authorization: str | None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self._token.encode()):
            raise HTTPException(status_code=401, detail="admin endpoints need 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.post("/v1/admin/pause")
    async def admin_pause(self, authorization: str | None = Header(default=None)):
        self._authorize(authorization)
        self.dispatcher.paused = True
        return {"paused": True}

    @app.post("/v1/admin/resume")
    async def admin_resume(self, authorization: str | None = Header(default=None)):
        self._authorize(authorization)
        return {"paused": False, "released_batches": self.dispatcher.resume()}

    @app.post("/v1/admin/drain")
    async def admin_drain(self, authorization: str | None = Header(default=None)):
        self._authorize(authorization)
        self.dispatcher.draining = True
        return {"draining": True}

    @app.post("/v1/admin/scale")
    async def admin_scale(self, request: Request, authorization: str | None = Header(default=None)):
        """Body :class:`ScaleRequest`; answers with the :class:`ScaleResult` once done (422: a bad value, 409:
        refused, 503: adding engines failed)."""
        self._authorize(authorization)
        try:
            body = ScaleRequest.model_validate_json(await request.body())
        except ValidationError as err:
            why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in err.errors())
            raise HTTPException(status_code=422, detail=f'the body must be JSON {{"engines": N}}: {why}') from None
        try:
            return asdict(await self.scale(body.engines, body.drain_timeout_s))
        except ScaleRequestError as err:
            raise HTTPException(status_code=422, detail=str(err)) from None
        except ScaleError as err:
            raise HTTPException(status_code=409 if err.outcome == "refused" else 503, detail=str(err)) from None

    # ------------------------------------------------------------ OpenAI-compatible serving (docs/agents.md)
    def _openai_gate(self, authorization: str | None) -> str | None:
        """Refuse unless the pool serves OpenAI requests and the key is good; the session a rollout key binds."""
        if not self.recipe.policy.generation.vllm_cfg.expose_http_server:
            raise OpenAIError(404, "this pool does not serve OpenAI requests "
                                   "(policy.generation.vllm_cfg.expose_http_server is false)", "NotFoundError")
        return check_key(authorization, self._token)

    @app.get("/v1/models")
    async def openai_models(self, authorization: str | None = Header(default=None)):
        try:
            self._openai_gate(authorization)
        except OpenAIError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return model_list(self.recipe.policy.model_name, self.recipe.policy.max_total_sequence_length,
                          self.fleet.version, int(self.fleet.started_at))

    @app.post("/v1/chat/completions")
    async def openai_chat(self, request: Request, authorization: str | None = Header(default=None)):
        """Checked here (:func:`check_chat_body`), answered by a serving engine's vLLM (round robin); the head
        ``x-inflight-policy-version`` is the version that engine served when it admitted the request."""
        self._ensure_started()
        try:
            bound = self._openai_gate(authorization)
            session = check_session(request.headers.get(SESSION_HEADER), bound)
            body = await request.body()
            check_chat_body(body, ChatLimits(self.recipe.policy.max_total_sequence_length))
            if bound is None:  # an agent the driver runs waits for a place (the driver bounds its episodes)
                self._chats.refuse_if_full()
            eid = self._chat_routes.engine_for(session, self.fleet.serving(), self.fleet.table.up())
            if eid is None:
                raise OpenAIError(503, f"pool {self.name!r}: no engine serving version {self.fleet.version}",
                                  "ServiceUnavailableError")
            await self._chats.take()
        except OpenAIError as err:
            return JSONResponse(err.body(), status_code=err.status)
        timeout_s = self.recipe.policy.generation.request_timeout_s
        chunks = None
        try:
            chunks = self.fleet.handles[eid].chat_completion.options(num_returns="streaming").remote(body, session)
            head = await asyncio.wait_for(await chunks.__anext__(), timeout_s)
            headers = {"x-inflight-policy-version": str(head.version), "x-inflight-engine": eid}
            if not head.stream:
                answer = await asyncio.wait_for(await chunks.__anext__(), timeout_s)
                self._chats.give_back("ok")
                return Response(answer, status_code=head.status, media_type="application/json", headers=headers)
        except asyncio.CancelledError:  # the caller hung up (Serve cancels the handler): stop the engine's request
            self._hang_up(chunks, "hung_up")
            raise
        except Exception as exc:  # noqa: BLE001 - the engine failed or timed out: a 503 in OpenAI's shape
            self._hang_up(chunks, "engine_error")
            err = OpenAIError(503, f"engine {eid}: {type(exc).__name__}: {exc}"[:1000], "ServiceUnavailableError")
            return JSONResponse(err.body(), status_code=err.status)

        async def relay():
            outcome: ChatOutcome = "hung_up"  # unless the stream ends or fails: the caller left before its end
            try:
                async for ref in chunks:
                    yield await ref
                outcome = "ok"
            except Exception:
                outcome = "engine_error"
                raise
            finally:
                if outcome == "ok":
                    self._chats.give_back(outcome)
                else:  # stopped in the engine too
                    self._hang_up(chunks, outcome)

        return ClosingStreamingResponse(relay(), status_code=head.status, media_type="text/event-stream",
                                        headers=headers)

    def _hang_up(self, chunks: Any, outcome: ChatOutcome) -> None:
        """Give a chat request's place back and cancel its engine call (None: it was never made): the engine's
        generator is cancelled inside the actor, and vLLM aborts the request when its output stream is closed
        (``AsyncLLM.generate``)."""
        import ray

        self._chats.give_back(outcome)
        if chunks is None:
            return
        try:
            ray.cancel(chunks)
        except Exception:  # a call that already ended has nothing to cancel
            logging.getLogger("inflight.pool").debug("cancelling a finished chat call", exc_info=True)
