"""Skipped learner steps: counted, in a row and in total; a push after one sends nothing; too many in a row stop
the job with the learner's reason."""
from __future__ import annotations

import pytest

from services.job import LearnerJob
from services.skips import SkippedSteps, SkippedStepsError

APPLIED = {"step_skipped": 0.0, "skip_reason": ""}


def skipped(reason: str = "non-finite loss") -> dict:
    return {"step_skipped": 1.0, "skip_reason": reason}


def test_skips_in_a_row_stop_at_the_limit_with_the_last_reason():
    skips = SkippedSteps(max_in_a_row=2)
    assert skips.record(skipped()) is True
    skips.check(1)
    assert skips.record(APPLIED) is False    # an applied step: the count in a row starts again
    skips.check(2)
    assert skips.record(skipped("no valid response tokens in the batch")) and skips.in_a_row == 1
    skips.check(3)
    assert skips.record(skipped("non-finite gradient")) and skips.in_a_row == 2 and skips.total == 3
    with pytest.raises(SkippedStepsError, match=r"2 steps in a row skipped \(steps 3\.\.4; "
                                                r"grpo.max_consecutive_skipped_steps 2\); last reason: non-finite "
                                                r"gradient"):
        skips.check(4)


class _CountingRefit:
    def __init__(self):
        self.pushes: list[bool] = []

    def push(self, reset: bool) -> dict:
        self.pushes.append(reset)
        return {"version": 1, "bytes": 10}


def test_a_push_after_a_skipped_step_sends_nothing_and_a_reset_push_still_does():
    job = LearnerJob.__new__(LearnerJob)
    job.id, job.version, job.pushed_version, job.refit = "learner-x", 0, -1, _CountingRefit()
    assert job.push_weights(reset=True) == {"version": 1, "bytes": 10}   # start: v0 on every engine
    job.version = 1                                                     # a step applied
    assert job.push_weights()["bytes"] == 10
    assert job.push_weights() == {} and job.last_refit == {}            # a skipped step: v1 is there already
    assert job.push_weights(reset=True)["bytes"] == 10                   # a restarted engine waits for v1
    assert job.refit.pushes == [True, False, True]
