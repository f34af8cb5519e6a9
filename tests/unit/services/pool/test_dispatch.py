"""The pool's dispatch: a batch whose ``generate`` call fails for a reason other than the engine's death reaches its
learner at once, prompt by prompt, with the cause (it used to be only logged, so the learner waited for those
groups until its step deadline); prompts are spread round robin over the engines serving the pool's version."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

from handle_fakes import ActorMethod
from pool_fakes import fleet_of

from protocol import PromptRequest, encode
from services.pool.dispatch import Batch, Dispatcher
from services.pool.engine_replies import BatchReport


class _FailingGenerate:
    def remote(self, prompts, group_size, channel):
        async def fail():
            raise ValueError("boom: a bug in the engine's generate")
        return fail()


def _dispatcher(channel) -> Dispatcher:
    dispatcher = Dispatcher(fleet_of({"e0": SimpleNamespace(generate=_FailingGenerate())}))
    dispatcher.attach("learner-x", channel)
    return dispatcher


def test_a_batch_whose_generate_call_fails_is_handed_to_its_learner_at_once_with_the_cause():
    channel = SimpleNamespace(name="learner-x-trajectories")
    dispatcher = _dispatcher(channel)
    prompts = [encode(PromptRequest(f"p{i}", [1, 2, 3], {}, scheduled_step=7)) for i in range(3)]

    asyncio.run(dispatcher.track("e0", Batch(prompts, 4, channel)))
    got = dispatcher.take_undelivered("learner-x")
    assert [u.prompt_id for u in got] == ["p0", "p1", "p2"]
    assert all(u.scheduled_step == 7 and u.engine_id == "e0" for u in got)
    assert all("generate" in u.reason and "ValueError: boom" in u.reason for u in got), got
    assert dispatcher.fleet.table["e0"].up is True  # the engine itself is not dead
    assert dispatcher.take_undelivered("learner-x") == []  # handed out once


def test_a_failed_batch_of_a_learner_that_is_gone_is_not_kept():
    dispatcher = _dispatcher(SimpleNamespace(name="learner-y-trajectories"))  # another learner is attached now
    batch = Batch([encode(PromptRequest("p0", [1], {}, scheduled_step=1))], 4,
                  SimpleNamespace(name="learner-x-trajectories"))
    asyncio.run(dispatcher.track("e0", batch))
    assert dispatcher.undelivered == []


def test_prompts_go_round_robin_to_the_engines_at_the_pools_version_and_wait_when_none_is():
    sent: dict[str, list] = {"e0": [], "e1": [], "e2": []}

    def engine(eid):
        async def generate(prompts, group_size, channel):
            sent[eid].extend(prompts)
            return BatchReport(len(prompts), [])
        return SimpleNamespace(generate=ActorMethod(generate))

    async def scenario():
        fleet = fleet_of({e: engine(e) for e in sent})
        fleet.table.set_version("e2", 7)                      # restarted at another version: takes no work
        dispatcher = Dispatcher(fleet)
        dispatcher.attach("L", SimpleNamespace(name="ch"))
        assert dispatcher.submit([b"a", b"b", b"c"], 2) == 3
        await asyncio.gather(*dispatcher.batches)
        assert sent == {"e0": [b"a", b"c"], "e1": [b"b"], "e2": []}
        fleet.mark_down("e0", RuntimeError("gone"))
        fleet.mark_down("e1", RuntimeError("gone"))
        dispatcher.submit([b"d"], 2)
        assert dispatcher.waiting_prompts() == 1              # no engine serving: it waits for one
        fleet.mark_up("e1", 0, 2, "2.1")
        dispatcher.send_waiting()
        await asyncio.gather(*dispatcher.batches)
        assert sent["e1"] == [b"b", b"d"] and dispatcher.waiting_prompts() == 0

    asyncio.run(scenario())
