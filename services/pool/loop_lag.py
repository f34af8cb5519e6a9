"""How late an actor's event loop runs: the longest lag of a periodic wake-up since the last read.

A coroutine sleeps :data:`PERIOD_S` again and again; how much later than asked it wakes up is how long
something held the loop (a handler doing blocking work). An in-flight push's calls wait for the same loop, so
the engine actor and the pool replica report their longest lag since the previous push with each one
(``refit_engine_loop_lag_s``, ``refit_pool_loop_lag_s`` in the step rows).
"""
from __future__ import annotations

import asyncio

PERIOD_S = 0.02
"""How often the watcher wakes up."""


class LoopLag:
    """The longest lag of the running loop since :meth:`take` was last called (watching from :meth:`start`)."""

    def __init__(self) -> None:
        self._max = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start watching the running loop (once; later calls do nothing)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + PERIOD_S
            await asyncio.sleep(PERIOD_S)
            self._max = max(self._max, loop.time() - asked)

    def take(self) -> float:
        """The longest lag since the previous call (0 before the watcher's first wake-up); starts over."""
        out, self._max = self._max, 0.0
        return out
