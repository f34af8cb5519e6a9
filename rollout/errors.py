"""The rollout engine's own error, and the bounded wait that raises it when a vLLM call hangs.

Every call the engine makes into vLLM outside of sampling (start, sleep, the
steps of an install) goes through :func:`bounded`, so a hung engine turns into
an :class:`EngineError` that names the engine and the step instead of a hang;
given a liveness probe, a wait on an engine whose core died ends within a poll
interval with :class:`~rollout.liveness.EngineDead` instead of at the deadline.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from rollout.liveness import EngineDead

T = TypeVar("T")


class EngineError(RuntimeError):
    """The rollout engine could not start, is not started, or could not do what was asked."""


DEAD_POLL_S = 0.5
"""How often a bounded wait asks its liveness probe whether the engine died."""


async def bounded(awaitable: Awaitable[T], seconds: float, what: str, engine_id: str,
                  dead: Callable[[], str] | None = None) -> T:
    """Await ``awaitable`` for at most ``seconds``; a timeout raises :class:`EngineError` naming the step.

    ``dead`` (a liveness probe: why the engine cannot serve, '' while it can) is asked every
    :data:`DEAD_POLL_S`; once it gives a reason the wait is abandoned (cancelled) with :class:`EngineDead`."""
    if dead is None:
        try:
            return await asyncio.wait_for(awaitable, seconds)
        except TimeoutError:
            raise EngineError(f"rollout engine {engine_id}: {what} did not finish within {seconds:g}s") from None
    task = asyncio.ensure_future(awaitable)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    try:
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise EngineError(f"rollout engine {engine_id}: {what} did not finish within {seconds:g}s")
            done, _ = await asyncio.wait({task}, timeout=min(DEAD_POLL_S, left))
            if done:
                return task.result()
            if reason := dead():
                raise EngineDead(f"rollout engine {engine_id}: {what} abandoned: {reason}")
    finally:
        if not task.done():
            task.cancel()
