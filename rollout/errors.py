"""The rollout engine's own error, and the bounded wait that raises it when a vLLM call hangs.

Every call the engine makes into vLLM outside of sampling (start, sleep, the
steps of an install) goes through :func:`bounded`, so a hung engine turns into
an :class:`EngineError` that names the engine and the step instead of a hang.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class EngineError(RuntimeError):
    """The rollout engine could not start, is not started, or could not do what was asked."""


async def bounded(awaitable: Awaitable[T], seconds: float, what: str, engine_id: str) -> T:
    """Await ``awaitable`` for at most ``seconds``; a timeout raises :class:`EngineError` naming the step."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except TimeoutError:
        raise EngineError(f"rollout engine {engine_id}: {what} did not finish within {seconds:g}s") from None
