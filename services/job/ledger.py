"""Exactly-once accounting of prompts (design invariant 3).

Every prompt the learner schedules gets one entry: ``scheduled`` (with the
step it is for), then exactly one of ``trained`` (at step k) or ``dropped``
(with a reason: stale, too few valid samples, generation failed, ...).
Training a prompt twice, or finishing one that was never scheduled, raises.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class LedgerError(RuntimeError):
    """A prompt was trained twice, or finished without being scheduled."""


@dataclass(frozen=True)
class LedgerSummary:
    """The ledger's counts at one moment."""

    scheduled: int
    trained: int
    dropped: int
    pending: int
    """Scheduled, neither trained nor dropped yet."""
    dropped_by_reason: dict[str, int]

    def line(self) -> str:
        """One line for the operator: ``12 scheduled, 10 trained, 2 dropped (stale 2), 0 pending``."""
        why = ", ".join(f"{reason} {n}" for reason, n in sorted(self.dropped_by_reason.items()))
        dropped = f"{self.dropped} dropped" + (f" ({why})" if why else "")
        return f"{self.scheduled} scheduled, {self.trained} trained, {dropped}, {self.pending} pending"


@dataclass
class PromptLedger:
    scheduled: dict[str, int] = field(default_factory=dict)
    trained: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)

    def schedule(self, prompt_id: str, step: int) -> None:
        if prompt_id in self.scheduled:
            raise LedgerError(f"prompt {prompt_id!r} scheduled twice (steps {self.scheduled[prompt_id]} and {step})")
        self.scheduled[prompt_id] = step

    def mark_trained(self, prompt_id: str, step: int) -> None:
        self._check_open(prompt_id)
        self.trained[prompt_id] = step

    def mark_dropped(self, prompt_id: str, reason: str) -> None:
        self._check_open(prompt_id)
        self.dropped[prompt_id] = reason

    def is_open(self, prompt_id: str) -> bool:
        return prompt_id in self.scheduled and prompt_id not in self.trained and prompt_id not in self.dropped

    def _check_open(self, prompt_id: str) -> None:
        if prompt_id not in self.scheduled:
            raise LedgerError(f"prompt {prompt_id!r} was never scheduled")
        if prompt_id in self.trained:
            raise LedgerError(f"prompt {prompt_id!r} already trained at step {self.trained[prompt_id]}")
        if prompt_id in self.dropped:
            raise LedgerError(f"prompt {prompt_id!r} already dropped ({self.dropped[prompt_id]})")

    def pending(self) -> dict[str, int]:
        """Scheduled prompts with no outcome yet -> their step."""
        return {p: s for p, s in self.scheduled.items() if p not in self.trained and p not in self.dropped}

    def per_step(self, dropped_for: str | None = None) -> Counter:
        """Prompts scheduled for each step (all of them, or only those dropped with reason ``dropped_for``)."""
        return Counter(s for p, s in self.scheduled.items()
                       if dropped_for is None or self.dropped.get(p) == dropped_for)

    def summary(self) -> LedgerSummary:
        return LedgerSummary(len(self.scheduled), len(self.trained), len(self.dropped), len(self.pending()),
                             dict(Counter(self.dropped.values())))

    def state(self) -> dict:
        return {"scheduled": self.scheduled, "trained": self.trained, "dropped": self.dropped}

    @classmethod
    def from_state(cls, state: dict) -> PromptLedger:
        return cls(dict(state["scheduled"]), dict(state["trained"]), dict(state["dropped"]))
