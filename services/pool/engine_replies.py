"""What an :class:`~services.pool.engine_actor.EngineActor` answers the pool's ``start`` and ``health`` calls.

Typed values crossing Ray (pickled), read by attribute in start-up, the fleet and the health watcher. Where a
plain dict is wanted (JSON, logs), ``dataclasses.asdict`` gives the same keys as the fields.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStarted:
    """:meth:`EngineActor.start`'s answer: the vLLM engine is running."""

    engine_id: str
    """The engine actor's name (``<pool>-engine-<i>``)."""
    version: int
    """The policy version its vLLM engine serves (0: the model on disk)."""
    pid: int
    """The actor's process id."""
    incarnation: str
    """``<pid>.<vLLM starts>``: changes when the process or its vLLM engine restarts."""


@dataclass(frozen=True)
class EngineHealth:
    """:meth:`EngineActor.health`'s answer: whether its vLLM engine can serve, and what it holds."""

    engine_id: str
    """The engine actor's name (``<pool>-engine-<i>``)."""
    ok: bool
    """vLLM itself can serve: started, and its engine core alive."""
    error: str
    """Why it cannot serve ('' while ``ok``)."""
    version: int
    """The policy version its vLLM engine serves (0: the model on disk)."""
    synced: bool
    """A push was installed since this vLLM engine started (a restarted one serves the model on disk)."""
    running_batches: int
    """Batches of :meth:`EngineActor.generate` in progress."""
    pid: int
    """The actor's process id."""
    incarnation: str
    """``<pid>.<vLLM starts>``: changes when the process or its vLLM engine restarts."""
