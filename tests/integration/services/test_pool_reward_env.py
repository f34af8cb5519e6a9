"""The session's data pool scores with ``env.math`` (math_verify in reward worker processes inside each engine
actor): every scored sample carries its function's value in ``reward_components``, the reward is the weighted
sum, and a task without an answer fails its samples with the reason instead of scoring 0."""
from __future__ import annotations

import time
import uuid

import numpy as np

GROUP = 4


def test_pool_groups_carry_math_verify_components(data_pool):
    from protocol import ControlMessage, PromptRequest, TrajectoryGroup, decode, encode
    from services import pool as pool_api
    from services.job.channel import TrajectoryChannel

    pool = pool_api.connect(data_pool.rollout_pool.name)
    learner_id = f"reward-env-{uuid.uuid4().hex[:8]}"
    channel = TrajectoryChannel.create(f"{learner_id}-trajectories", 16)
    pool.attach.remote(learner_id, channel).result(timeout_s=60)
    requests = [PromptRequest("with-answer", np.arange(5, 15), {"answer": "12"}),
                PromptRequest("no-answer", np.arange(20, 30), {"level": 1})]
    groups: dict[str, TrajectoryGroup] = {}
    try:
        pool.submit.remote([encode(r) for r in requests], GROUP).result(timeout_s=120)
        deadline = time.monotonic() + 240
        while len(groups) < len(requests) and time.monotonic() < deadline:
            msg = decode(channel.recv(max(1.0, deadline - time.monotonic())))
            assert not isinstance(msg, ControlMessage), msg
            assert isinstance(msg, TrajectoryGroup)
            groups[msg.prompt_id] = msg
    finally:
        pool.detach.remote(learner_id).result(timeout_s=60)
        channel.close()
    scored = groups["with-answer"].trajectories
    assert len(scored) == GROUP and all(t.ok for t in scored), [t.error for t in scored]
    for t in scored:
        assert set(t.reward_components) == {"math_verify"}
        assert t.reward_components["math_verify"] in (0.0, 1.0)
        assert t.reward == t.reward_components["math_verify"]  # weight 1.0
    failed = groups["no-answer"].trajectories
    assert all(t.finish_reason == "error" and t.reward is None and not t.reward_components for t in failed)
    assert all("math_verify: task has no 'answer'" in t.error for t in failed), [t.error for t in failed]
