"""Learner steps the learner skipped, and when they stop the job.

The learner skips a step (weights, optimizer state and ``policy_version``
untouched) after a non-finite loss or gradient, or for a batch without valid
response tokens; its metrics say ``step_skipped = 1`` and ``skip_reason``. The
job then pushes nothing (every engine already serves that version) and drops
the step's prompts with reason ``step_skipped`` (invariant 3: they were not
trained). A few skips are survivable noise; ``grpo.max_consecutive_skipped_steps``
of them in a row mean the run cannot make progress, and the job stops with
:class:`SkippedStepsError` naming the learner's last reason.
"""
from __future__ import annotations

DROP_REASON = "step_skipped"
"""The ledger's drop reason for the prompts of a skipped step."""


class SkippedStepsError(RuntimeError):
    """``grpo.max_consecutive_skipped_steps`` learner steps in a row were skipped."""


class SkippedSteps:
    """Skipped learner steps: in total and in a row (reset by an applied step)."""

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0
        self.last_reason = ""

    def record(self, metrics: dict) -> bool:
        """Count one ``train_step``'s outcome; True if the learner skipped it."""
        if not metrics.get("step_skipped"):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.total += 1
        self.last_reason = str(metrics.get("skip_reason") or "no reason given")
        return True

    def check(self, step: int) -> None:
        """Raise :class:`SkippedStepsError` once ``max_in_a_row`` steps in a row, up to ``step``, were skipped."""
        if self.in_a_row >= self.max_in_a_row:
            raise SkippedStepsError(
                f"learner: {self.in_a_row} steps in a row skipped (steps {step - self.in_a_row + 1}..{step}; "
                f"grpo.max_consecutive_skipped_steps {self.max_in_a_row}); last reason: {self.last_reason}")
