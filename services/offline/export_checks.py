"""``inflight export``'s checks before anything heavy runs, and how its output lands.

- :func:`check_layout`: the run's ``recipe.yaml`` (or ``--recipe``) must ask for the parallel layout the checkpoint
  was saved with (TP, EP: ``meta.json``); an edited TP size is one line naming both values, not a Megatron
  traceback. A recipe edited to another model is caught when the ranks load the checkpoint
  (:func:`learner.checkpoint.check_model_state`: one line naming the first tensor that differs).
- :func:`check_out`: ``--out`` must be a directory that is new, empty, or (with ``--overwrite``) an old export;
  a file, an unwritable place, or a non-empty directory without ``--overwrite`` is one line. The export is
  written into a fresh directory beside ``--out`` (:func:`staging_dir`) and moved into place by
  :func:`install_out` once complete, so a failed export leaves ``--out`` as it was and ``--overwrite`` leaves no
  stale file of another model.
"""
from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.recipe.config import Recipe


class ExportError(Exception):
    """A run directory, recipe, checkpoint or ``--out`` that cannot be exported; the message says what is wrong."""


def check_layout(recipe: Recipe, recipe_path: Path, meta: dict, ckpt: Path) -> None:
    """``ExportError`` unless ``recipe``'s TP, PP and EP are those ``meta`` (the checkpoint's) was saved with."""
    m = recipe.policy.megatron_cfg
    pairs = [("tensor_model_parallel_size", m.tensor_model_parallel_size, meta.get("tp", 1)),
             ("pipeline_model_parallel_size", m.pipeline_model_parallel_size, meta.get("pp", 1)),
             ("expert_model_parallel_size", m.expert_model_parallel_size, meta.get("ep", 1))]
    for key, want, saved in pairs:
        if saved is not None and int(saved) != want:
            raise ExportError(f"{recipe_path}: policy.megatron_cfg.{key} is {want}, but checkpoint {ckpt} was saved "
                              f"with {saved} (world size {meta.get('world_size', 1)}): restore the run's recipe")


def check_out(out: Path, overwrite: bool, run_dir: Path) -> None:
    """``ExportError`` (one line) unless the export may go to ``out``."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; expected a directory (new, empty, or an old export with "
                          "--overwrite)")
    if out.is_dir():
        try:
            entries = sorted(p.name for p in out.iterdir())
        except OSError as err:
            raise ExportError(f"--out {out} cannot be read: {err.strerror or err}") from None
        if entries and not overwrite:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ExportError(f"--out {out} is not empty ({len(entries)} entries: {shown}): pass --overwrite to "
                              "replace it, or choose a new directory")
        if entries and _holds_something_precious(out, run_dir):
            raise ExportError(f"--out {out} holds the run directory {run_dir}, the home or the current directory: "
                              "refused even with --overwrite (it would be removed); choose a new directory")
        if not os.access(out, os.W_OK):
            raise ExportError(f"--out {out} is not writable")
    parent = next((p for p in out.absolute().parents if p.exists()), Path("/"))
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ExportError(f"--out {out} cannot be written: {parent} is "
                          f"{'not a directory' if not parent.is_dir() else 'not writable'}")


def staging_dir(out: Path) -> Path:
    """A new empty directory beside ``out`` for the export to be written into."""
    tmp = out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as err:
        raise ExportError(f"--out {out} cannot be written: {err.strerror or err}") from None
    return tmp


def install_out(tmp: Path, out: Path) -> None:
    """Move the complete export ``tmp`` to ``out``; an old ``out`` (checked by :func:`check_out`) goes."""
    old = None
    if out.is_dir():
        old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _holds_something_precious(out: Path, run_dir: Path) -> bool:
    """Whether removing ``out`` would remove the run directory, the home directory or the current one."""
    target = out.resolve()
    return any(p == target or target in p.parents for p in (run_dir.resolve(), Path.home().resolve(), Path.cwd()))
