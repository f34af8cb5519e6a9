"""The rollout pool: a named Ray Serve application that outlives learners.

One Serve replica is the pool's controller and HTTP ingress. It owns
``rollout_pool.num_engines`` :class:`~services.engine_actor.EngineActor` s
(named, detached, restarted by Ray when their process dies), spreads prompt
batches over them (round robin), pushes weights to all of them, watches their health and
serves:

- ``GET /healthz``  the process is alive;
- ``GET /readyz``   every engine is loaded and its version known (503 otherwise);
- ``GET /metrics``  Prometheus text (see :mod:`services.metrics`);
- ``GET /v1/status`` JSON;
- ``POST /v1/admin/{pause,resume,drain}`` with ``Authorization: Bearer <token>``.

A learner job attaches by name (``serve.get_app_handle(name)``), gives the
pool its trajectory channel, and calls ``submit`` / ``update_weights``. When
the learner goes away the pool keeps running and serving its last version.

Faults (docs/reliability.md):

- **Engine death.** Each batch sent to an engine is tracked until the
  engine's ``generate`` call returns. If the actor's process dies the call
  fails with ``RayActorError``: the engine is marked down and the batch's
  prompts are re-queued. Ray restarts the actor; the health watcher (every
  ``HEALTH_PERIOD_S``, one task per engine, so a restart does not hold up the
  other engines' checks) starts its vLLM engine again and installs the current
  weights (``reset=True``) before the engine takes work, then the re-queued
  prompts go to the healthy engines (prompts submitted while no engine is
  healthy wait the same way). Groups the dead engine had already delivered
  come again; the learner drops those as duplicates.
- **vLLM engine core death** inside a live actor: its ``health`` asks vLLM
  and says not ok, its ``generate`` calls return their pending prompts as
  ``requeue`` (never reported failed) and its weight calls raise
  ``EngineDead``; the pool marks it down, re-queues those prompts, and the
  watcher has the actor restart vLLM in place (a new *incarnation*: the
  weight group is keyed by incarnation, not pid) and reinstalls the latest
  weights on it even if the version numbers match (``synced`` false).
- **Weight pushes** go to the engines that are up; an engine that is down
  gets the latest version from the watcher before it serves again (if none is
  up, the push waits for one, bounded by its timeout). A push
  that fails on an engine that is up is rejected as a whole (the pool's
  version does not advance) and counted in ``inflight_refit_failures``.
- **Collective pushes** (``policy.refit_transport: collective``) go over a
  weight group that the learner opens with the engines that are up
  (``weight_group_plan`` → ``join_weight_group``); the pool only tracks which
  engine processes are in it. An engine that restarts is not in the group: it
  takes no work until the learner, seeing ``weight_group_current`` false (or
  ``engines_wanting_weights`` while it waits for groups), re-forms the group
  and pushes its version again. A push that fails anywhere drops the group
  (its communicator state is unknown); the next attempt re-forms it.
- **A learner that stops reading.** An engine waits at most
  ``rollout_pool.channel_send_timeout_s`` for room in the channel, then gives
  the message up and goes on serving; ``generate`` returns the prompts it could
  not deliver. The pool counts them (``inflight_channel_send_failures``) and
  keeps them, with the reason, until the learner of that channel takes them
  (``take_undelivered``) to drop them with a reason and replace them.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from dataclasses import dataclass

from fastapi import FastAPI, Header, HTTPException, Response
from ray import serve

from services.cluster import free_port
from services.metrics import PoolMetrics

log = logging.getLogger("inflight.pool")
app = FastAPI(title="Inflight rollout pool", version="1")
HEALTH_PERIOD_S = 5.0
HEALTH_TIMEOUT_S = 10.0
HEALTH_TIMEOUTS_TO_DOWN = 3
"""Health checks in a row that may time out before an engine counts as down. An engine that is busy or starved
of CPU answers late; marking it down at once would make it flap (and re-form the weight group for nothing). A
dead process is noticed at once anyway: its calls fail with ``RayActorError``."""
LEARNER_CHECK = "learner"
"""The key of the learner channel's late checks (engine ids are ``<pool>-engine-<i>``)."""


class RefitError(RuntimeError):
    """A weight push was rejected or did not complete on every engine."""


@dataclass
class _Batch:
    """Prompts handed to one engine and not yet delivered; re-queued if the engine dies."""

    prompts: list[bytes]  # encoded PromptRequests
    group_size: int
    channel: object  # the TrajectoryChannel of the learner that submitted them


