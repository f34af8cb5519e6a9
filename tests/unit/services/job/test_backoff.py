"""Back-off of replacements for failed prompts (services/job/backoff.py)."""
from __future__ import annotations

from services.job.backoff import ReplacementBackoff


def test_replacement_backoff_doubles_per_failure_in_a_row_and_starts_again_after_a_good_group():
    now = [100.0]
    backoff = ReplacementBackoff(base_s=0.5, max_s=4.0, clock=lambda: now[0])
    assert [backoff.delay_after("too_few_valid_samples") for _ in range(6)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0]
    assert backoff.delay_after("stale") == 0.0 and backoff.failures_in_a_row == 6  # not a failure of the pool
    for _ in range(2000):  # hours of failures in a row stay at the cap
        assert backoff.delay_after("generation_failed") <= 4.0
    backoff.succeeded()
    assert backoff.delay_after("generation_failed") == 0.0 and backoff.delay_after("undelivered") == 0.5
    backoff.hold(["a"], 1.0)
    backoff.hold(["b", "c"], 0.25)
    assert backoff.next_due_in() == 0.25 and backoff.due() == []
    now[0] += 0.5
    assert backoff.due() == ["b", "c"] and backoff.next_due_in() == 0.5
    now[0] += 0.5
    assert backoff.due() == ["a"] and backoff.next_due_in() is None
