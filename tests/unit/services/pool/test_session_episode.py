"""A rollout session's calls as one trajectory (services/pool/session_episode.py): sampled tokens and the
environment's deltas laid end to end with their mask, versions across a push between calls, and every way the
calls fail to be one line (an edited history, parallel calls, n > 1, unlabelled or unfinished answers)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from protocol import TrajectoryGroup
from protocol.codec import decode, encode
from services.pool.session_episode import SessionBroken, session_episode
from services.pool.token_capture import CapturedChoice, CapturedCompletion, CapturingClient, VersionSpan

SYSTEM = [1, 2, 3, 4]


def call(rid: str, prompt: list[int], ids: list[int], version: int = 0, reason: str = "stop",
         lps: list[float] | None = None, n: int = 1) -> CapturedCompletion:
    lps = lps if lps is not None else [-0.5 - 0.1 * i for i in range(len(ids))]
    choices = {i: CapturedChoice(list(ids), list(lps), [VersionSpan(version, 0, len(ids))], reason) for i in range(n)}
    return CapturedCompletion(rid, list(prompt), choices)


def two_calls(version_2: int = 1) -> tuple[list[CapturedCompletion], list[int]]:
    """A tool call answered (v0), the tool's result and the template's markers, then the final answer (v1)."""
    first_answer, tool_turn, final_answer = [10, 11, 12], [20, 21], [30, 31]
    first = call("a", SYSTEM, first_answer, 0, "stop")
    second = call("b", SYSTEM + first_answer + tool_turn, final_answer, version_2, "length", [-1.0, -2.0])
    return [second, first], first_answer + tool_turn + final_answer  # in the wrong order: sorted by prompt


def test_two_calls_become_one_trajectory_with_the_environments_turn_masked():
    calls, expected_ids = two_calls()
    got = session_episode(calls, reward=1.0)
    t = got.trajectory
    assert got.prompt_ids == SYSTEM and got.calls == 2
    assert t.response_ids.tolist() == expected_ids
    assert t.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert t.versions.tolist() == [0, 0, 0, 0, 0, 1, 1]  # a push between the calls: v0 then v1; masked take v0
    assert np.allclose(t.logprobs, [-0.5, -0.6, -0.7, 0.0, 0.0, -1.0, -2.0])
    assert t.turn_finish_reasons == ["stop", "length"] and t.finish_reason == "length" and t.reward == 1.0
    group = TrajectoryGroup("g", "p", np.asarray(got.prompt_ids, np.int32), [t], 1, 100)
    back = decode(encode(group), TrajectoryGroup)  # the protocol's own checks of a multi-turn trajectory
    assert back.trajectories[0].loss_mask.tolist() == t.loss_mask.tolist()


def test_calls_with_nothing_between_them_are_one_sampled_turn():
    first = call("a", SYSTEM, [10, 11], 0, "length")
    second = call("b", SYSTEM + [10, 11], [12], 0, "stop")
    t = session_episode([first, second], 0.0).trajectory
    assert t.loss_mask.tolist() == [1, 1, 1] and t.turn_finish_reasons == ["stop"]


def test_the_group_prompt_leads_and_the_rest_of_the_first_prompt_is_context():
    t = session_episode([call("a", SYSTEM + [7, 8], [10])], 0.5, group_prompt=SYSTEM)
    assert t.prompt_ids == SYSTEM and t.trajectory.response_ids.tolist() == [7, 8, 10]
    assert t.trajectory.loss_mask.tolist() == [0, 0, 1]
    with pytest.raises(SessionBroken, match="group's prompt .* differ at token 2"):
        session_episode([call("a", [1, 2, 9, 4], [10])], 0.5, group_prompt=SYSTEM)


def test_an_edited_history_is_refused_where_it_differs():
    first = call("a", SYSTEM, [10, 11, 12])
    rerendered = call("b", SYSTEM + [10, 99, 12, 20], [30])  # the answer came back as other tokens
    with pytest.raises(SessionBroken, match=r"call 1's prompt does not extend .* differs at token 5 of 7"):
        session_episode([first, rerendered], 1.0)


@pytest.mark.parametrize(("calls", "match"), [
    ([], "made no call"),
    ([call("a", SYSTEM, [10], n=2)], r"asked for 2 answers"),
    ([call("a", SYSTEM, [10]), call("b", [1, 2, 3, 5], [11])], "same length"),
    ([call("a", SYSTEM, [10], reason="")], "ended 'never'"),
    ([call("a", SYSTEM, [10], version=-1)], "lacks a policy version"),
    ([call("a", SYSTEM, [10], lps=[float("nan")])], "lacks a policy version or a log-prob"),
    ([call("a", SYSTEM, [])], "sampled no token"),
])
def test_calls_that_are_not_one_line_are_refused_with_the_reason(calls, match):
    with pytest.raises(SessionBroken, match=match):
        session_episode(calls, 1.0)


def test_the_capture_records_why_vllm_ended_each_answer():
    final = SimpleNamespace(index=0, token_ids=[5], logprobs=None, weight_versions=None, finish_reason="length")
    running = SimpleNamespace(index=1, token_ids=[6], logprobs=None, weight_versions=None, finish_reason=None)

    class LLM:
        async def generate(self, prompt, params, request_id, **kwargs):
            yield SimpleNamespace(prompt_token_ids=[1], outputs=[final, running])

    client = CapturingClient(LLM())

    async def drain():
        async for _ in client.generate("p", SimpleNamespace(logprobs=0, output_kind=None), "r"):
            pass
    asyncio.run(drain())
    assert [c.finish_reason for c in client.take("r").in_order()] == ["length", ""]
