"""Skipped learner steps (services/job/skips.py): counted, in a row and in total; too many in a row stop the job
with the learner's reason (a push after one sends nothing: test_learner_job.py)."""
from __future__ import annotations

import pytest

from services.job.skips import SkippedSteps, SkippedStepsError

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