# Module-level names the replica uses are defined above the deployment class (measured: a helper defined
# below it raised NameError inside the replica).
def _refit_failure_reason(errors: list[BaseException]) -> str:
    """``timeout`` (a bucket or an engine did not answer in time), ``rejected`` (the push failed
    verification: missing bucket, bad checksum, shape, version) or ``failed`` (anything else)."""
    errors = [_cause(e) for e in errors]
    text = " ".join(f"{type(e).__name__}: {e}" for e in errors)
    if any(isinstance(e, (asyncio.TimeoutError, TimeoutError)) for e in errors):
        return "timeout"
    if "ProtocolError" in text or "WeightUpdateError" in text:
        return "rejected"
    return "failed"


def _engine_gone(exc: BaseException) -> bool:
    """The engine actor's process died or is restarting, or its vLLM engine core died (the watcher restarts it)."""
    import ray

    from rollout.liveness import EngineDead

    # RayActorError includes ActorUnavailableError (restarting)
    return isinstance(exc, ray.exceptions.RayActorError) or isinstance(_cause(exc), EngineDead)


def _cause(exc: BaseException) -> BaseException:
    """The engine's own exception inside a ``RayTaskError`` (whose text is mostly a traceback)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


@serve.deployment(num_replicas=1, max_ongoing_requests=1000, ray_actor_options={"num_cpus": 0},
                  health_check_period_s=10, health_check_timeout_s=60)
@serve.ingress(app)
class RolloutPool:
    def __init__(self, recipe_json: str, model_path, admin_token: str):
        from services.config import Recipe

        self.recipe = Recipe.model_validate_json(recipe_json)
        self.name = self.recipe.rollout_pool.name
        self.model_path = model_path
        self._token = admin_token
        self.metrics = PoolMetrics()
        self.engines: dict[str, object] = {}
        self.engine_state: dict[str, dict] = {}
        self._next_engine = 0
        self.version = 0
        self._latest_weights: tuple[bytes, list] | None = None
        self._weight_group: dict[str, str] | None = None  # engine id -> its incarnation, while in the group
        self.learner: dict | None = None
        self.channel = None
        self.paused = False
        self.draining = False
        self._held: list[tuple[list[bytes], int]] = []
        self._batches: set[asyncio.Task] = set()  # one per batch being generated by an engine
        self._waiting: list[_Batch] = []  # batches waiting for a healthy engine (theirs died, or none was up)
        self.requeued_prompts = 0
        self._undelivered: list[dict] = []  # prompts an engine could not deliver to the attached learner's channel
        self._refit_lock = asyncio.Lock()
        self._started_at = time.time()
        self._errors: list[str] = []
        self._counted: dict[str, dict[str, int]] = {}
        self._late_checks: dict[str, int] = {}
        """Health checks answered late in a row, by engine id (and ``LEARNER_CHECK``)."""
        self._ready = asyncio.Event()
        self._boot: asyncio.Task | None = None
        self._colocation = None
        self._monitor: asyncio.Task | None = None

    def _ensure_started(self) -> None:
        """Start the engines and the health monitor on the loop that serves requests.

        (Not in the constructor: with a FastAPI ingress Serve runs ``__init__`` on a loop that stops
        afterwards, which would freeze any task started there — measured.)"""
        if self._boot is None:
            loop = asyncio.get_running_loop()
            self._boot = loop.create_task(self._start_engines())
            self._monitor = loop.create_task(self._watch_engines())

    # ------------------------------------------------------------ engines
    async def _start_engines(self) -> None:
        """Place, create and boot the engines (:mod:`services.pool_startup`). Any error stops the start-up at
        once and removes what it made (engines, colocation group); the reason goes to ``errors`` and ``_ready``
        is set either way, so ``wait_ready`` answers at once and :func:`deploy` fails with the reason."""
        from services.placement import colocation_group
        from services.pool_startup import BOOT_TIMEOUT_S, boot_engines, create_engines, discard_engines, reason

        started: dict[str, dict] = {}
        try:
            self._colocation = await asyncio.to_thread(colocation_group, self.recipe, self.name)
            create_engines(self.recipe, self.name, self.model_path, self._colocation, into=self.engines)
            await boot_engines(self.engines, BOOT_TIMEOUT_S, started)
            for eid in self.engines:
                res = started[eid]
                self.engine_state[eid] = {"up": True, "version": res["version"], "pid": res["pid"], "error": None,
                                          "incarnation": res.get("incarnation")}
                self.metrics.engine_up.labels(engine=eid).set(1)
            self.metrics.policy_version.set(self.version)
        except Exception as exc:  # noqa: BLE001 - any start-up error fails the deploy, leaving nothing behind
            why = f"start-up failed: {reason(exc)}"[:500]
            log.error("pool %s: %s; removing its engines and placement group", self.name, why)
            self._errors.append(why)
            self._errors.extend(await discard_engines(self.engines, set(started), self._colocation))
            self._colocation = None
        finally:
            self._ready.set()

    async def _watch_engines(self) -> None:
        """Every ``HEALTH_PERIOD_S``: check the learner, then each engine in a task of its own, so that one
        engine restarting (tens of seconds while vLLM starts) does not hold up the checks of the others."""
        await self._ready.wait()
        checks: dict[str, asyncio.Task] = {}
        try:
            while True:
                await asyncio.sleep(HEALTH_PERIOD_S)
                await self._check_learner()
                for eid in self.engines:
                    if eid not in checks or checks[eid].done():
                        checks[eid] = asyncio.get_running_loop().create_task(self._check_engine(eid))
                self._send_waiting()
        finally:
            for task in checks.values():
                task.cancel()

    async def _check_engine(self, eid: str) -> None:
        """Health-check one engine; restart its vLLM engine if it is down and bring it to the pool's
        version before it takes work again."""
        eng = self.engines[eid]
        try:
            h = await self._health(eid)
            if h is None:
                return  # late, not yet HEALTH_TIMEOUTS_TO_DOWN times in a row
            if not h["ok"]:  # a new actor process, or vLLM's engine core died inside the actor
                why = h.get("error") or "vLLM engine not running (actor restarted)"
                self._mark_down(eid, RuntimeError(f"{why}; starting it"))
                await asyncio.wait_for(eng.start.remote(), 600)
                h = await asyncio.wait_for(eng.health.remote(), HEALTH_TIMEOUT_S)
                if not h["ok"]:
                    raise RuntimeError(f"vLLM engine still not serving after a restart: {h.get('error')}")
            # A restarted vLLM serves the model on disk: reinstall even if its version happens to match.
            if (h["version"] != self.version or not h.get("synced", True)) and self._latest_weights is not None:
                async with self._refit_lock:
                    # Read again under the lock: a push may have landed meanwhile. A collective one clears
                    # _latest_weights (reading it unchecked raised TypeError and marked a healthy engine down).
                    if self._latest_weights is not None:
                        await self._apply_to(eid, *self._latest_weights, reset=True)
                        h["version"] = self.version
                    else:
                        h = await asyncio.wait_for(eng.health.remote(), HEALTH_TIMEOUT_S)
            self.engine_state[eid].update(up=True, version=h["version"], error=None, pid=h["pid"],
                                          incarnation=h.get("incarnation"))
            self.metrics.engine_up.labels(engine=eid).set(1)
            self._count(eid, await asyncio.wait_for(eng.stats.remote(), HEALTH_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - recorded, retried next period
            self._mark_down(eid, exc)
        self._send_waiting()

    async def _health(self, eid: str) -> dict | None:
        """The engine's health; None if it answered late fewer than ``HEALTH_TIMEOUTS_TO_DOWN`` times in a row
        (the last such timeout is raised)."""
        try:
            h = await asyncio.wait_for(self.engines[eid].health.remote(), HEALTH_TIMEOUT_S)
        except TimeoutError:
            if self._tolerate_late(eid, f"engine {eid}"):
                return None
            raise
        self._late_checks[eid] = 0
        return h

    def _tolerate_late(self, key: str, what: str) -> bool:
        """Count one more late answer of ``key`` (an engine id, or ``LEARNER_CHECK``); True (logged) while
        fewer than ``HEALTH_TIMEOUTS_TO_DOWN`` came in a row: busy or starved of CPU, not yet gone."""
        late = self._late_checks[key] = self._late_checks.get(key, 0) + 1
        if late >= HEALTH_TIMEOUTS_TO_DOWN:
            return False
        log.warning("pool %s: %s did not answer its health check within %g s (%d in a row)", self.name, what,
                    HEALTH_TIMEOUT_S, late)
        return True

    async def _check_learner(self) -> None:
        """A learner whose channel is gone (its job ended or was killed) is detached."""
        import ray

        if self.channel is None:
            return
        try:
            await asyncio.wait_for(self.channel.actor.size.remote(), HEALTH_TIMEOUT_S)
            self._late_checks[LEARNER_CHECK] = 0
        except TimeoutError:
            if not self._tolerate_late(LEARNER_CHECK, "the learner's channel"):
                self._detach_gone_learner()
        except ray.exceptions.RayActorError:
            self._detach_gone_learner()

    def _detach_gone_learner(self) -> None:
        log.warning("pool %s: learner %s is gone; detaching it", self.name, (self.learner or {}).get("id"))
        self.learner, self.channel = None, None
        self._undelivered.clear()
        self.metrics.learner_attached.set(0)

    def _count(self, eid: str, stats: dict) -> None:
        """Fold an engine's cumulative counters into the pool's Prometheus counters (deltas; a restarted
        engine starts from zero again)."""
        now_in = stats.get("incarnation", stats.get("pid"))
        seen = self._counted.setdefault(eid, {"incarnation": now_in, "tokens": 0, "groups": 0})
        if seen["incarnation"] != now_in:
            seen.update(incarnation=now_in, tokens=0, groups=0)
        for key, stat, counter in (("tokens", "tokens_generated", self.metrics.generation_tokens),
                                   ("groups", "groups", self.metrics.groups_generated)):
            now = int(stats.get(stat, 0))
            if now > seen[key]:
                counter.inc(now - seen[key])
            seen[key] = now

    def _mark_down(self, eid: str, exc: BaseException) -> None:
        self.engine_state[eid].update(up=False, error=f"{type(exc).__name__}: {exc}"[:300])
        self.metrics.engine_up.labels(engine=eid).set(0)

    def _dispatch(self, prompt_bytes: list[bytes], group_size: int, channel, engines: list[str]) -> None:
        """Spread prompts over ``engines`` (round robin, continued across calls) and track each batch."""
        shares: dict[str, list[bytes]] = {e: [] for e in engines}
        for pb in prompt_bytes:
            shares[engines[self._next_engine % len(engines)]].append(pb)
            self._next_engine += 1
        for eid, part in shares.items():
            if part:
                batch = _Batch(part, group_size, channel)
                task = asyncio.get_running_loop().create_task(self._track(eid, batch))
                self._batches.add(task)
                task.add_done_callback(self._batches.discard)

    async def _track(self, eid: str, batch: _Batch) -> None:
        """Wait until ``eid`` has delivered ``batch``; if the engine's process dies first, re-queue it; if the call
        fails otherwise, hand its prompts to their learner as undelivered, with the cause."""
        import ray

        try:
            result = await self.engines[eid].generate.remote(batch.prompts, batch.group_size, batch.channel)
            self._record_undelivered(eid, batch, result["undelivered"])
            if result.get("engine_dead"):  # its vLLM engine core died: the pending prompts come back, unreported
                self._requeue(eid, _Batch([batch.prompts[i] for i in result["requeue"]], batch.group_size,
                                          batch.channel), RuntimeError(result["engine_dead"]))
        except ray.exceptions.RayActorError as exc:
            self._requeue(eid, batch, exc)
        except ray.exceptions.TaskCancelledError:  # shutdown_engines cancels running batches
            log.info("pool %s: batch of %d prompts on engine %s cancelled", self.name, len(batch.prompts), eid)
        except Exception as exc:  # noqa: BLE001 - a bug (the engine reports per-prompt failures itself)
            log.exception("pool %s: batch of %d prompts on engine %s failed", self.name, len(batch.prompts), eid)
            from protocol import PromptRequest, decode  # its groups will not come: the learner drops them at once
            why = f"generate on engine {eid} failed: {type(_cause(exc)).__name__}: {_cause(exc)}"[:500]
            self._keep_undelivered(eid, batch, [{"prompt_id": r.prompt_id, "scheduled_step": r.scheduled_step,
                                                 "reason": why} for r in (decode(p, expect=PromptRequest)
                                                                          for p in batch.prompts)])

    def _requeue(self, eid: str, batch: _Batch, exc: BaseException) -> None:
        """``eid`` died (its process or its vLLM engine core) before delivering ``batch``: mark it down and
        send the batch to the healthy engines (or let it wait for one)."""
        log.warning("pool %s: engine %s died with %d prompts in flight (%s); re-queueing them",
                    self.name, eid, len(batch.prompts), f"{type(exc).__name__}: {exc}"[:200])
        self._mark_down(eid, exc)
        if batch.prompts:
            self.requeued_prompts += len(batch.prompts)
            self.metrics.requeued_prompts.inc(len(batch.prompts))
            self._waiting.append(batch)
        self._send_waiting()

    def _record_undelivered(self, eid: str, batch: _Batch, undelivered: list[dict]) -> None:
        """Count the prompts ``eid`` could not deliver and keep them for their learner (if still attached)."""
        if not undelivered:
            return
        self.metrics.channel_send_failures.inc(len(undelivered))
        log.warning("pool %s: engine %s could not deliver %d groups to channel %s (first: %s)", self.name, eid,
                    len(undelivered), batch.channel.name, undelivered[0]["reason"])
        self._keep_undelivered(eid, batch, undelivered)

    def _keep_undelivered(self, eid: str, batch: _Batch, undelivered: list[dict]) -> None:
        """Keep prompts of ``batch`` whose groups will not come for its learner (``take_undelivered``), if attached."""
        if self.channel is not None and batch.channel.name == self.channel.name:
            self._undelivered.extend({**u, "engine_id": eid} for u in undelivered)

    def _send_waiting(self) -> None:
        """Send waiting batches to the healthy engines, if their learner is still attached."""
        healthy = self._healthy()
        if not self._waiting or not healthy:
            return
        waiting, self._waiting = self._waiting, []
        for batch in waiting:
            if self.channel is None or batch.channel.name != self.channel.name:
                log.warning("pool %s: dropping %d re-queued prompts: their learner is no longer attached",
                            self.name, len(batch.prompts))
                continue
            if self.paused:
                self._held.append((batch.prompts, batch.group_size))
            else:
                self._dispatch(batch.prompts, batch.group_size, batch.channel, healthy)

    def _healthy(self) -> list[str]:
        return [e for e, s in self.engine_state.items() if s.get("up") and s.get("version") == self.version]

    # ------------------------------------------------------------ learner API (DeploymentHandle)
    async def wait_ready(self, timeout_s: float = 600.0) -> dict:
        self._ensure_started()
        await asyncio.wait_for(self._ready.wait(), timeout_s)
        return await self.status()

    async def attach(self, learner_id: str, channel) -> dict:
        self._ensure_started()
        if self.learner and self.learner["id"] != learner_id:
            log.warning("pool %s: learner %s replaces %s", self.name, learner_id, self.learner["id"])
        if self.channel is not None and self.channel.name != channel.name:
            self._undelivered.clear()
        self.learner = {"id": learner_id, "since": time.time()}
        self.channel = channel
        self.metrics.learner_attached.set(1)
        return await self.status()

    async def detach(self, learner_id: str) -> None:
        if self.learner and self.learner["id"] == learner_id:
            self.learner, self.channel = None, None
            self._undelivered.clear()
            self.metrics.learner_attached.set(0)

    async def take_undelivered(self, learner_id: str) -> list[dict]:
        """Prompts the engines could not deliver to ``learner_id``'s channel since the last call (each
        ``{"prompt_id", "scheduled_step", "reason", "engine_id"}``); the learner drops and replaces them.
        Nothing is kept for a learner that is not attached (detaching clears them)."""
        if not self.learner or self.learner["id"] != learner_id:
            return []
        out, self._undelivered = self._undelivered, []
        return out

    async def submit(self, prompt_bytes: list[bytes], group_size: int) -> int:
        """Spread prompts over the healthy engines; groups go to the attached channel."""
        if self.channel is None:
            raise RuntimeError(f"pool {self.name!r}: no learner attached (attach before submitting)")
        if self.draining:
            raise RuntimeError(f"pool {self.name!r} is draining: not accepting prompts")
        if self.paused:
            self._held.append((prompt_bytes, group_size))
            return len(prompt_bytes)
        healthy = self._healthy()
        if healthy:
            self._dispatch(prompt_bytes, group_size, self.channel, healthy)
        else:  # e.g. the only engine is restarting: the watcher sends them once one is back
            log.warning("pool %s: no healthy engine at version %d; %d prompts wait for one",
                        self.name, self.version, len(prompt_bytes))
            self._waiting.append(_Batch(prompt_bytes, group_size, self.channel))
        return len(prompt_bytes)

    async def update_weights(self, manifest_bytes: bytes, bucket_refs: list, reset: bool = False,
                             timeout_s: float | None = None) -> dict:
        """Push one version to every engine that is up, within ``timeout_s`` (default ``policy.refit_timeout_s``)
        for the buckets and again for the engines.

        Atomic per engine; the pool's version advances only if every engine that is up installed it.
        Engines that are down, or die during the push, get it from the watcher before they serve again."""
        import ray

        from protocol import WeightManifest, decode

        timeout_s = timeout_s or self.recipe.policy.refit_timeout_s
        t0 = time.perf_counter()
        await self._some_engine_up(timeout_s)
        async with self._refit_lock:
            try:
                manifest = decode(manifest_bytes, expect=WeightManifest)
                # The pool keeps its own copy of the buckets for engines that restart later.
                datas = await asyncio.wait_for(asyncio.gather(*bucket_refs), timeout_s)
            except Exception as exc:  # noqa: BLE001 - classified, counted and raised with the cause
                raise self._refit_failed("?", {"pool": exc}) from None
            owned = [ray.put(d) for d in datas]
            targets = [e for e in self.engines if self.engine_state.get(e, {}).get("up", True)]
            # An engine that installed this very version in an attempt that failed elsewhere keeps it: the
            # learner's retry would otherwise be rejected there as "not newer" (a reset push installs again).
            installed = [] if reset else [e for e in targets
                                          if self.engine_state.get(e, {}).get("version") == manifest.version]
            targets = [e for e in targets if e not in installed]
            results = await asyncio.gather(*[self._apply_to(eid, manifest_bytes, owned, reset, timeout_s)
                                             for eid in targets], return_exceptions=True)
            failed: dict[str, BaseException] = {}
            for eid, res in zip(targets, results):
                if _engine_gone(res):  # restarted later with the latest weights
                    self._mark_down(eid, res)
                elif isinstance(res, BaseException):
                    failed[eid] = res
                else:
                    installed.append(eid)
            if failed or not installed:
                raise self._refit_failed(manifest.version, failed or {"pool": RuntimeError("no engine is up")})
            seconds = time.perf_counter() - t0
            self.version = manifest.version
            self._latest_weights = (manifest_bytes, owned)
            self.metrics.policy_version.set(self.version)
            self.metrics.refit_seconds.observe(seconds)
            self.metrics.refit_bytes.inc(manifest.total_bytes * len(installed))
            return {"version": self.version, "seconds": seconds, "bytes": manifest.total_bytes,
                    "engines": len(installed)}

    # ------------------------------------------------------------ collective pushes
    def _up(self) -> dict[str, str]:
        """Engines that are up -> their incarnation (process and vLLM start; a vLLM restarted inside the same
        process has left the weight group, though its pid is the same)."""
        return {e: s.get("incarnation") for e, s in self.engine_state.items() if s.get("up")}

    async def weight_group_current(self) -> bool:
        """True while the weight group holds exactly the engine incarnations that are up."""
        return self._weight_group is not None and self._weight_group == self._up()

    async def engines_wanting_weights(self) -> list[str]:
        """Engines that are up but not at the pool's version (restarted; waiting for a push)."""
        return [e for e, s in self.engine_state.items() if s.get("up") and s.get("version") != self.version]

    async def weight_group_plan(self, timeout_s: float) -> dict:
        """Ranks a new weight group gives the engines that are up (rank 0 is the learner; an engine takes
        one rank per vLLM worker) and its world size; waits at most ``timeout_s`` for an engine to be up."""
        await self._some_engine_up(timeout_s)
        up = list(self._up())
        if not up:
            raise self._refit_failed("?", {"pool": RuntimeError("no engine is up")})
        sizes = await asyncio.gather(*[asyncio.wait_for(self.engines[e].weight_group_members.remote(),
                                                        HEALTH_TIMEOUT_S) for e in up])
        ranks, world = {}, 1
        for eid, n in zip(up, sizes):
            ranks[eid], world = world, world + int(n)
        return {"ranks": ranks, "world_size": world}

    async def join_weight_group(self, host: str, port: int, plan: dict, timeout_s: float) -> dict:
        """Have the planned engines join the learner's weight group at ``host:port`` (the learner joins as
        rank 0 at the same time); bounded by ``timeout_s``."""
        async with self._refit_lock:
            self._weight_group = None
            eids = list(plan["ranks"])
            results = await asyncio.gather(*[asyncio.wait_for(self.engines[e].join_weight_group.remote(
                host, port, plan["ranks"][e], plan["world_size"], timeout_s), timeout_s + 60) for e in eids],
                return_exceptions=True)
            failed = self._group_failures(eids, results)
            if failed:
                raise self._refit_failed("?", failed)
            self._weight_group = {e: self.engine_state[e].get("incarnation") for e in eids}
            log.info("pool %s: weight group %s:%d formed with %s (world %d)", self.name, host, port, eids,
                     plan["world_size"])
            return {"engines": eids, "world_size": plan["world_size"]}

    async def receive_weights(self, reset: bool = False, timeout_s: float | None = None) -> dict:
        """Every engine of the weight group receives the learner's next push and installs it in flight.

        Atomic per engine; the pool's version advances only if all of them installed it. Any failure drops
        the group (the learner re-forms it before its next attempt)."""
        timeout_s = timeout_s or self.recipe.policy.refit_timeout_s
        t0 = time.perf_counter()
        async with self._refit_lock:
            if self._weight_group is None:
                raise self._refit_failed("?", {"pool": RuntimeError("no weight group: the learner must form "
                                                                    "one first (weight_group_plan)")})
            eids = list(self._weight_group)
            results = await asyncio.gather(*[asyncio.wait_for(self.engines[e].receive_weights.remote(reset),
                                                              timeout_s) for e in eids], return_exceptions=True)
            failed = self._group_failures(eids, results)
            if failed:
                self._weight_group = None
                raise self._refit_failed("?", failed)
            for eid, res in zip(eids, results):
                self.engine_state[eid]["version"] = res["version"]
            version = results[0]["version"]
            seconds = time.perf_counter() - t0
            self.version, self._latest_weights = version, None
            self.metrics.policy_version.set(version)
            self.metrics.refit_seconds.observe(seconds)
            self.metrics.refit_bytes.inc(sum(r["bytes"] for r in results))
            for r in results:
                self.metrics.refit_pause_seconds.observe(r["pause_s"])
                self.metrics.weight_installs.labels(path=r["install_path"]).inc()
            return {"version": version, "seconds": seconds, "bytes": max(r["bytes"] for r in results),
                    "engines": len(eids), "pause_seconds_max": max(r["pause_s"] for r in results),
                    "install_seconds_max": max(r["install_s"] for r in results),
                    "install_paths": sorted({r["install_path"] for r in results})}

    def _group_failures(self, eids: list[str], results: list) -> dict[str, BaseException]:
        """The engines of a weight-group call that failed; those whose process died are marked down (the
        watcher brings them back and the next plan leaves them out until then)."""
        failed = {e: r for e, r in zip(eids, results) if isinstance(r, BaseException)}
        for eid, exc in failed.items():
            if _engine_gone(exc):
                self._mark_down(eid, exc)
        return failed

    async def _some_engine_up(self, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` until an engine is up (the only one may be restarting: the watcher
        needs the refit lock to bring it back, so this waits outside it)."""
        deadline = time.monotonic() + timeout_s
        while not any(self.engine_state.get(e, {}).get("up", True) for e in self.engines):
            if time.monotonic() > deadline:
                return  # the push then fails with "no engine is up"
            await asyncio.sleep(1.0)

    def _refit_failed(self, version, failed: dict[str, BaseException]) -> RefitError:
        """Count a rejected or failed push (``inflight_refit_failures{reason}``) and describe it."""
        reason = _refit_failure_reason(list(failed.values()))
        self.metrics.refit_failures.labels(reason=reason).inc()
        detail = {where: f"{type(_cause(e)).__name__}: {_cause(e)}"[:300] for where, e in failed.items()}
        self._errors.append(f"refit v{version} {reason}: {detail}"[:300])
        return RefitError(f"pool {self.name!r}: weight push v{version} {reason}; the old version "
                          f"v{self.version} keeps serving: {detail}")

    async def _apply_to(self, eid: str, manifest_bytes: bytes, refs: list, reset: bool,
                        timeout_s: float | None = None) -> int:
        timeout_s = timeout_s or self.recipe.policy.refit_timeout_s
        version = await asyncio.wait_for(self.engines[eid].apply_weights.remote(manifest_bytes, refs, reset),
                                         timeout_s)
        self.engine_state.setdefault(eid, {}).update(version=version)
        return version

    async def logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                          engine_id: str | None = None) -> list[list[float]]:  # default: the first healthy engine
        eid = engine_id or (self._healthy() or list(self.engines))[0]
        return await asyncio.wait_for(self.engines[eid].logprobs_of.remote(prompt_ids, response_ids),
                                      self.recipe.policy.generation.request_timeout_s)

    async def sleep_engines(self) -> None:
        await asyncio.gather(*[e.sleep.remote() for e in self.engines.values()])

    async def wake_engines(self) -> None:
        await asyncio.gather(*[e.wake_up.remote() for e in self.engines.values()])

    async def report_step(self, report: dict) -> None:
        self.metrics.record_step(report)

    async def engine_stats(self) -> dict:
        out = {}
        for eid, eng in self.engines.items():
            try:
                out[eid] = await asyncio.wait_for(eng.stats.remote(), HEALTH_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001
                out[eid] = {"error": repr(exc)[:200]}
        return out

    async def status(self) -> dict:
        self._ensure_started()
        return {"name": self.name, "version": self.version, "ready": self._is_ready(), "pid": os.getpid(),
                "learner": self.learner, "paused": self.paused, "draining": self.draining,
                "engines": self.engine_state, "uptime_s": time.time() - self._started_at,
                "requeued_prompts": self.requeued_prompts,
                "waiting_prompts": sum(len(b.prompts) for b in self._waiting),
                "undelivered_prompts": len(self._undelivered),
                "errors": self._errors[-5:]}

    def _is_ready(self) -> bool:
        return self._ready.is_set() and bool(self.engine_state) and all(
            s.get("up") and s.get("version") is not None for s in self.engine_state.values())

    async def shutdown_engines(self) -> None:
        import ray

        for eng in self.engines.values():
            try:
                await asyncio.wait_for(eng.shutdown.remote(), 60)
            except Exception:  # noqa: BLE001 - killed below anyway
                pass
            ray.kill(eng, no_restart=True)
        self.engines.clear()
        if self._colocation is not None:
            ray.util.remove_placement_group(self._colocation)
            self._colocation = None

    def colocation_group(self):
        """The colocation placement group (colocated recipes on GPUs; None otherwise): learner rank ``j`` takes
        half of GPU slot ``j``, engine ``i`` of ``k`` GPUs the slots ``k*i .. k*i+k-1`` (services.placement).
        A learner job places its ranks with it."""
        return self._colocation

    def check_health(self) -> None:
        """Serve's periodic replica health check: fails if the health monitor died."""
        if self._monitor is not None and self._monitor.done() and not self._monitor.cancelled():
            raise RuntimeError(f"pool monitor stopped: {self._monitor.exception()!r}")

    # ------------------------------------------------------------ HTTP
    @app.get("/healthz")
    async def healthz(self):
        return {"status": "ok", "pool": self.name}

    @app.get("/readyz")
    async def readyz(self, response: Response):
        ready = self._is_ready()
        if not ready:
            response.status_code = 503
        return {"ready": ready, "version": self.version, "learner_attached": self.learner is not None,
                "engines": {e: s.get("up", False) for e, s in self.engine_state.items()}}

    @app.get("/metrics")
    async def metrics_endpoint(self):
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def status_endpoint(self):
        return await self.status()

    def _authorize(self, authorization: str | None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self._token.encode()):
            raise HTTPException(status_code=401, detail="admin endpoints need 'Authorization: Bearer <token>'",
                                headers={"WWW-Authenticate": "Bearer"})

    @app.post("/v1/admin/pause")
    async def admin_pause(self, authorization: str | None = Header(default=None)):
        self._authorize(authorization)
        self.paused = True
        return {"paused": True}

    @app.post("/v1/admin/resume")
    async def admin_resume(self, authorization: str | None = Header(default=None)):
        self._authorize(authorization)
        self.paused = False
        held, self._held = self._held, []
        for prompts, g in held:
            await self.submit(prompts, g)
        return {"paused": False, "released_batches": len(held)}

    @app.post("/v1/admin/drain")
    async def admin_drain(self, authorization: str | None = Header(default=None)):
        self._authorize(authorization)
        self.draining = True
        return {"draining": True}


# ---------------------------------------------------------------- deploy / connect

def deploy(recipe, model_path, admin_token: str, ready_timeout_s: float = 900.0) -> dict:
    """Start (or update) the pool application on the connected Ray cluster and wait until it is ready. A pool
    that does not start is removed (Serve application, engines, colocation group) and
    :class:`~services.pool_startup.PoolStartError` gives the reason. ``model_path``: a model directory on this
    node (registered with :func:`services.model_files.share` so that engines on other nodes get its files) or
    a :class:`~services.model_files.ModelFiles`."""
    from services.model_files import ModelFiles, release, share
    from services.pool_startup import PoolStartError, reason, remove_pool

    name = recipe.rollout_pool.name
    if not isinstance(model_path, ModelFiles):
        model_path = share(model_path, owner=name)
    http = {"host": recipe.rollout_pool.http_host, "port": recipe.rollout_pool.http_port or free_port()}
    serve.start(http_options=http)
    try:
        handle = serve.run(RolloutPool.bind(recipe.model_dump_json(), model_path, admin_token),
                           name=name, route_prefix="/", blocking=False)
        status = handle.wait_ready.remote(ready_timeout_s).result(timeout_s=ready_timeout_s + 30)
        why = None if status.get("ready") else ("; ".join(status.get("errors") or [])
                                                or f"engines not ready: {status.get('engines')}")
    except Exception as exc:  # noqa: BLE001 - the pool is removed and the reason raised below
        why = reason(exc)
    if why is not None:
        remove_pool(name, recipe.rollout_pool.num_engines)
        release(name)
        raise PoolStartError(f"rollout pool {name!r} did not start: {why} (its Serve application, engines and "
                             f"placement group were removed)")
    status["http"] = f"http://{http['host']}:{http_port()}"
    return status


def connect(name: str):
    """DeploymentHandle of a running pool; a clear error if there is none."""
    try:
        return serve.get_app_handle(name)
    except Exception as exc:  # noqa: BLE001 - Serve raises several types here
        raise RuntimeError(f"no rollout pool named {name!r} on this Ray cluster ({type(exc).__name__}: {exc}); "
                           f"deploy one with `inflight pool deploy`") from None


def http_port() -> int:
    """Port of the Serve HTTP proxy on this cluster."""
    from ray.serve.context import _get_global_client

    return _get_global_client().http_config.port


def shutdown(name: str) -> None:
    from services.model_files import release

    handle = connect(name)
    handle.shutdown_engines.remote().result(timeout_s=300)
    serve.delete(name)
    release(name)
