"""The pool's batch tracking: a batch whose ``generate`` call fails for a reason other than the engine's death
reaches its learner at once, prompt by prompt, with the cause (it used to be only logged, so the learner waited
for those groups until its step deadline)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from protocol import PromptRequest, encode
from services import pool as pool_module
from services.metrics import PoolMetrics


class _FailingGenerate:
    def remote(self, prompts, group_size, channel):
        async def fail():
            raise ValueError("boom: a bug in the engine's generate")
        return fail()


def _pool(channel) -> object:
    pool = object.__new__(pool_module.RolloutPool.func_or_class)
    pool.name, pool.metrics = "p", PoolMetrics()
    pool.engines = {"e0": SimpleNamespace(generate=_FailingGenerate())}
    pool.engine_state = {"e0": {"up": True}}
    pool.learner, pool.channel, pool._undelivered = {"id": "learner-x"}, channel, []
    return pool


def test_a_batch_whose_generate_call_fails_is_handed_to_its_learner_at_once_with_the_cause():
    channel = SimpleNamespace(name="learner-x-trajectories")
    pool = _pool(channel)
    prompts = [encode(PromptRequest(f"p{i}", [1, 2, 3], {}, scheduled_step=7)) for i in range(3)]

    async def scenario():
        await pool._track("e0", pool_module._Batch(prompts, 4, channel))
        return await pool.take_undelivered("learner-x")

    got = asyncio.run(scenario())
    assert [u["prompt_id"] for u in got] == ["p0", "p1", "p2"]
    assert all(u["scheduled_step"] == 7 and u["engine_id"] == "e0" for u in got)
    assert all("generate" in u["reason"] and "ValueError: boom" in u["reason"] for u in got), got
    assert pool.engine_state["e0"]["up"] is True  # the engine itself is not dead


def test_a_failed_batch_of_a_learner_that_is_gone_is_not_kept():
    pool = _pool(SimpleNamespace(name="learner-y-trajectories"))  # another learner is attached now
    batch = pool_module._Batch([encode(PromptRequest("p0", [1], {}, scheduled_step=1))], 4,
                               SimpleNamespace(name="learner-x-trajectories"))
    asyncio.run(pool._track("e0", batch))
    assert pool._undelivered == []
