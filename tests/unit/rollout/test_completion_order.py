"""Results in completion order (rollout/completion_order.py): the fastest first, an exception where its result would
be, and what still runs cancelled and awaited when the consumer stops early."""
from __future__ import annotations

import asyncio

import pytest

from rollout.completion_order import in_completion_order


async def after(seconds: float, value: str, log: list[str]) -> str:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        log.append(f"cancelled {value}")
        raise
    if value == "boom":
        raise RuntimeError("boom")
    return value


def test_results_come_as_they_complete():
    async def go() -> list[str]:
        log: list[str] = []
        return [v async for v in in_completion_order(after(s, v, log) for s, v in ((0.05, "slow"), (0.0, "fast")))]

    assert asyncio.run(go()) == ["fast", "slow"]


def test_stopping_early_cancels_and_awaits_the_rest():
    async def go() -> list[str]:
        log: list[str] = []
        results = in_completion_order(after(s, v, log) for s, v in ((0.0, "a"), (10.0, "b"), (10.0, "c")))
        assert await anext(results) == "a"
        await results.aclose()
        return log

    assert sorted(asyncio.run(go())) == ["cancelled b", "cancelled c"]


def test_an_exception_is_raised_where_its_result_would_be():
    async def go(log: list[str]) -> list[str]:
        got = []
        async for v in in_completion_order(after(s, v, log) for s, v in ((0.0, "a"), (0.01, "boom"), (10.0, "c"))):
            got.append(v)
        return got

    log: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(go(log))
    assert log == ["cancelled c"]
