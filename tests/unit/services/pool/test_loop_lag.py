"""The event-loop lag watcher: a handler that blocks the loop shows up as lag; taking it starts over."""
from __future__ import annotations

import asyncio
import time

from services.pool.loop_lag import PERIOD_S, LoopLag


def test_a_blocked_loop_shows_as_lag_and_taking_it_starts_over():
    async def scenario():
        lag = LoopLag()
        lag.start()
        lag.start()                                  # once: a second watcher would not change the answer
        await asyncio.sleep(3 * PERIOD_S)
        quiet = lag.take()
        time.sleep(0.25)                             # a handler doing blocking work on the loop
        await asyncio.sleep(3 * PERIOD_S)
        blocked = lag.take()
        await asyncio.sleep(3 * PERIOD_S)
        return quiet, blocked, lag.take()
    quiet, blocked, after = asyncio.run(scenario())
    assert 0.2 <= blocked < 0.5
    assert quiet < 0.1 and after < 0.1
