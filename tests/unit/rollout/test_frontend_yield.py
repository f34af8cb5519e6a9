"""vLLM's output handler, played by a loop that takes outputs without ever yielding while they wait: patched, it
gives the event loop a turn before each output, as an in-flight push needs."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from rollout.frontend_yield import restore, yield_between_outputs


class _Client:
    """Outputs always waiting: taking one never suspends (an ``asyncio.Queue`` with items does the same)."""

    async def get_output_async(self) -> int:
        return 1


async def _handler_and_a_call(llm, outputs: int) -> int:
    """How many outputs the handler had taken when a call made at the same time began."""
    taken, seen = 0, []

    async def handler():
        nonlocal taken
        for _ in range(outputs):
            taken += await llm.engine_core.get_output_async()

    async def call():
        seen.append(taken)

    work = asyncio.ensure_future(handler())
    asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(call()))
    await work
    await asyncio.sleep(0)
    return seen[0]


def test_the_patched_handler_lets_a_call_in_before_the_next_output():
    llm = SimpleNamespace(engine_core=_Client())
    assert asyncio.run(_handler_and_a_call(llm, 50)) == 50          # as vLLM is: the call waits for all 50
    assert yield_between_outputs(llm)
    assert asyncio.run(_handler_and_a_call(llm, 50)) <= 1           # patched: it runs between two outputs
    restore(llm)
    assert asyncio.run(_handler_and_a_call(llm, 50)) == 50


def test_a_vllm_without_the_client_call_is_left_alone():
    assert not yield_between_outputs(SimpleNamespace(engine_core=object()))
    assert not yield_between_outputs(SimpleNamespace())
