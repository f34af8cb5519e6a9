"""``inflight run`` and ``learner attach`` on a run directory: start a run, resume the one it holds, or
(``--fresh``) start over.

What :func:`start_or_resume` decides, before anything starts (Ray, the pool, the learner):

- The directory holds a complete checkpoint (:meth:`services.job.checkpoints.Checkpoints.latest`): the run
  **resumes** from it the way ``learner attach`` does (``LearnerJob(resume=True)``: weights, optimizer, RNG,
  policy version, data position, buffered groups); ``metrics.jsonl`` keeps its rows up to the checkpoint's step
  and continues after it; no checkpoint is overwritten (the next save is a later step). One line says so. A
  checkpoint at or past ``grpo.max_num_steps`` leaves nothing to run: one line says so and nothing starts.
- It holds rows in ``metrics.jsonl`` but no complete checkpoint: refused (starting again would write steps 1..
  into the record a second time): ``--fresh`` or another ``--run-dir``.
- ``--fresh``: everything in the run directory moves to ``RUN_DIR/previous/<UTC time>/`` (a checkpoint
  directory outside it: its ``step_*`` and ``latest`` move to ``<checkpoint_dir>/previous-<UTC time>/``);
  nothing is deleted, and the run starts at step 1.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.job.checkpoint_marker import LATEST, STEP_NAME, CheckpointRefused
from services.job.checkpoints import Checkpoints

if TYPE_CHECKING:
    from services.recipe.config import Recipe

PREVIOUS = "previous"
"""In a run directory: where ``--fresh`` moves an earlier run's files (one ``<UTC time>`` folder per start-over)."""
EXIT_USER_ERROR = 2


class RunDirError(Exception):
    """A run directory ``inflight run`` does not start in (one line saying what to do instead)."""


@dataclass(frozen=True)
class RunStart:
    """How ``inflight run`` starts in its run directory."""

    resume_from: Path | None
    """The checkpoint the run resumes from (None: a fresh run from step 1)."""
    step: int
    """The step of that checkpoint (0 for a fresh run); the run continues at ``step + 1``."""
    moved_to: Path | None = None
    """With ``--fresh``: where the earlier run's files went (None if there were none)."""

    def finished(self, max_steps: int) -> bool:
        """Whether the checkpoint is already at ``grpo.max_num_steps`` (nothing left to run)."""
        return self.resume_from is not None and self.step >= max_steps


def start_or_resume(recipe: Recipe, run_dir: Path, fresh: bool) -> RunStart:
    """How to start in ``run_dir`` (see the module docstring); ``RunDirError`` when it must not start."""
    checkpoints = Checkpoints(recipe.checkpointing, run_dir)
    if fresh:
        return RunStart(None, 0, _move_aside(run_dir, checkpoints.root))
    try:
        latest = checkpoints.latest()
    except CheckpointRefused as err:
        raise RunDirError(f"{err}; or pass --fresh to start over") from None
    if latest is not None:
        m = STEP_NAME.fullmatch(latest.name)
        return RunStart(latest, int(m.group(1)) if m else 0)
    rows = _logged_steps(run_dir / "metrics.jsonl")
    if rows:
        raise RunDirError(f"{run_dir} holds a run (metrics.jsonl: steps {rows[0]}..{rows[-1]}) but no complete "
                          f"checkpoint in {checkpoints.root} to resume from: pass --fresh to start over (its files "
                          f"move to {run_dir / PREVIOUS}/) or choose another --run-dir")
    return RunStart(None, 0)


def announced_start(recipe: Recipe, run_dir: Path, fresh: bool) -> RunStart | int:
    """:func:`start_or_resume` for ``inflight run`` and ``learner attach``, said in one line on stderr: the
    start, or the exit code when nothing is to run (2: the directory is refused; 0: it is at its last step)."""
    try:
        start = start_or_resume(recipe, run_dir, fresh)
    except RunDirError as err:
        print(f"inflight: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    last = recipe.grpo.max_num_steps
    if start.moved_to is not None:
        print(f"inflight: --fresh: the earlier run's files moved to {start.moved_to}; starting at step 1",
              file=sys.stderr)
    if start.finished(last):
        print(f"inflight: {run_dir} is at step {start.step} already ({start.resume_from}; grpo.max_num_steps is "
              f"{last}): nothing to run; raise --steps to go on, or --fresh to start over", file=sys.stderr)
        return 0
    if start.resume_from is not None:
        print(f"inflight: resuming {run_dir} from {start.resume_from.name} (step {start.step}): steps "
              f"{start.step + 1}..{last} follow; --fresh starts over", file=sys.stderr)
    return start


def run(recipe: Recipe, run_dir: Path, fresh: bool = False, verbose: bool = False) -> int:
    """``inflight run``: decide how to start (:func:`announced_start`), run the whole loop on this machine
    (:func:`services.app.run_embedded`); the exit code."""
    from services.app import run_embedded
    from services.console import output as console

    start = announced_start(recipe, run_dir, fresh)
    if isinstance(start, int):
        return start
    console.setup(run_dir, verbose=verbose)
    run_embedded(recipe, run_dir, resume=start.resume_from is not None)
    return 0


def _logged_steps(metrics: Path) -> list[int]:
    """The training steps (>= 1) ``metrics.jsonl`` has rows of, in file order; [] without the file."""
    try:
        lines = metrics.read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as err:
        raise RunDirError(f"{metrics}: cannot be read ({err.strerror or err})") from None
    steps = []
    for line in lines:
        try:
            step = json.loads(line).get("step") if line.strip() else None
        except (ValueError, AttributeError):
            step = None
        if isinstance(step, int) and step >= 1:
            steps.append(step)
    return steps


def _move_aside(run_dir: Path, ckpt_root: Path) -> Path | None:
    """``--fresh``: move the run directory's entries (but ``previous``) to ``previous/<UTC time>``, and the
    ``step_*`` / ``latest`` of a checkpoint directory outside it to ``<checkpoint_dir>/previous-<UTC time>``;
    where the run directory's went (None if it held nothing)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    moved = None
    try:
        entries = [p for p in run_dir.iterdir() if p.name != PREVIOUS] if run_dir.is_dir() else []
        if entries:
            moved = run_dir / PREVIOUS / stamp
            moved.mkdir(parents=True)
            for p in entries:
                p.rename(moved / p.name)
        resolved = ckpt_root.resolve()
        if ckpt_root.is_dir() and run_dir.resolve() not in resolved.parents:
            own = [p for p in ckpt_root.iterdir() if p.name == LATEST or STEP_NAME.fullmatch(p.name)]
            if own:
                aside = ckpt_root / f"{PREVIOUS}-{stamp}"
                aside.mkdir()
                for p in own:
                    p.rename(aside / p.name)
    except OSError as err:
        raise RunDirError(f"--fresh: could not move the earlier run's files aside in {run_dir} "
                          f"({err.strerror or err}: {err.filename})") from None
    return moved
