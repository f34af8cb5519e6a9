"""A learner job's checkpoints: where they live, what the job adds to the learner's, and which is latest.

A checkpoint is the learner's own (model, optimizer, RNG, policy version, written by its ranks) with the
job's :class:`JobState` as its ``extra``: the step, the prompt book (data position, ledger, buffered
groups, open requests, drop counts) and the parity set (invariant 7). They go to
``checkpointing.checkpoint_dir`` (relative to the run directory unless absolute) as ``step_<k>``;
``latest`` names the newest and only ``keep_top_k`` are kept.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.job.parity import Sequences
from services.job.prompt_book import BookState

if TYPE_CHECKING:
    from services.config import CheckpointingConfig
    from services.job.learner_actor import LearnerGroup


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

    def save(self, learner: LearnerGroup, state: JobState) -> Path:
        """Write ``step_<k>``, point ``latest`` at it and remove all but the newest ``keep_top_k``."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"step_{state.step:06d}"
        learner.call("save_checkpoint", str(path), state.extra())
        (self.root / "latest").write_text(path.name)
        for old in sorted(self.root.glob("step_*"))[:-self.cfg.keep_top_k]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def load_latest(self, learner: LearnerGroup) -> tuple[Path, JobState] | None:
        """Load the latest checkpoint into the learner's ranks; its path and the job's state, or None if there
        is none."""
        marker = self.root / "latest"
        if not marker.exists():
            return None
        path = self.root / marker.read_text().strip()
        return path, JobState.of(learner.call("load_checkpoint", str(path)))
