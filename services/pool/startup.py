"""The rollout pool's start-up: create its engines in their places, boot them, and undo it all on failure.

A start-up that fails leaves nothing behind (docs/reliability.md): any error -- the
colocation group cannot be granted, an engine's placement is impossible, an engine
actor cannot be created or its vLLM engine does not start -- stops the start-up at
once (the other engines' boots are not waited for), the replica shuts down the
engines that had started, kills every engine actor and removes the colocation group
(:func:`discard_engines`), and :func:`services.pool.deploy` then deletes the Serve
application and raises :class:`PoolStartError` with the reason; :func:`remove_pool`
is its driver-side backstop for what a dead replica could not remove.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from services.pool.engine_actor import EngineActor, EngineSpec
from services.pool.placement import colocation_group_name, engine_options
from services.recipe.gpu_layout import check_pool_fits, gpu_census, pool_gpus_per_engine

if TYPE_CHECKING:
    from services.pool.agent_driver import PoolAccess
    from services.pool.engine_replies import EngineStarted
    from services.recipe.config import Recipe

BOOT_TIMEOUT_S = 600.0
"""Longest one engine may take to answer and start its vLLM engine."""
STOP_TIMEOUT_S = 60.0
"""Longest a started engine may take to shut its vLLM engine down before its actor is killed."""
ENGINE_NAMESPACE = "inflight"

log = logging.getLogger("inflight.pool")


class PoolStartError(RuntimeError):
    """A rollout pool did not start; what it had made was removed."""


def engine_name(pool_name: str, index: int) -> str:
    return f"{pool_name}-engine-{index}"


def reason(exc: BaseException) -> str:
    """One line naming the error: the remote exception inside a ``RayTaskError``; of a text of several lines
    (an ``ActorDiedError`` quotes its constructor's traceback) the last that says something, which names the
    exception (pydantic's closing "For further information visit <url>" says nothing)."""
    cause = getattr(exc, "cause", None)
    exc = cause if isinstance(cause, BaseException) else exc
    lines = [ln.strip() for ln in str(exc).splitlines()
             if ln.strip() and not ln.strip().startswith("For further information visit")]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__


def create_engines(recipe: Recipe, pool_name: str, model_path: Any, group: Any, into: dict,
                   access: PoolAccess | None = None) -> None:
    """Create the engine actors (named, detached, restarted by Ray) in their places (:mod:`.placement`),
    adding each to ``into`` as it is made, so that a failure half-way leaves ``into`` holding those to remove.
    ``access``: where the engines' agents reach the pool."""
    import ray

    r = recipe
    missing = [i for i in range(r.rollout_pool.num_engines) if not _exists(engine_name(pool_name, i))]
    check_pool_fits(r, gpu_census(r), len(missing))  # engines of a restarted replica hold their GPUs already
    ncpu = max(1, int(ray.cluster_resources().get("CPU", 1)))
    for i in range(r.rollout_pool.num_engines):
        eid = engine_name(pool_name, i)
        actor_cls = ray.remote(EngineActor).options(
            name=eid, namespace=ENGINE_NAMESPACE, lifetime="detached", get_if_exists=True, max_restarts=-1,
            max_concurrency=1000, num_cpus=0,
            **engine_options(r, i, group, env={"VLLM_CPU_OMP_THREADS_BIND": str(i % ncpu)}))
        into[eid] = actor_cls.remote(EngineSpec.from_recipe(r, eid, model_path, access=access))


def _exists(name: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=ENGINE_NAMESPACE)
        return True
    except ValueError:
        return False


def _asks(recipe: Recipe | None) -> str:
    """What an engine asks for and the cluster's GPUs, for a start-up timeout's message."""
    if recipe is None or not recipe.cluster.gpus_per_node:
        return ""
    k = pool_gpus_per_engine(recipe)
    return f" (it asks for {k:g} GPU{'s' if k > 1 else ''}; {gpu_census(recipe).describe()})"


async def _boot_one(eid: str, engine: Any, timeout_s: float, recipe: Recipe | None = None) -> EngineStarted:
    """Wait until the actor answers, then start its engine. (Measured: a ``start`` call submitted while the
    actor was still being created never arrived; a first cheap call fixes it.)"""
    try:
        await asyncio.wait_for(engine.health.remote(), timeout_s)
        return await asyncio.wait_for(engine.start.remote(), timeout_s)
    except TimeoutError:
        raise PoolStartError(f"engine {eid} did not start within {timeout_s:g} s{_asks(recipe)}") from None
    except Exception as exc:  # named and re-raised
        raise PoolStartError(f"engine {eid} did not start: {reason(exc)}") from exc


async def boot_engines(engines: dict, timeout_s: float, started: dict[str, EngineStarted],
                       recipe: Recipe | None = None) -> None:
    """Start every engine's vLLM engine, all at once; each answer (:class:`EngineStarted`) goes into
    ``started`` as it comes. Raises :class:`PoolStartError` at the first engine that fails."""
    tasks = {asyncio.ensure_future(_boot_one(eid, e, timeout_s, recipe)): eid for eid, e in engines.items()}
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [exc for t in done if (exc := t.exception()) is not None]
            started.update({tasks[t]: t.result() for t in done if t.exception() is None})
            if failed:
                raise failed[0]
    finally:
        for task in pending:
            task.cancel()


async def discard_engines(engines: dict, started: set[str], group: Any) -> list[str]:
    """Remove what a failed start-up made: shut down the vLLM engines that started (frees their /dev/shm),
    kill every engine actor, remove the colocation group. Returns what could not be removed (never raises)."""
    import ray

    problems: list[str] = []
    stops = [asyncio.wait_for(engines[e].shutdown.remote(), STOP_TIMEOUT_S) for e in started if e in engines]
    for res in await asyncio.gather(*stops, return_exceptions=True):
        if isinstance(res, BaseException):
            problems.append(f"engine shutdown: {reason(res)}")
    for eid, eng in list(engines.items()):
        try:
            ray.kill(eng, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - reported
            problems.append(f"kill {eid}: {reason(exc)}")
    engines.clear()
    if group is not None:
        try:
            ray.util.remove_placement_group(group)
        except Exception as exc:  # noqa: BLE001 - reported
            problems.append(f"remove placement group: {reason(exc)}")
    return problems


def remove_pool(pool_name: str, num_engines: int) -> None:
    """Driver side, after a failed deploy: delete the pool's Serve application, then kill any engine actor and
    remove the colocation group still there (the replica normally removed them already)."""
    import ray
    from ray import serve

    try:
        serve.delete(pool_name)
    except Exception as exc:  # noqa: BLE001 - the actors and the group are still removed below
        log.warning("pool %s: deleting the Serve application failed: %s", pool_name, reason(exc))
    for i in range(num_engines):
        try:
            ray.kill(ray.get_actor(engine_name(pool_name, i), namespace=ENGINE_NAMESPACE), no_restart=True)
        except ValueError:
            pass  # no such actor: removed already
    try:
        ray.util.remove_placement_group(ray.util.get_placement_group(colocation_group_name(pool_name)))
    except ValueError:
        pass  # no such group
