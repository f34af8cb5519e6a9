"""Results in the order they complete: how a batch's groups stream out as each one is done."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def in_completion_order(coros: Iterable[Coroutine[Any, Any, T]]) -> AsyncIterator[T]:
    """Run ``coros`` concurrently and yield each result as soon as it is ready (an exception is raised where its
    result would be); when the consumer stops early or fails, the ones still running are cancelled and awaited."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        for next_done in asyncio.as_completed(tasks):
            yield await next_done
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
