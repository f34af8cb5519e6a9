"""Exactly-once ledger, the staleness-bounded buffer and the prompt stream."""
from __future__ import annotations

import numpy as np
import pytest

from protocol import PromptRequest, Trajectory, TrajectoryGroup, encode
from services.buffer import TrajectoryBuffer
from services.data import PromptSource
from services.ledger import LedgerError, PromptLedger


def group(pid: str, step: int, versions=(3, 3), failed: int = 0) -> TrajectoryGroup:
    trajs = []
    for i, v in enumerate(versions):
        if i < failed:
            trajs.append(Trajectory([1], [-0.5], [v], None, "error", "timeout after 5 s"))
        else:
            trajs.append(Trajectory([1, 2], [-0.5, -0.25], [v, v], float(i)))
    return TrajectoryGroup(f"g-{pid}", pid, [5], trajs, len(trajs), 16, scheduled_step=step)


def test_ledger_exactly_once():
    led = PromptLedger()
    led.schedule("a", 1)
    led.schedule("b", 1)
    led.mark_trained("a", 1)
    led.mark_dropped("b", "stale")
    with pytest.raises(LedgerError, match="already trained"):
        led.mark_trained("a", 2)
    with pytest.raises(LedgerError, match="already dropped"):
        led.mark_trained("b", 2)
    with pytest.raises(LedgerError, match="never scheduled"):
        led.mark_dropped("c", "x")
    with pytest.raises(LedgerError, match="scheduled twice"):
        led.schedule("a", 3)
    assert led.summary() == {"scheduled": 2, "trained": 1, "dropped": 1, "pending": 0,
                             "dropped_by_reason": {"stale": 1}}
    assert PromptLedger.from_state(led.state()).summary() == led.summary()


def test_buffer_drops_stale_and_too_few_valid_and_keeps_future_steps():
    buf = TrajectoryBuffer(max_age=1)
    fresh, stale = group("fresh", 5, versions=(3, 4)), group("stale", 5, versions=(2, 4))
    broken, later = group("broken", 5, versions=(4, 4, 4), failed=2), group("later", 6)
    for g in (fresh, stale, broken, later):
        buf.add(g, encode(g))
    dropped = buf.screen(step=5, version=4)
    assert sorted((g.prompt_id, r) for g, r in dropped) == [("broken", "too_few_valid_samples"), ("stale", "stale")]
    assert buf.ready(5) == 1 and buf.ready(6) == 1
    (taken,) = buf.take(5, 1)
    assert taken.group.prompt_id == "fresh" and taken.data == encode(fresh)
    with pytest.raises(ValueError, match="step 5 has 0 groups"):
        buf.take(5, 1)
    assert len(buf) == 1 and buf.drops == {"stale": 1, "too_few_valid_samples": 1}


def test_sync_buffer_accepts_only_on_policy_groups():
    buf = TrajectoryBuffer(max_age=0)
    assert buf.reject_reason(group("a", 1, versions=(4, 4)), 4) is None
    assert buf.reject_reason(group("b", 1, versions=(3, 4)), 4) == "stale"


def _prompts(n):
    return [PromptRequest(f"p{i}", np.array([i + 1]), {"answer": str(i)}) for i in range(n)]


def test_prompt_source_is_seeded_unique_and_resumable():
    a, b = PromptSource(_prompts(5), seed=7), PromptSource(_prompts(5), seed=7)
    first = [r.prompt_id for r in a.next(12, step=1)]
    assert first == [r.prompt_id for r in b.next(12, step=1)]
    assert len(set(first)) == 12  # ids stay unique across epochs
    assert {r.split("@")[1] for r in first} == {"0", "1", "2"}
    pos = a.position()
    c = PromptSource(_prompts(5), seed=7)
    c.seek(pos)
    assert [r.prompt_id for r in c.next(4, 3)] == [r.prompt_id for r in a.next(4, 3)]
    assert all(r.scheduled_step == 3 for r in c.next(2, 3))
    assert [r.prompt_id for r in PromptSource(_prompts(5), seed=8).next(5, 1)] != first[:5]
    with pytest.raises(ValueError, match="empty"):
        PromptSource([], seed=0)
