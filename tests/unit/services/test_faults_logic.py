"""Pure fault-handling logic: duplicate groups at the learner, refit retries, refit failure reasons."""
from __future__ import annotations

import asyncio

import pytest

from protocol import ControlMessage, Trajectory, TrajectoryGroup, encode
from services.buffer import TrajectoryBuffer
from services.job import REFIT_ATTEMPTS, LearnerJob
from services.ledger import PromptLedger
from services.pool import _refit_failure_reason


def group(pid: str, step: int = 1) -> TrajectoryGroup:
    trajs = [Trajectory([1, 2], [-0.5, -0.25], [0, 0], float(i)) for i in range(2)]
    return TrajectoryGroup(f"g-{pid}", pid, [5], trajs, 2, 16, scheduled_step=step)


def receiving_job() -> LearnerJob:
    """A LearnerJob with just the state ``_receive`` uses (no pool, learner or channel)."""
    job = LearnerJob.__new__(LearnerJob)
    job.ledger, job.buffer, job.rejected, job.open_requests, job.step = PromptLedger(), TrajectoryBuffer(1), {}, {}, 0
    job.rescheduled = []
    job.schedule = lambda step, n=None: job.rescheduled.append((step, n))
    return job


def test_buffer_refuses_a_second_group_of_a_buffered_prompt():
    buf = TrajectoryBuffer(max_age=1)
    assert buf.add(group("a"), b"1") and buf.holds("a")
    assert not buf.add(group("a"), b"2")
    assert len(buf) == 1 and buf.all_groups()[0].data == b"1"
    buf.take(1, 1)
    assert not buf.holds("a")


def test_duplicates_of_requeued_prompts_are_counted_and_never_trained():
    job = receiving_job()
    job.ledger.schedule("a", 1)
    job.ledger.schedule("b", 1)
    job._receive(encode(group("a")))
    job._receive(encode(group("a")))                                   # buffered already
    job._receive(encode(group("zz")))                                  # never scheduled
    job.ledger.mark_trained("b", 1)
    job._receive(encode(group("b")))                                   # trained already
    assert job.rejected == {"duplicate": 2, "unexpected_group": 1}
    assert [bg.group.prompt_id for bg in job.buffer.all_groups()] == ["a"]


def test_an_error_report_for_a_buffered_prompt_does_not_drop_it():
    job = receiving_job()
    job.ledger.schedule("a", 1)
    job.ledger.schedule("b", 1)
    job._receive(encode(group("a")))
    for pid in ("a", "b"):
        job._receive(encode(ControlMessage("error", {"prompt_id": pid, "scheduled_step": 1, "reason": "x"}, 0.0)))
    assert job.ledger.is_open("a") and job.buffer.holds("a")           # its first group stays and is trained
    assert job.ledger.dropped == {"b": "generation_failed"} and job.rescheduled == [(1, 1)]


class _Refused:
    def __init__(self, calls: list):
        self.calls = calls

    def remote(self, *args):
        self.calls.append(args)
        return self

    def result(self, timeout_s: float):
        raise RuntimeError("pool 'p': weight push v3 rejected; the old version v2 keeps serving: checksum")


def test_push_weights_retries_then_names_the_learner_and_the_cause():
    calls, exports = [], []
    job = LearnerJob.__new__(LearnerJob)
    job.id, job.version = "learner-x", 3
    job.recipe = type("R", (), {"policy": type("P", (), {"refit_bucket_mb": 1, "refit_timeout_s": 1.0, "generation": type(
        "G", (), {"request_timeout_s": 1.0})})})
    job.learner = type("L", (), {"call": lambda self, m, *a: exports.append(m) or (b"manifest", [])})()
    job.pool = type("Pool", (), {"update_weights": _Refused(calls)})()
    with pytest.raises(RuntimeError, match=rf"learner-x: weight push v3 failed {REFIT_ATTEMPTS} times.*checksum"):
        job.push_weights()
    assert len(calls) == REFIT_ATTEMPTS and exports == ["export_weights"] * REFIT_ATTEMPTS


def test_refit_failure_reasons():
    assert _refit_failure_reason([asyncio.TimeoutError()]) == "timeout"
    assert _refit_failure_reason([RuntimeError("RayTaskError(WeightUpdateError): bad shape")]) == "rejected"
    assert _refit_failure_reason([ValueError("ProtocolError: buckets: missing [3]")]) == "rejected"
    assert _refit_failure_reason([RuntimeError("no engine is up")]) == "failed"


def test_refit_failure_reason_looks_inside_ray_task_errors():
    class RayTaskErrorLike(Exception):
        cause = asyncio.TimeoutError()

    assert _refit_failure_reason([RayTaskErrorLike("ray::EngineActor.apply_weights() traceback ...")]) == "timeout"


class _Undelivered:
    def __init__(self, records: list[dict]):
        self.records, self.asked = records, []

    def remote(self, learner_id: str):
        self.asked.append(learner_id)
        return self

    def result(self, timeout_s: float):
        out, self.records = self.records, []
        return out


def test_undelivered_prompts_are_dropped_with_a_reason_and_replaced_once():
    job = receiving_job()
    job.id = "learner-x"
    for pid in ("a", "b", "c"):
        job.ledger.schedule(pid, 2)
    job._receive(encode(group("b", 2)))                                 # b's group did arrive (buffered)
    job.ledger.mark_dropped("c", "stale")
    take = _Undelivered([{"prompt_id": p, "scheduled_step": 2, "reason": "channel send failed: ChannelTimeout: full",
                          "engine_id": "e0"} for p in ("a", "b", "c")])
    job.pool = type("Pool", (), {"take_undelivered": take})()
    assert job.drop_undelivered() == 1                                 # only a: b is buffered, c already finished
    assert job.ledger.dropped == {"c": "stale", "a": "undelivered"} and job.rescheduled == [(2, 1)]
    assert job.rejected == {"undelivered": 1} and take.asked == ["learner-x"]
    assert job.drop_undelivered() == 0                                  # handed out once
