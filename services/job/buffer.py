"""The learner's trajectory buffer with exact target-step scheduling.

Each group arrives stamped with ``scheduled_step`` (the learner step it was
generated for) and per-token policy versions; ``take(step, n)`` hands out
exactly ``n`` screened groups for ``step``. ``screen`` refuses, drops and
counts (never silently uses) a group that is **stale**
(``version - oldest_token_version > max_trajectory_age_steps``, ``version``
being the learner's at the start of the step; only sampled tokens count,
``TrajectoryGroup.oldest_version``) or has **fewer than two valid
samples** (failed samples carry no reward: no advantage can be formed).
Groups for later steps wait; a second group for a buffered prompt is refused
by ``add``. The raw protocol bytes are kept beside each group so the learner
actors decode them without re-encoding. ``drops`` also counts the groups the
prompt book drops before buffering them (dynamic sampling's ``zero_advantage``).
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from protocol import TrajectoryGroup


@dataclass
class BufferedGroup:
    group: TrajectoryGroup
    data: bytes


@dataclass
class TrajectoryBuffer:
    max_age: int
    by_step: dict[int, list[BufferedGroup]] = field(default_factory=lambda: defaultdict(list))
    drops: Counter = field(default_factory=Counter)

    def add(self, group: TrajectoryGroup, data: bytes) -> bool:
        """Buffer ``group``; False (nothing buffered) if a group of its prompt is already here."""
        if self.holds(group.prompt_id):
            return False
        self.by_step[group.scheduled_step].append(BufferedGroup(group, data))
        return True

    def holds(self, prompt_id: str) -> bool:
        return any(bg.group.prompt_id == prompt_id for groups in self.by_step.values() for bg in groups)

    def ready(self, step: int) -> int:
        return len(self.by_step.get(step, ()))

    def screen(self, step: int, version: int) -> list[tuple[TrajectoryGroup, str]]:
        """Remove and return the groups of ``step`` that must be dropped, with reasons."""
        keep, dropped = [], []
        for bg in self.by_step.get(step, []):
            reason = self.reject_reason(bg.group, version)
            if reason:
                self.drops[reason] += 1
                dropped.append((bg.group, reason))
            else:
                keep.append(bg)
        if step in self.by_step:
            self.by_step[step] = keep
        return dropped

    def reject_reason(self, group: TrajectoryGroup, version: int) -> str | None:
        if len(group.valid) < 2:
            return "too_few_valid_samples"
        if version - group.oldest_version > self.max_age:
            return "stale"
        return None

    def take(self, step: int, n: int) -> list[BufferedGroup]:
        """The first ``n`` screened groups of ``step`` (call ``screen`` first)."""
        groups = self.by_step.get(step, [])
        if len(groups) < n:
            raise ValueError(f"buffer: step {step} has {len(groups)} groups, {n} requested")
        out, self.by_step[step] = groups[:n], groups[n:]
        if not self.by_step[step]:
            del self.by_step[step]
        return out

    def __len__(self) -> int:
        return sum(len(v) for v in self.by_step.values())

    def all_groups(self) -> list[BufferedGroup]:
        return [bg for step in sorted(self.by_step) for bg in self.by_step[step]]
