"""Which checkpoint of a run is the one to resume from or export: the ``latest`` marker, read defensively.

``latest`` is a small file in the checkpoint directory naming the newest ``step_NNNNNN``. It is written
atomically (:func:`write_atomic`: a temporary file, fsync, ``os.replace``, fsync of the directory), so a kill
leaves the old name or the new one, never an empty file. When it is missing, empty, unreadable or names a step
that is not complete on disk (no ``meta.json`` or a rank file missing), :func:`latest_complete` uses the newest
complete step and says so in a warning. A ``latest`` that is a symlink, that names anything but a directory of
the checkpoint directory itself (``../x``, ``/etc``), or that names a step directory that is a symlink is
refused (:class:`CheckpointRefused`, one line): a checkpoint is loaded only from where the run wrote it.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from learner.checkpoint import META_FILE, rank_file

log = logging.getLogger("inflight.checkpoints")

LATEST = "latest"
"""In the checkpoint directory: the name of the newest checkpoint (``step_NNNNNN``)."""
STEP_NAME = re.compile(r"step_(\d{6,})")
"""A checkpoint directory's name."""


class CheckpointRefused(ValueError):
    """A ``latest`` marker or step directory that is not loaded: a symlink, or a name outside the checkpoint
    directory; the message names the path and the reason."""


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` by a file holding ``text``: written to a temporary file beside it, flushed to disk,
    renamed over it (``os.replace`` is atomic), and the directory flushed so the rename survives a crash."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (None if it is): it must be a directory, not a symlink, with a
    readable ``meta.json`` and one rank file per rank of its world size."""
    if path.is_symlink():
        return "is a symlink"
    if not path.is_dir():
        return "does not exist"
    try:
        world = int(json.loads((path / META_FILE).read_text()).get("world_size", 1))
    except (OSError, ValueError, TypeError, AttributeError):
        return f"has no readable {META_FILE}"
    missing = [rank_file(path, r).name for r in range(max(world, 1)) if not rank_file(path, r).is_file()]
    return f"lacks {', '.join(missing)}" if missing else None


def step_dir(root: Path, step: int) -> Path:
    """``root/step_<step>`` if it is a complete checkpoint; ``CheckpointRefused`` for a symlink,
    ``FileNotFoundError`` (naming the steps on disk) otherwise."""
    path = root / f"step_{step:06d}"
    reason = incomplete_reason(path)
    if reason == "is a symlink":
        raise CheckpointRefused(f"checkpoint {path} is a symlink: refused (a checkpoint is loaded only from the "
                                "directory the run wrote)")
    if reason is not None:
        steps = ", ".join(str(s) for s in complete_steps(root)) or "none"
        raise FileNotFoundError(f"no checkpoint of step {step} in {root}: {path.name} {reason} "
                                f"(complete steps: {steps})")
    return path


def complete_steps(root: Path) -> list[int]:
    """The steps of the complete checkpoints in ``root``, oldest first (symlinked ones are left out)."""
    out = []
    for d in root.glob("step_*") if root.is_dir() else []:
        m = STEP_NAME.fullmatch(d.name)
        if m and incomplete_reason(d) is None:
            out.append(int(m.group(1)))
    return sorted(out)


def _marker_name(marker: Path) -> tuple[str | None, str]:
    """The name ``latest`` holds (None when it gives none) and, if none, why."""
    if marker.is_symlink():
        raise CheckpointRefused(f"{marker} is a symlink: refused (Inflight writes it as a file; remove it to "
                                "resume from the newest complete checkpoint)")
    try:
        name = marker.read_text().strip()
    except FileNotFoundError:
        return None, "is missing"
    except (OSError, UnicodeDecodeError) as err:
        return None, f"is unreadable ({err})"
    if not name:
        return None, "is empty"
    if "/" in name or "\\" in name or name.startswith("."):
        raise CheckpointRefused(f"{marker} names {name!r}, outside the checkpoint directory {marker.parent}: "
                                "refused")
    return name, ""


def latest_complete(root: Path) -> Path | None:
    """The checkpoint ``root/latest`` names if it is complete, else the newest complete step (warning why);
    None when ``root`` holds no complete checkpoint."""
    marker = root / LATEST
    if not root.is_dir():
        return None
    name, why = _marker_name(marker)
    if name is not None:
        path = root / name
        if path.is_symlink():
            raise CheckpointRefused(f"{marker} names {path}, a symlink: refused (a checkpoint is loaded only "
                                    "from the directory the run wrote)")
        reason = incomplete_reason(path) if STEP_NAME.fullmatch(name) else "is not a step_NNNNNN directory"
        if reason is None:
            return path
        why = f"names {name!r}, which {reason}"
    steps = complete_steps(root)
    if not steps:
        if marker.exists():
            log.warning("%s %s and no complete checkpoint is on disk", marker, why)
        return None
    newest = root / f"step_{steps[-1]:06d}"
    log.warning("%s %s: using the newest complete checkpoint, %s", marker, why, newest.name)
    return newest
