"""The pool's evaluate call (validation, services/pool/dispatch.py): prompts spread over the serving engines by a
round robin of their own (the training dispatch order is unchanged), groups returned to the caller without a
channel, and an engine that fails losing only its share, reported per prompt with the cause."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from handle_fakes import ActorMethod
from pool_fakes import fleet_of

from protocol import PromptRequest, decode, encode
from protocol.pool_replies import EvaluationReply
from services.pool.dispatch import Dispatcher
from services.pool.engine_replies import BatchReport


def test_evaluate_answers_the_caller_and_an_engine_failure_fails_only_its_share():
    asked: dict[str, list[str]] = {"e0": [], "e1": [], "e2": []}
    trained: dict[str, list] = {"e0": [], "e1": [], "e2": []}

    def engine(eid):
        async def evaluate(prompts, group_size, temperature):
            ids = [decode(p, expect=PromptRequest).prompt_id for p in prompts]
            asked[eid].extend(ids)
            if eid == "e1":
                raise ValueError("boom: a bug in the engine's evaluate")
            return EvaluationReply([f"{eid}:{i}:{group_size}:{temperature}".encode() for i in ids])

        async def generate(prompts, group_size, channel):
            trained[eid].extend(prompts)
            return BatchReport(len(prompts), [])
        return SimpleNamespace(evaluate=ActorMethod(evaluate), generate=ActorMethod(generate))

    async def scenario():
        fleet = fleet_of({e: engine(e) for e in asked})
        fleet.table.set_version("e2", 7)  # another version: takes no validation either
        dispatcher = Dispatcher(fleet)
        prompts = [encode(PromptRequest(f"val:q{i}", [1, 2], {})) for i in range(5)]
        out = await dispatcher.evaluate(prompts, 2, 0.5, timeout_s=5.0)  # no learner attached: not needed
        assert asked == {"e0": ["val:q0", "val:q2", "val:q4"], "e1": ["val:q1", "val:q3"], "e2": []}
        assert out.groups == [b"e0:val:q0:2:0.5", b"e0:val:q2:2:0.5", b"e0:val:q4:2:0.5"]
        assert [f.prompt_id for f in out.failed] == ["val:q1", "val:q3"]
        assert all("e1" in f.reason and "boom" in f.reason for f in out.failed)
        dispatcher.attach("L", SimpleNamespace(name="ch"))
        dispatcher.submit([b"a", b"b"], 2)  # training's round robin starts where it was (at e0)
        await asyncio.gather(*dispatcher.batches)
        assert trained == {"e0": [b"a"], "e1": [b"b"], "e2": []}
        dispatcher.draining = True
        with pytest.raises(RuntimeError, match="draining"):
            await dispatcher.evaluate(prompts, 1, 0.0, timeout_s=5.0)

    asyncio.run(scenario())
