"""Failed samples of a learner job, with their reasons: ``RUN_DIR/failures.jsonl`` and the step row's counts.

Every group the job accepts from the pool (buffered, or dropped later for too few valid samples, age or dynamic
sampling) and every prompt whose generation failed as a whole is recorded here as it arrives: one line per
(group, kind, reason) with the number of samples that failed so, and counts for the next step row:
``failed_samples`` (all failed samples received since the last row, whatever became of their groups) and
``failed_samples_<kind>`` for each kind of :data:`protocol.FAILURE_KINDS`. Validation's failed answers are recorded
too (``val:`` prompt ids, ``step`` the step validated at) and counted in the row's ``val_failed_samples`` instead.
The lines are appended; after a resume a prompt generated again is recorded again.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from protocol import FAILURE_KINDS, TrajectoryGroup

log = logging.getLogger("inflight.job")
FILE = "failures.jsonl"
UNKNOWN = "unknown"
"""The kind of a failed sample from a sender that does not say (an older engine)."""
MAX_REASON_CHARS = 1000


@dataclass(frozen=True)
class FailureRecord:
    """One line of ``failures.jsonl``: samples of one group that failed for one reason."""

    step: int
    """The step the prompt was scheduled for."""
    prompt_id: str
    kind: str
    """What failed them: one of :data:`protocol.FAILURE_KINDS`, or ``unknown``."""
    reason: str
    """The reason, as the engine, environment or reward function gave it."""
    samples: int
    """How many samples of the group failed so (the group size for a prompt whose generation failed whole)."""
    source: str
    """The recipe's environment (``data.env_name``) or reward function (``env.reward_fn``)."""
    group_id: str = ""
    """The group's id ('' for a prompt that failed whole)."""
    engine_id: str = ""
    """The engine that sampled it."""


class FailureLog:
    def __init__(self, run_dir: str | Path | None, source: str, group_size: int):
        """Append to ``run_dir/failures.jsonl`` (None: count only); ``source`` names the environment or reward
        function in every line, ``group_size`` is what a prompt that failed whole counts."""
        self.path = Path(run_dir) / FILE if run_dir is not None else None
        self.source, self.group_size = source, group_size
        self.counts: Counter = Counter()
        """Failed samples by kind since the last :meth:`take_counts`."""
        self._failed_writing = False

    def group(self, group: TrajectoryGroup, step: int | None = None, count: bool = True) -> list[FailureRecord]:
        """Record the failed samples of ``group`` (at ``step``, default its scheduled step), one line per (kind,
        reason), counted for the next row unless not ``count`` (validation); returns the lines."""
        by_reason = Counter((t.failure_kind or UNKNOWN, t.error) for t in group.trajectories if not t.ok)
        records = [FailureRecord(group.scheduled_step if step is None else step, group.prompt_id, kind,
                                 reason[:MAX_REASON_CHARS], n, self.source, group.group_id, group.engine_id)
                   for (kind, reason), n in sorted(by_reason.items())]
        self._write(records, count)
        return records

    def prompt(self, prompt_id: str, step: int, reason: str, engine_id: str = "", samples: int | None = None,
               count: bool = True) -> FailureRecord:
        """Record a prompt whose generation failed as a whole (no group came): ``samples`` (default
        ``group_size``) failed samples, counted unless not ``count``."""
        record = FailureRecord(step, prompt_id, "generation", reason[:MAX_REASON_CHARS],
                               self.group_size if samples is None else samples, self.source, "", engine_id)
        self._write([record], count)
        return record

    def take_counts(self) -> dict[str, int]:
        """The step row's ``failed_samples`` and ``failed_samples_<kind>`` since the last call, cleared."""
        out = {"failed_samples": sum(self.counts.values())}
        out.update({f"failed_samples_{k}": self.counts.get(k, 0) for k in (*FAILURE_KINDS, UNKNOWN)
                    if k != UNKNOWN or self.counts.get(k)})
        self.counts = Counter()
        return out

    def _write(self, records: list[FailureRecord], count: bool = True) -> None:
        for r in records:
            self.counts[r.kind] += r.samples if count else 0
        if not records or self.path is None or self._failed_writing:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.writelines(json.dumps(asdict(r), sort_keys=True) + "\n" for r in records)
        except OSError as exc:  # the counts still reach the step rows
            self._failed_writing = True
            log.warning("could not write %s (%s); failed samples are counted in the step rows only", self.path, exc)
