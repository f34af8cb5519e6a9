"""The staleness-bounded trajectory buffer (services/job/buffer.py)."""
from __future__ import annotations

import numpy as np
import pytest

from protocol import Trajectory, TrajectoryGroup, decode, encode, masked_fill
from services.job.buffer import TrajectoryBuffer


def group(pid: str, step: int, versions=(3, 3), failed: int = 0) -> TrajectoryGroup:
    trajs = []
    for i, v in enumerate(versions):
        if i < failed:
            trajs.append(Trajectory([1], [-0.5], [v], None, "error", "timeout after 5 s"))
        else:
            trajs.append(Trajectory([1, 2], [-0.5, -0.25], [v, v], float(i)))
    return TrajectoryGroup(f"g-{pid}", pid, [5], trajs, len(trajs), 16, scheduled_step=step)


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


def test_buffer_refuses_a_second_group_of_a_buffered_prompt():
    buf = TrajectoryBuffer(max_age=1)
    assert buf.add(group("a", 1), b"1") and buf.holds("a")
    assert not buf.add(group("a", 1), b"2")
    assert len(buf) == 1 and buf.all_groups()[0].data == b"1"
    buf.take(1, 1)
    assert not buf.holds("a")


def test_staleness_counts_only_sampled_tokens():
    """Environment tokens (loss mask 0) were produced by no policy: their versions never make a group stale, and an
    in-flight update inside a turn is judged per token."""
    mask = np.array([1, 1, 0, 0, 1], np.uint8)
    sampled = Trajectory([1, 2, 3, 4, 5], [-0.5, -0.5, 0.0, 0.0, -0.5], [3, 4, 0, 0, 4], 1.0, loss_mask=mask)
    g = TrajectoryGroup("g-m", "m", [5], [sampled, Trajectory([1], [-0.5], [4], 0.0)], 2, 16, scheduled_step=5)
    assert g.oldest_version == 3  # not 0: the environment tokens' versions are not read
    buf = TrajectoryBuffer(max_age=1)
    assert buf.reject_reason(g, 4) is None and buf.reject_reason(g, 5) == "stale"
    wire = decode(encode(TrajectoryGroup("g-w", "w", [5], [
        Trajectory([1, 2, 3, 4, 5], *masked_fill(mask, -np.ones(5), np.array([3, 4, 0, 0, 4])), 1.0, loss_mask=mask,
                   turn_finish_reasons=["stop", "stop"]),
        Trajectory([1], [-0.5], [4], 0.0)], 2, 16)), expect=TrajectoryGroup)
    assert wire.trajectories[0].versions.tolist() == [3, 4, 4, 4, 4] and wire.oldest_version == 3
