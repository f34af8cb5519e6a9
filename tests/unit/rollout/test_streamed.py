"""Streamed per-token version labels (the path for a vLLM without engine-side labels)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from rollout.streamed import StreamedSample, VersionTracker, frontend_backlog


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


def front_end(queued, collected):
    """A paused ``AsyncLLM``'s front end as vLLM keeps it: engine outputs (``(internal id, new tokens)`` lists, or an
    exception) in the client's output queue; per request (internal id -> (external id, tokens collected but not
    taken by the consumer)) its state with its collector."""
    queue: asyncio.Queue = asyncio.Queue()
    for item in queued:
        outputs = [SimpleNamespace(request_id=rid, new_token_ids=[7] * n) for rid, n in item] \
            if isinstance(item, list) else item
        queue.put_nowait(SimpleNamespace(outputs=outputs) if isinstance(outputs, list) else outputs)
    states = {internal: SimpleNamespace(external_req_id=external, queue=SimpleNamespace(
        output=SimpleNamespace(outputs=[delta([7] * n)]) if n else None)) for internal, (external, n) in
        collected.items()}
    return SimpleNamespace(engine_core=SimpleNamespace(outputs_queue=queue),
                           output_processor=SimpleNamespace(request_states=states))


def test_the_backlog_counts_each_requests_tokens_in_the_queue_and_its_collector():
    llm = front_end([[("a-1", 3), ("b-1", 1)], RuntimeError("engine died"), [("a-1", 1), ("gone-1", 5)]],
                    {"a-1": ("a", 2), "b-1": ("b", 0)})
    backlog = frontend_backlog(llm)
    assert backlog is not None
    assert backlog.pending == {"a": 6, "b": 1} and backlog.tokens == 7  # gone-1: no longer followed, not counted
    assert backlog.frames == 2 and backlog.registered == {"a", "b"}
    assert llm.engine_core.outputs_queue.qsize() == 3  # read, not taken
    assert frontend_backlog(SimpleNamespace()) is None  # a vLLM keeping its outputs elsewhere


def test_marks_fall_where_the_pause_cut_each_sample_whatever_the_front_end_still_held():
    tracker = VersionTracker()
    held, fresh, done, unregistered = (tracker.open(r, 3) for r in ("held", "fresh", "done", "unregistered"))
    held.add(delta([1, 2]))
    done.add(delta([1, 2, 3]))  # finished before the pause: the front end follows it no more
    llm = front_end([[("held-1", 2), ("fresh-1", 1)]], {"held-1": ("held", 1), "fresh-1": ("fresh", 0)})
    at = tracker.boundaries(frontend_backlog(llm))
    assert at == {"held": 5, "fresh": 1, "done": None, "unregistered": 0}
    held.add(delta([3, 4, 5, 6]))  # the backlog (3 tokens) and one token after the pause reach the sample
    late = tracker.open("late", 3)  # a request opened after the marks were read
    assert tracker.relabel_all(4, at) == 4  # every running sample but the finished one
    fresh.add(delta([1, 2]))
    done.add(delta([], finish="stop"))
    late.add(delta([9]))
    assert held.versions().tolist() == [3, 3, 3, 3, 3, 4]
    assert fresh.versions().tolist() == [3, 4] and done.versions().tolist() == [3, 3, 3]
    assert late.versions().tolist() == [4]
    unregistered.add(delta([8]))
    assert unregistered.versions().tolist() == [4]
    assert tracker.boundaries(None) == {r: len(s.token_ids) for r, s in
                                        (("held", held), ("fresh", fresh), ("done", done),
                                         ("unregistered", unregistered), ("late", late))}
