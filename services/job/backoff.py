"""Back-off for prompts that replace failed ones.

A prompt whose generation failed (every sample errored, too few valid samples,
or its group could not be delivered) is dropped and replaced by a fresh prompt
from the data source. When the pool fails *every* prompt within milliseconds
(an engine that cannot generate at all), replacing at once turns into churn:
the learner drew ~27 prompts/s from its source until the step deadline.

So the replacement is drawn at once (the ledger and a checkpoint see it like
any scheduled prompt, and a resumed job submits it) but *submitted* to the pool
only after a delay that doubles with each failure in a row:
0 for the first, then ``base_s``, 2 x ``base_s``, ... up to ``max_s``. The
count starts again once a group passes screening. Prompts dropped for other
reasons (``stale``) are replaced at once.
"""
from __future__ import annotations

import time
from collections.abc import Callable

FAILURE_REASONS = frozenset({"generation_failed", "too_few_valid_samples", "undelivered"})
"""Drop reasons that mean the pool failed the prompt (these replacements back off)."""


class ReplacementBackoff:
    """Failures in a row, and the replacement prompts held until their submission time."""

    def __init__(self, base_s: float = 0.5, max_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.base_s, self.max_s, self.clock = base_s, max_s, clock
        self.failures_in_a_row = 0
        self.held: list[tuple[float, list]] = []

    def delay_after(self, reason: str) -> float:
        """Seconds to hold the replacement of a prompt dropped for ``reason``."""
        if reason not in FAILURE_REASONS:
            return 0.0
        self.failures_in_a_row += 1
        if self.failures_in_a_row == 1:
            return 0.0
        return min(self.max_s, self.base_s * 2.0 ** min(self.failures_in_a_row - 2, 60))  # no overflow

    def succeeded(self) -> None:
        self.failures_in_a_row = 0

    def hold(self, requests: list, delay_s: float) -> None:
        self.held.append((self.clock() + delay_s, requests))

    def due(self) -> list:
        """The held requests whose time has come (removed from the hold)."""
        now = self.clock()
        out = [r for t, reqs in self.held if t <= now for r in reqs]
        self.held = [(t, reqs) for t, reqs in self.held if t > now]
        return out

    def next_due_in(self) -> float | None:
        """Seconds until the next held request is due; None when nothing is held."""
        return max(0.0, min(t for t, _ in self.held) - self.clock()) if self.held else None
