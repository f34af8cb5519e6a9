"""Streamed per-token version labels (the path for a vLLM without engine-side labels)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from rollout.streamed import StreamedSample, VersionTracker, drain_frontend


def delta(ids, text="", finish=None, logprobs=True):
    lps = [{t: SimpleNamespace(logprob=-0.5 * (i + 1))} for i, t in enumerate(ids)] if logprobs else None
    return SimpleNamespace(token_ids=ids, logprobs=lps, text=text, finish_reason=finish)


def test_marks_split_versions_at_token_counts():
    tracker = VersionTracker()
    a, b = tracker.open("a", 3), tracker.open("b", 3)
    a.add(delta([5, 6], "x"))
    assert tracker.relabel_all(4) == 2
    a.add(delta([7], "y"))
    tracker.close("b")
    assert tracker.relabel_all(5) == 1  # b is no longer running
    a.add(delta([8, 9], "z", "stop"))
    np.testing.assert_array_equal(a.versions(), [3, 3, 4, 5, 5])
    assert a.token_ids == [5, 6, 7, 8, 9] and "".join(a.text) == "xyz" and a.finish_reason == "stop"
    assert a.logprobs == [-0.5, -1.0, -0.5, -0.5, -1.0]
    b.add(delta([1]))
    np.testing.assert_array_equal(b.versions(), [4])  # marked at count 0: every token is v4


def test_missing_logprobs_are_an_error():
    with pytest.raises(ValueError, match="0 log-probs for 2 new tokens"):
        StreamedSample(0).add(delta([1, 2], logprobs=False))


def test_drain_waits_for_the_output_queue_and_reports_a_missing_one():
    async def scenario():
        queue: asyncio.Queue = asyncio.Queue()
        queue.put_nowait("pending")
        llm = SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue))
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, queue.get_nowait)
        drained = await drain_frontend(llm, limit_s=1.0)
        queue.put_nowait("stuck")
        return drained, await drain_frontend(llm, limit_s=0.01), await drain_frontend(SimpleNamespace())
    assert asyncio.run(scenario()) == (True, False, False)
