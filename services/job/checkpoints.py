"""A learner job's checkpoints: where they live, what the job adds to the learner's, and which is latest.

A checkpoint is the learner's own (model, optimizer, RNG, policy version, written by its ranks) with the
job's :class:`JobState` as its ``extra``: the step, the prompt book (data position, ledger, buffered
groups, open requests, drop counts) and the parity set (invariant 7). They go to
``checkpointing.checkpoint_dir`` (relative to the run directory unless absolute) as ``step_<k>``;
``latest`` names the newest. Which are kept: :func:`kept` (the best ``keep_top_k`` by
``checkpointing.metric_name``, plus the newest; or the newest ``keep_top_k``). Each checkpoint's metric
value is stored next to it (``step_<k>/job_metric.json``), so the ranking survives a restart. With
``checkpointing.save_hf`` each also holds the policy in Hugging Face format (``step_<k>/hf``).

``latest`` is written atomically (:mod:`services.job.checkpoint_marker`); when it is missing, empty, unreadable
or names a step that is not complete on disk, the newest complete step is used, with a warning; a ``latest`` or
step directory that is a symlink, or a name leading outside the checkpoint directory, is refused.
"""
from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.job.checkpoint_marker import LATEST, latest_complete, step_dir, write_atomic
from services.job.parity import Sequences
from services.job.prompt_book import BookState

if TYPE_CHECKING:
    from services.job.learner_group import LearnerGroup
    from services.recipe.config import CheckpointingConfig

METRIC_FILE = "job_metric.json"
"""In a checkpoint directory: ``{"step", "metric_name", "value"}`` (value None when the step's row had none)."""
HF_DIR = "hf"
"""In a checkpoint directory, with ``checkpointing.save_hf``: the policy as a Hugging Face directory."""


@dataclass(frozen=True)
class Ranked:
    """A checkpoint on disk and the value of the ranking metric at its step (None: the row had none)."""

    step: int
    value: float | None


def kept(checkpoints: list[Ranked], keep_top_k: int, metric_name: str | None, higher_is_better: bool) -> set[int]:
    """The steps whose checkpoints are kept.

    With ``metric_name``: the best ``keep_top_k`` by their value (largest first if ``higher_is_better``;
    ties go to the newer step), plus always the newest (it is ``latest``, the one a run resumes from). A
    checkpoint whose step has no value of the metric (None or not finite: e.g. no validation ran at that
    step) ranks after every one that has. Without ``metric_name``: the newest ``keep_top_k``."""
    if not checkpoints:
        return set()
    newest = max(c.step for c in checkpoints)
    if metric_name is None:
        return {c.step for c in sorted(checkpoints, key=lambda c: c.step)[-keep_top_k:]}

    def rank(c: Ranked) -> tuple[int, float, int]:
        if c.value is None or not math.isfinite(c.value):
            return (1, 0.0, -c.step)
        return (0, -c.value if higher_is_better else c.value, -c.step)
    best = sorted(checkpoints, key=rank)[:keep_top_k]
    return {c.step for c in best} | {newest}


@dataclass
class JobState:
    """The job's part of a checkpoint."""

    step: int
    book: BookState
    parity_set: Sequences

    def extra(self) -> dict:
        b = self.book
        return {"step": self.step, "data_position": b.data_position, "ledger": b.ledger, "buffer": b.buffer,
                "open_requests": b.open_requests, "parity_set": self.parity_set, "drops": b.drops}

    @classmethod
    def of(cls, extra: dict) -> JobState:
        book = BookState(extra["data_position"], extra["ledger"], list(extra["buffer"]), list(extra["open_requests"]),
                         dict(extra.get("drops", {})))
        return cls(int(extra["step"]), book, [(list(p), list(r)) for p, r in extra["parity_set"]])


class Checkpoints:
    def __init__(self, cfg: CheckpointingConfig, run_dir: Path):
        self.cfg = cfg
        root = Path(cfg.checkpoint_dir)
        self.root = root if root.is_absolute() else run_dir / root

    def due(self, step: int, last_step: int) -> bool:
        """Whether the job saves after ``step``: every ``save_period`` steps and after the last one."""
        return self.cfg.enabled and (step % self.cfg.save_period == 0 or step == last_step)

    def save(self, learner: LearnerGroup, state: JobState, row: dict | None = None) -> Path:
        """Write ``step_<k>`` with the value of ``metric_name`` in ``row`` (the step's row) next to it, point
        ``latest`` at it and remove the checkpoints :func:`kept` does not keep."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"step_{state.step:06d}"
        learner.save_checkpoint(str(path), state.extra())
        if self.cfg.save_hf:
            learner.save_hf(str(path / HF_DIR))
        name = self.cfg.metric_name
        value = (row or {}).get(name) if name else None
        value = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
        (path / METRIC_FILE).write_text(json.dumps({"step": state.step, "metric_name": name, "value": value}))
        write_atomic(self.root / LATEST, path.name)
        on_disk = self.ranked()
        keep = kept(on_disk, self.cfg.keep_top_k, name, self.cfg.higher_is_better)
        for c in on_disk:
            if c.step not in keep:
                shutil.rmtree(self.root / f"step_{c.step:06d}", ignore_errors=True)
        return path

    def ranked(self) -> list[Ranked]:
        """The checkpoints on disk with their stored metric value (None if missing, or stored for another
        metric name)."""
        out = []
        for d in sorted(self.root.glob("step_*")):
            try:
                step = int(d.name.removeprefix("step_"))
            except ValueError:
                continue
            value = None
            try:
                stored = json.loads((d / METRIC_FILE).read_text())
                if stored.get("metric_name") == self.cfg.metric_name and stored.get("value") is not None:
                    value = float(stored["value"])
            except (OSError, ValueError, TypeError):
                pass  # a checkpoint written before metrics were stored, or by another job: ranks last
            out.append(Ranked(step, value))
        return out

    def latest(self) -> Path | None:
        """The checkpoint a run resumes from: what ``latest`` names, or the newest complete step (with a warning)
        when it cannot be used; None when there is none. ``CheckpointRefused`` for a symlink or a name outside
        the checkpoint directory."""
        return latest_complete(self.root)

    def step(self, step: int) -> Path:
        """``step_<step>``, complete on disk; ``CheckpointRefused`` (one line) otherwise."""
        return step_dir(self.root, step)

    def load_latest(self, learner: LearnerGroup) -> tuple[Path, JobState] | None:
        """Load the latest checkpoint (:meth:`latest`) into the learner's ranks; its path and the job's state, or
        None if there is none."""
        path = self.latest()
        if path is None:
            return None
        return path, JobState.of(learner.load_checkpoint(str(path)))
