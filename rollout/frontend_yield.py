"""Keep the engine's event loop responsive while vLLM's front end is behind the engine core.

vLLM's ``AsyncLLM`` hands the engine core's outputs to their requests in one coroutine that takes the next
output from a queue: when outputs are waiting, ``await queue.get()`` returns without yielding, so once the
front end falls behind (many sequences with log-probs) it runs output after output and every other coroutine
of the loop -- a weight push's calls, the pool's relays -- waits until it has caught up: 1.1-1.6 s per push
on one H100 (2026-12-06; ``refit_engine_loop_lag_s``). :func:`yield_between_outputs` has it yield to the
loop before each output; it still takes each output whole (the streamed version marks rely on that).
"""
from __future__ import annotations

import asyncio
from typing import Any


def yield_between_outputs(llm: Any) -> bool:
    """Make ``llm``'s output handler yield to the loop before it takes each engine output; False if this vLLM
    has no such client call (nothing changed)."""
    client = getattr(llm, "engine_core", None)
    take = getattr(type(client), "get_output_async", None)
    if client is None or take is None:
        return False

    async def get_output_async() -> Any:
        await asyncio.sleep(0)
        return await take(client)

    client.get_output_async = get_output_async
    return True


def restore(llm: Any) -> None:
    """Undo :func:`yield_between_outputs` (benchmarks compare both)."""
    client = getattr(llm, "engine_core", None)
    if client is not None and "get_output_async" in vars(client):
        del client.get_output_async
