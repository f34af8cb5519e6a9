"""``Trajectory.reward_components``: each reward function's value travels with the sample (optional key, since
schema 1); a message written without it still decodes, and every name/value is checked like the other fields."""
from __future__ import annotations

import math

import numpy as np
import pytest

from protocol import ProtocolError, Trajectory, TrajectoryGroup, decode, encode
from protocol.codec import pack_frame, unpack_frame


def group(*trajs: Trajectory) -> TrajectoryGroup:
    return TrajectoryGroup("g", "p", [1, 2], list(trajs), len(trajs), 100)


def test_reward_components_round_trip():
    t = Trajectory([4, 5], [-0.5, -1.0], [0, 0], 0.84, reward_components={"math_verify": 1.0, "format": 0.2})
    back = decode(encode(group(t, Trajectory([6], [-0.1], [0], 0.0))), expect=TrajectoryGroup)
    assert back.trajectories[0].reward_components == {"math_verify": 1.0, "format": 0.2}
    assert back.trajectories[1].reward_components == {}
    wire = unpack_frame(encode(group(Trajectory([6], [-0.1], [0], 0.0))))
    assert "reward_components" not in wire["trajectories"][0]  # absent when empty: old readers see v1 as before


def test_a_message_without_reward_components_decodes():
    body = unpack_frame(encode(group(Trajectory([4], [-0.5], [0], 1.0))))
    body["trajectories"][0].pop("reward_components", None)
    assert body["schema"] == 2
    back = decode(pack_frame(body), expect=TrajectoryGroup)
    assert back.trajectories[0].reward_components == {} and back.trajectories[0].reward == 1.0


@pytest.mark.parametrize(("components", "where"), [
    ({"math_verify": math.nan}, "trajectories[0].reward_components.math_verify"),
    ({"math_verify": "1.0"}, "trajectories[0].reward_components.math_verify"),
    ({"math_verify": True}, "trajectories[0].reward_components.math_verify"),
    ({"": 1.0}, "trajectories[0].reward_components.<name>"),
    ([1.0], "trajectories[0].reward_components"),
])
def test_bad_reward_components_are_rejected_by_field(components, where):
    body = unpack_frame(encode(group(Trajectory([4], [-0.5], [0], 1.0))))
    body["trajectories"][0]["reward_components"] = components
    with pytest.raises(ProtocolError) as err:
        decode(pack_frame(body), expect=TrajectoryGroup)
    assert where in str(err.value)


def test_a_failed_sample_carries_no_components():
    body = unpack_frame(encode(group(Trajectory(np.zeros(0), np.zeros(0), np.zeros(0), None, "error", "boom"))))
    body["trajectories"][0]["reward_components"] = {"math_verify": 0.0}
    with pytest.raises(ProtocolError, match="empty for a failed sample"):
        decode(pack_frame(body), expect=TrajectoryGroup)


def test_a_failed_samples_kind_travels_and_is_checked():
    """``Trajectory.failure_kind`` (issue 33): what failed a sample, an optional key sent only when set."""
    failed = Trajectory(np.zeros(0), np.zeros(0), np.zeros(0), None, "error", "reset raised KeyError: 'secret'",
                        failure_kind="environment")
    back = decode(encode(group(failed, Trajectory([6], [-0.1], [0], 0.0))), expect=TrajectoryGroup)
    assert [t.failure_kind for t in back.trajectories] == ["environment", ""]
    body = unpack_frame(encode(group(failed)))
    body["trajectories"][0].pop("failure_kind")                 # an older sender: decodes, kind unknown ("")
    assert decode(pack_frame(body), expect=TrajectoryGroup).trajectories[0].failure_kind == ""
    for kind, traj in (("weather", failed), ("reward", Trajectory([6], [-0.1], [0], 0.0))):
        body = unpack_frame(encode(group(traj)))
        body["trajectories"][0]["failure_kind"] = kind
        with pytest.raises(ProtocolError, match=r"trajectories\[0\]\.failure_kind.*for a failed sample only"):
            decode(pack_frame(body), expect=TrajectoryGroup)
